"""int8 with error feedback at 2, 3 and 4 ranks (gloo): the reduced values and every rank's
residual equal a single-process simulation of the same arithmetic, every rank gets the same
result, and a rank's bytes stay under two int8 payloads whatever the number of ranks (the
allgather of every rank's payload it replaces sends ``N - 1``)."""

from __future__ import annotations

import pytest
import torch

from hvd_trainer.comm.reduce.compressed import int8 as q8
from hvd_trainer.comm.reduce.compressed.reductions import int8_scatters
from tests.multiproc import run_workers

BLOCK, STEPS = 256, 3
SHAPES = {"w": (96, 64), "b": (10,)}  # one bucket of 6154 values: 25 blocks


def _tensors(step: int, rank: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return [(name, torch.randn(shape, generator=g) * (1 + rank)) for name, shape in SHAPES.items()]


def _run() -> dict:
    import hvd_trainer as hvd
    from hvd_trainer.comm.reduce.compressed import FeedbackState, reduce_with_feedback

    state = FeedbackState("int8")
    outs, used = [], []
    for step in range(STEPS):
        out, used = reduce_with_feedback(_tensors(step, hvd.rank()), compressor=hvd.Compression.int8,
                                         state=state)
        outs.append(torch.cat([t.reshape(-1) for t in out]))
    return {"outs": outs, "used": used, "bytes": state.bytes_sent,
            "residual": torch.cat([state.residuals[name].reshape(-1) for name in SHAPES])}


def _reference(size: int) -> dict:
    """``size`` simulated ranks: quantise, sum per chunk, requantise, owner keeps the error."""
    n = sum(torch.Size(s).numel() for s in SHAPES.values())
    blocks = -(-n // BLOCK)
    chunk = -(-blocks // size) * BLOCK
    scatter = int8_scatters(n, BLOCK, size)
    padded = size * chunk if scatter else blocks * BLOCK
    residuals = [torch.zeros(padded) for _ in range(size)]
    outs = []
    for step in range(STEPS):
        xs, total = [], torch.zeros(padded)
        for rank in range(size):
            x = torch.zeros(padded)
            x[:n] = torch.cat([t.reshape(-1) for _, t in _tensors(step, rank)]) / size + residuals[rank][:n]
            q, s = q8.quantize(x, BLOCK)
            deq = q8.dequantize(q, s, padded)
            residuals[rank] = x - deq
            total += deq
            xs.append(x)
        if scatter:
            q, s = q8.quantize(total, BLOCK)
            again = q8.dequantize(q, s, padded)
            for owner in range(size):
                part = slice(owner * chunk, (owner + 1) * chunk)
                residuals[owner][part] += (total - again)[part]
            # error feedback's invariant: the residuals hold everything the wire lost
            torch.testing.assert_close(sum(residuals), sum(xs) - again, atol=1e-5, rtol=0)
            total = again
        outs.append(total[:n])
    return {"outs": outs, "residuals": [r[:n] for r in residuals], "n": n}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("size", [2, 3, 4])
def test_int8_equals_the_simulation_and_keeps_its_bytes_at_every_size(size: int) -> None:
    results = run_workers(_run, size, timeout_seconds=240)
    ref = _reference(size)
    assert int8_scatters(ref["n"], BLOCK, size) == (size > 2)
    for rank, got in enumerate(results):
        for step, (out, want) in enumerate(zip(got["outs"], ref["outs"], strict=True)):
            torch.testing.assert_close(out, want, atol=1e-6, rtol=0)
            assert torch.equal(out, results[0]["outs"][step])  # bit-identical on every rank
        torch.testing.assert_close(got["residual"], ref["residuals"][rank], atol=1e-6, rtol=0)
        assert got["used"] == [float(size)] * len(SHAPES)
    payload = q8.payload_bytes(ref["n"], BLOCK, len(SHAPES))
    per_step = results[0]["bytes"] / STEPS
    print(f"\nint8 at {size} ranks: {per_step:.0f} bytes per rank per step; one payload {payload}, "
          f"an allgather would send {(size - 1) * payload}")
    assert per_step <= 2.2 * payload  # two payloads, plus padding and the flags
    if size > 2:
        assert per_step < (size - 1) * payload

"""In-process recovery of ``Trainer(strategy=HorovodStrategy())`` end to end: ``hvdrun -np 2
--min-np 1 --max-np 2`` (in process without ``--recovery``).

Slot 1 is SIGKILLed mid-epoch. The survivor keeps its process (same pid from the start of ``fit``
to its end), re-forms the world alone and continues ``fit`` from its newest commit in memory,
its epoch's remaining samples dealt to it alone; hvdrun's worker entry starts slot 1 again, which
joins at a commit and receives the checkpoint by broadcast. Every sample is trained exactly once
per epoch and both ranks end with the same weights; the same with ``LightningCLI`` and its
config-saving callback. A user error still fails the job at once.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from tests.e2e.hvdrun_helpers import SCRIPTS, alive, hvdrun

SCRIPT = str(SCRIPTS / "lightning_inprocess.py")
IN_PROCESS = ["--min-np", "1", "--max-np", "2"]  # Horovod's line: in process without --recovery
N, EPOCHS = 64, 4


def replay_adam(seen: list[tuple[int, int, int, list[int]]]) -> dict[str, torch.Tensor]:
    """The committed steps of mode ``zero`` in one process: Adam (lr 0.05 x world size) on the
    mean loss over the indices all ranks trained at each step (equal batches per rank, so the
    mean of the ranks' mean gradients)."""
    g = torch.Generator().manual_seed(1)
    xs, ys = torch.randn(N, 4, generator=g), torch.randn(N, 1, generator=g)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.Adam(net.parameters(), lr=0.05)
    for _, size, _, indices in seen:
        optimizer.param_groups[0]["lr"] = 0.05 * size
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(net(xs[indices]), ys[indices]).backward()
        optimizer.step()
    return {f"net.{k}": v for k, v in net.state_dict().items()}


@pytest.mark.parametrize("mode", ["kill", "cli", "zero"])
def test_survivor_continues_fit_and_the_restarted_rank_joins(tmp_path: Path, mode: str) -> None:
    """``cli``: the same with LightningCLI building the Trainer (its SaveConfigCallback saved the
    config once, in the first fit; the joiner neither saves nor broadcasts it again). ``zero``:
    ZeRO stage 2 with Adam, global rank 0 lost (a survivor that was not rank 0 holds the sharded
    state in full in its commit); the result equals one process's Adam over the committed steps."""
    res = hvdrun(["-np", "2", *IN_PROCESS, "python", SCRIPT, str(tmp_path), mode], timeout=150)
    assert res.returncode == 0, res.explain()
    fits = re.findall(r"FIT slot=(\d) pid=(\d+) respawn=(\d)", res.output)
    starts = re.findall(r"START slot=(\d) pid=(\d+) rank=(\d) size=(\d) respawn=(\d) step=(\d+)", res.output)
    dones = re.findall(r"DONE slot=(\d) pid=(\d+) rank=(\d) size=(\d) step=(\d+)", res.output)
    lost, kept = ("0", "1") if mode == "zero" else ("1", "0")  # zero: global rank 0 is the one lost
    # the survivor: one fit call in one process, trained alone after the loss, then with the joiner
    survivor = [pid for slot, pid, _ in fits if slot == kept]
    assert len(survivor) == 1 and {p for s, p, *_ in starts if s == kept} == set(survivor), res.explain()
    alone = [int(step) for s, _, _, size, _, step in starts if s == kept and size == "1"]
    assert alone and alone[0] > 0, res.explain()
    assert (kept, survivor[0], kept, "2") == dones[[d[0] for d in dones].index(kept)][:4], res.explain()
    # the lost slot: started again once, joined a world of 2 mid-fit, and finished in that process
    joiner = [pid for slot, pid, respawn in fits if slot == lost and respawn == "1"]
    assert len(joiner) == 1, res.explain()
    joined = [int(step) for _, p, _, size, _, step in starts if p == joiner[0] and size == "2"]
    assert joined and joined[0] > 0, res.explain()
    assert (lost, joiner[0], lost, "2") == dones[[d[0] for d in dones].index(lost)][:4], res.explain()
    assert "2 -> 1 ranks" in res.output and "(a worker joined): 1 -> 2 ranks" in res.output, res.explain()
    assert "not retried" not in res.output and "starting it again alone (1 of" in res.output, res.explain()
    assert alive([int(p) for _, p, _ in fits]) == [], res.explain()

    ranks = [torch.load(tmp_path / f"final.{slot}.pt") for slot in (0, 1)]
    for name, tensor in ranks[0]["model"].items():
        assert torch.equal(ranks[1]["model"][name], tensor), name
    seen = ranks[0]["seen"]  # (epoch, world size, global step, indices of all ranks): committed steps
    assert seen == ranks[1]["seen"] and ranks[0]["step"] == len(seen), res.explain()
    assert [step for _, _, step, _ in seen] == list(range(len(seen)))  # no step lost or redone
    assert {size for _, size, _, _ in seen} == {1, 2} and seen[-1][1] == 2, res.explain()
    for epoch in range(EPOCHS):  # every sample exactly once per epoch, whatever the world size was
        indices = sorted(i for e, _, _, batch in seen if e == epoch for i in batch)
        assert indices == list(range(N)), (epoch, indices)
    sizes = " ".join(f"{e}:{size}" for e, size, _, _ in seen)
    print(f"SCENARIO lightning-in-process-sigkill ({mode}): {len(seen)} steps (epoch:world size) {sizes}")
    # the survivor redid the steps after its last commit alone, drawing the same random numbers
    # (it restored its own random states of the commit, though the world size changed)
    draws: dict[str, list[str]] = {}
    for step, _, value in re.findall(rf"DRAW slot={kept} step=(\d+) size=(\d) value=([\d.]+)", res.output):
        draws.setdefault(step, []).append(value)
    redone = {step: values for step, values in draws.items() if len(values) > 1}
    assert redone and all(len(set(v)) == 1 for v in redone.values()), (redone, res.explain())
    if mode == "zero":
        for name, tensor in replay_adam(seen).items():
            torch.testing.assert_close(ranks[0]["model"][name], tensor, rtol=1e-5, atol=1e-6, msg=name)
    if mode == "cli":
        assert (tmp_path / "config.yaml").exists()  # saved by rank 0 in the first fit
    else:  # scale_lr_by_world_size follows the world across the re-forms: 0.05 x size
        rates = set(re.findall(r"LR slot=\d size=(\d) lr=([\d.]+)", res.output))
        assert rates == {("2", "0.1000"), ("1", "0.0500")}, (rates, res.explain())


def test_user_error_still_fails_the_job_at_once(tmp_path: Path) -> None:
    res = hvdrun(["-np", "2", *IN_PROCESS, "python", SCRIPT, str(tmp_path), "user"], timeout=120)
    assert res.returncode == 1, res.explain()
    assert "ValueError: bad batch 2" in res.output and "not retried" in res.output, res.explain()
    assert "starting it again" not in res.output and "DONE" not in res.output, res.explain()

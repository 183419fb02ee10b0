"""In-process recovery of Keras 3 elastic training (``hvd_trainer.keras.elastic``) end to end:
``hvdrun -np 2 --min-np 1 --max-np 2`` (in process without --recovery) on the torch backend, and on
TensorFlow when it is installed; on torch also with ZeRO stage 2 (the momentum sharded: each
commit gathers the shards, and each re-form plans them for the new world, 2 -> 1 -> 2).

Slot 1 is SIGKILLed in the middle of an epoch, inside ``model.fit``. The survivor keeps its
process (same pid): the peer's failure leaves ``fit`` (on TensorFlow as the ``UnknownError`` of
the allreduce's ``tf.numpy_function``) and reaches ``elastic.run``, which re-forms the world
alone, restores the ``KerasState`` from memory and calls ``train`` again; the
``DistributedOptimizer`` then reduces over the new world, and the reset callback rescales the
learning rate. The restarted slot 1 joins at the survivor's next commit (``HostsUpdatedInterrupt``
out of ``fit``) and gets the weights and optimizer state by broadcast. Both end with equal
weights and the same committed history, in which every batch of every epoch was committed, in
order, and a batch was trained again only where the world changed (Horovod's rule: resume at
``state.batch``).
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import numpy as np
import pytest

from tests.e2e.hvdrun_helpers import SCRIPTS, alive, clean_env, hvdrun

WORKER = str(SCRIPTS / "keras_inprocess_worker.py")
IN_PROCESS = ["--min-np", "1", "--max-np", "2"]  # Horovod's line: in process without --recovery
STEPS, EPOCHS, LR, KILL_AT = 8, 3, 0.02, 10  # the worker's constants; the kill: once 10 batches are committed

BACKENDS = ["torch"] + (["tensorflow"] if importlib.util.find_spec("tensorflow") else [])
CASES = [(backend, 0) for backend in BACKENDS] + [("torch", 2)]  # (backend, zero_stage)


def _check_history(history: np.ndarray) -> None:
    """Every (epoch, batch) committed once, in order, except a batch trained again right after the
    world changed; a stretch alone between the kill and the join; the learning rate always the
    one scaled for the world it ran in."""
    steps = [(int(e), int(b), int(n)) for e, b, n, _ in history]
    assert sorted({(e, b) for e, b, _ in steps}) == [(e, b) for e in range(EPOCHS) for b in range(STEPS)]
    for (e1, b1, n1), (e2, b2, n2) in zip(steps, steps[1:], strict=False):
        following = (e2, b2) == ((e1, b1 + 1) if b1 + 1 < STEPS else (e1 + 1, 0))
        again = (e2, b2) == (e1, b1) and n2 != n1  # resumed at state.batch in the new world
        assert following or again, (e1, b1, n1, e2, b2, n2)
    # 2 ranks, then 1 after the kill, then 2 again once the restarted rank joined. (A loaded
    # machine may start with 1: --min-np 1 lets the first round form without a late worker,
    # which then joins at a commit.)
    sizes = "".join(str(n) for _, _, n in steps)
    assert re.fullmatch(r"1*2+1+2+", sizes), sizes
    assert np.allclose(history[:, 3], LR * history[:, 2]), history  # the reset callback rescaled it


@pytest.mark.parametrize(("backend", "zero_stage"), CASES)
def test_keras_fit_recovers_in_process(tmp_path: Path, backend: str, zero_stage: int) -> None:
    env = clean_env(KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="3")
    res = hvdrun(["-np", "2", *IN_PROCESS, "python", WORKER, str(tmp_path), str(KILL_AT), str(zero_stage)],
                 timeout=150, env=env)
    assert res.returncode == 0, res.explain()
    pattern = r"START slot=(\d) pid=(\d+) rank=\d size=(\d) respawn=(\d) epoch=\d+ batch=\d+ commits=\d+"
    starts = re.findall(pattern, res.output)
    survivor = {pid for slot, pid, _, _ in starts if slot == "0"}
    assert len(survivor) == 1, res.explain()  # slot 0: one process throughout
    assert ("0", survivor.pop(), "1", "0") in starts, res.explain()  # it ran alone
    assert any(s[0] == "1" and s[2] == "2" and s[3] == "1" for s in starts), res.explain()  # slot 1 rejoined
    assert "2 -> 1 ranks" in res.output and "(a worker joined): 1 -> 2 ranks" in res.output, res.explain()
    assert "restarts used" not in res.output or "0 of" in res.output, res.explain()
    assert alive([int(p) for _, p, _, _ in starts]) == [], res.explain()

    final = [np.load(tmp_path / f"final.{slot}.npz") for slot in (0, 1)]
    for name in final[0].files:  # weights, history and the optimizer's full state alike
        assert np.array_equal(final[0][name], final[1][name]), name
    # the momentum of every weight is there and was trained (with ZeRO: gathered from both shards)
    momentum = [n for n in final[0].files if n.startswith("momentum:") and n.endswith("_momentum")]
    assert len(momentum) == 4 and all(np.abs(final[0][n]).max() > 0 for n in momentum), final[0].files
    assert int(final[0]["epoch"]) == EPOCHS and int(final[0]["batch"]) == 0
    _check_history(final[0]["history"])
    # the survivor's batch trained again after the kill drew what it drew the first time: the
    # commit restored its dropout seed generator and numpy's generator
    draws: dict[str, list[str]] = {}
    for step, rest in re.findall(r"DRAW slot=0 step=(\d+) size=\d (.*)", res.output):
        draws.setdefault(step, []).append(rest)
    again = {k: v for k, v in draws.items() if len(v) > 1}
    assert again and all(len(set(v)) == 1 for v in again.values()), (again, res.explain())

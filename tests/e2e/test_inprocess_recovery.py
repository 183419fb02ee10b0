"""In-process recovery end to end (torch API): ``hvdrun --recovery in-process``.

Rank 1 is SIGKILLed mid-epoch. The survivor keeps its process (same pid), re-forms the world
alone within seconds and goes on from its in-memory commit; hvdrun's worker entry starts rank 1
again alone, and it joins at the survivor's next commit with the state broadcast from it. No
sample is lost or seen twice, and the final weights equal a one-process replay of exactly the
committed steps (bit-identical on CPU).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from tests.e2e.hvdrun_helpers import SCRIPTS, alive, clean_env, fail_time, hvdrun

WORKER = str(SCRIPTS / "inprocess_worker.py")
USER_ERROR = str(SCRIPTS / "elastic_user_error.py")
IN_PROCESS = ["--min-np", "1", "--max-np", "2", "--recovery", "in-process"]
N, BATCH, EPOCHS, KILL_STEP = 128, 4, 2, 10


def replay(history: list[tuple[int, list[list[int]]]], n: int = N, *,
           adam: bool = False) -> dict[str, torch.Tensor]:
    """The committed steps in one process: each step averages the ranks' gradients over the
    samples each rank saw (sum in rank order, then divide: what the allreduce computes)."""
    torch.manual_seed(0)  # the worker's construction, in its order
    xs, ys = torch.randn(n, 4), torch.randn(n, 1)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    optimizer = (torch.optim.Adam(model.parameters(), lr=0.01) if adam else
                 torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    for _, per_rank in history:
        grads = []
        for indices in per_rank:
            model.zero_grad()
            torch.nn.functional.mse_loss(model(xs[indices]), ys[indices]).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for i, p in enumerate(model.parameters()):
            total = grads[0][i].clone()
            for g in grads[1:]:
                total += g[i]
            p.grad = total / len(per_rank)
        optimizer.step()
    return model.state_dict()


def test_rank_0_lost_and_restarted_the_survivor_reports_both_re_forms(tmp_path: Path) -> None:
    """Rank 0 is the one killed: the survivor (slot 1) is rank 0 alone, then rank 1 of the world
    the restarted slot 0 joins; it reports both re-forms (the joiner, rank 0 again, does not)."""
    out = tmp_path / "out.pt"
    res = hvdrun(["-np", "2", *IN_PROCESS, "python", WORKER, str(out), "6", "0.1", "64"], timeout=180,
                 env=clean_env(KILL_SLOT="0", WAIT_FOR_JOINER="1"))
    assert res.returncode == 0, res.explain()
    assert "2 -> 1 ranks" in res.output and "(a worker joined): 1 -> 2 ranks" in res.output, res.explain()
    assert "hvdrun: 1 lost worker started again in process (rank 0: 1; at most" in res.output, res.explain()
    got = torch.load(out)
    assert got["step"] == len(got["history"]) and {len(r) for _, r in got["history"]} == {1, 2}, res.explain()


def test_survivor_keeps_its_process_and_the_restarted_rank_joins(tmp_path: Path) -> None:
    """Horovod's own line, ``-np 2 --min-np 1 --max-np 2`` with no --recovery: in process."""
    out = tmp_path / "out.pt"
    res = hvdrun(["-np", "2", "--min-np", "1", "--max-np", "2", "python", WORKER, str(out), str(KILL_STEP),
                  "0.15"], timeout=180)
    assert res.returncode == 0, res.explain()
    pattern = r"START slot=(\d) pid=(\d+) rank=(\d) size=(\d) respawn=(\d) step=(\d+)"
    starts = re.findall(pattern, res.output)
    survivor = {pid for slot, pid, *_ in starts if slot == "0"}
    assert len(survivor) == 1, res.explain()  # slot 0: one process throughout (its pid never changed)
    # alone, from its in-memory commit
    assert ("0", survivor.pop(), "0", "1", "0", str(KILL_STEP)) in starts, res.explain()
    joined = [s for s in starts if s[0] == "1" and s[4] == "1"]
    assert joined and joined[0][3] == "2" and int(joined[0][5]) > KILL_STEP, res.explain()  # slot 1 rejoined
    assert "2 -> 1 ranks" in res.output and "1 -> 2 ranks (" not in res.output, res.explain()
    assert "(a worker joined): 1 -> 2 ranks" in res.output, res.explain()
    assert "restarts used" not in res.output or "0 of" in res.output, res.explain()
    assert "hvdrun: 1 lost worker started again in process (rank 1: 1; at most" in res.output, res.explain()
    assert alive([int(p) for _, p, *_ in starts]) == [], res.explain()

    got = torch.load(out)
    steps = len(got["history"])
    assert got["step"] == steps and steps > N * EPOCHS // (2 * BATCH), res.explain()  # some steps ran alone
    for epoch in range(EPOCHS):  # every sample exactly once per epoch, whatever the world size was
        seen = sorted(i for e, per_rank in got["history"] if e == epoch for r in per_rank for i in r)
        assert seen == list(range(N)), (epoch, seen)
    want = replay(got["history"])
    for name, tensor in want.items():
        assert torch.equal(got["model"][name], tensor), name  # bit-identical

    # the survivor's next completed step came within 3 s of the kill
    killed = fail_time(res.output)
    after = [t for t in got["done_at"] if t > killed]
    print(f"SCENARIO in-process-sigkill: survivor's next step done {after[0] - killed:.2f} s after the kill")
    assert after[0] - killed < 3.0, res.explain()
    # where the restarted worker's time went, from the kill to its first step in the new world
    (boot, imported, joined, first), = [tuple(float(v) for v in m) for m in re.findall(
        r"JOINER boot=([\d.]+) imported=([\d.]+) joined=([\d.]+) first_step=([\d.]+)", res.output)]
    print(f"SCENARIO in-process-joiner: script started {boot - killed:.2f} s after the kill, imports "
          f"{imported - boot:.2f} s, hvd.init() (joining at the survivors' next commit) "
          f"{joined - imported:.2f} s, first step {first - joined:.2f} s later: "
          f"{first - boot:.2f} s from its start")
    assert killed < boot < imported < joined < first, res.explain()


@pytest.mark.parametrize("zero_stage, kill_slot", [(1, "0"), (2, "1")])
def test_zero_sharded_adam_goes_2_1_2_in_process(tmp_path: Path, zero_stage: int, kill_slot: str) -> None:
    """ZeRO: each commit holds the full Adam state on every rank; the survivor plans the shards
    again for the world of 1 (then of 2 with the joiner) from it, and the result equals one
    process's Adam over exactly the committed steps."""
    out = tmp_path / "out.pt"
    res = hvdrun(["-np", "2", "--min-np", "1", "--max-np", "2", "python", WORKER, str(out), "6", "0.1", "64"],
                 timeout=180,
                 env=clean_env(KILL_SLOT=kill_slot, ZERO_STAGE=str(zero_stage), WAIT_FOR_JOINER="1"))
    assert res.returncode == 0, res.explain()
    assert "2 -> 1 ranks" in res.output and "(a worker joined): 1 -> 2 ranks" in res.output, res.explain()
    got = torch.load(out)
    assert {len(r) for _, r in got["history"]} == {1, 2}, res.explain()  # steps at 2, 1 and 2 ranks
    for epoch in range(EPOCHS):
        seen = sorted(i for e, per_rank in got["history"] if e == epoch for r in per_rank for i in r)
        assert seen == list(range(64)), (epoch, seen)
    want = replay(got["history"], 64, adam=True)
    for name, tensor in want.items():
        torch.testing.assert_close(got["model"][name], tensor, rtol=1e-6, atol=1e-7, msg=name)


def test_user_error_still_fails_the_job_at_once(tmp_path: Path) -> None:
    res = hvdrun(["-np", "2", *IN_PROCESS, "python", USER_ERROR, "user", str(tmp_path)], timeout=120)
    assert res.returncode == 1, res.explain()
    assert "ValueError: bad batch 2" in res.output and "not retried" in res.output, res.explain()
    assert "starting it again" not in res.output, res.explain()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["attempt.0.0", "attempt.0.1"]  # one attempt each


def test_in_process_needs_an_elastic_job() -> None:
    res = hvdrun(["-np", "2", "--recovery", "in-process", "python", "-c", "pass"], timeout=60)
    assert res.returncode != 0 and "--recovery in-process needs an elastic job" in res.output, res.explain()


def test_a_process_set_of_the_old_world_is_refused_after_a_reform() -> None:
    """Its group was released with the old world; a collective on it says so at once (before,
    it fell back to torch's default group, the new world's, and hung)."""
    script = str(SCRIPTS / "inprocess_process_set.py")
    res = hvdrun(["-np", "3", "--min-np", "2", "--max-np", "3", "python", script], timeout=120)
    assert res.returncode != 0, res.explain()
    assert "world re-formed in process" in res.output, res.explain()
    assert "CommValueError: allreduce got ProcessSet(process_set_id=1, ranks=[0, 2]), whose world has ended" \
        in res.output, res.explain()
    assert "DONE" not in res.output, res.explain()

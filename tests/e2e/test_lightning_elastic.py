"""Lightning elastic recovery end to end: rank 1 is SIGKILLed mid-epoch, torchrun restarts both
workers, ``Trainer(strategy="horovod")`` resumes from its last commit by itself (no
``ckpt_path``), and the final weights equal an uninterrupted run's bit for bit."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from tests.e2e.hvdrun_helpers import SCRIPTS, alive, fail_time, hvdrun, pids_from

SCRIPT = str(SCRIPTS / "lightning_elastic.py")
KILL_STEP = 10  # commits every 3 steps and at epoch ends (8 steps): the last one is at step 9
STEPS = 24  # 3 epochs x 64 samples / (2 ranks x batch 4)


def test_killed_rank_resumes_fit_mid_epoch_with_identical_weights(tmp_path: Path) -> None:
    ref = hvdrun(["-np", "2", "python", SCRIPT, str(tmp_path / "ref.pt"), "-1"], timeout=150)
    assert ref.returncode == 0, ref.explain()
    assert "resumed from" not in ref.output, ref.explain()  # not elastic without restarts
    res = hvdrun(["-np", "2", "--min-np", "2", "--max-np", "2", "--recovery", "restart", "python", SCRIPT,
                  str(tmp_path / "run.pt"), str(KILL_STEP)], timeout=240)
    assert res.returncode == 0, res.explain()
    assert "START rank=1 attempt=0 step=0" in res.output, res.explain()
    # the strategy restored the commit of step 9 (4th: steps 3, 6, epoch end 8, 9), mid-epoch 1
    assert re.search(r"attempt 1 resumed from \S+lightning_fit0\.ckpt \(commit 4, global step 9, "
                     r"epoch 1, batch 1 of that epoch\)", res.output), res.explain()
    for rank in (0, 1):
        assert f"START rank={rank} attempt=1 step=9 epoch=1" in res.output, res.explain()
        assert f"DONE rank={rank} step={STEPS}" in res.output, res.explain()
    assert alive(pids_from(res.output)) == [], res.explain()

    resumed = float(re.search(r"START rank=0 attempt=1 .* at=(\d+\.\d+)", res.output).group(1))
    seconds = resumed - fail_time(res.output)
    print(f"SCENARIO lightning-elastic-sigkill: resumed {seconds:.1f} s after the kill")
    assert seconds < 60, res.explain()

    want, got = torch.load(tmp_path / "ref.pt"), torch.load(tmp_path / "run.pt")
    assert got["step"] == want["step"] == STEPS
    for name, tensor in want["model"].items():
        assert torch.equal(got["model"][name], tensor), name  # bit-identical
    assert got["seen"] == want["seen"]  # same batches in the same order
    for epoch in range(3):  # every sample exactly once per epoch over both ranks
        indices = sorted(i for e, batch in got["seen"] if e == epoch for i in batch)
        assert indices == list(range(64)), (epoch, indices)

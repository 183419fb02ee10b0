"""``hvdrun --mpi`` across two namespace hosts: Open MPI's mpirun starts h2's processes through the
test's sshd on h2 (hvdrun's ``-p``/``-i``/``--ssh-option`` become mpirun's ``plm_rsh_args``)."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest

from hvd_trainer.launch.commands import find_mpirun
from tests.e2e.hvdrun_helpers import clean_env
from tests.multihost.helpers import HVDRUN, SCRIPTS, explain, records, run_on_hosts
from tests.multihost.netns import cluster
from tests.multihost.sshd import hvdrun_ssh_args, make_keys, ssh_skip_reason, start_sshd

pytestmark = [pytest.mark.timeout(180),
              pytest.mark.skipif(ssh_skip_reason() is not None, reason=str(ssh_skip_reason())),
              pytest.mark.skipif(find_mpirun() is None, reason="needs Open MPI's mpirun (PATH or the venv)")]


def test_mpirun_starts_the_other_host_and_allreduce_spans_both(tmp_path: Path) -> None:
    keys = make_keys(tmp_path / "keys")
    work = tmp_path / "work"
    work.mkdir()
    shutil.copy(SCRIPTS / "probe.py", work / "probe.py")
    with cluster(2) as c:
        h1, h2 = c.hosts
        start_sshd(h2, keys)
        sshd = set(h2.pids())
        start = time.monotonic()
        (run,) = run_on_hosts([h1], [*HVDRUN, "--mpi", "-np", "4", "-H", "h1:2,h2:2", *hvdrun_ssh_args(keys),
                                     "python", "probe.py"],
                              env=clean_env(HOROVOD_TEST_MARK="via-mpirun"), cwd=str(work), timeout=150)
        print(f"mpirun 2 hosts x 2 processes: {time.monotonic() - start:.1f} s")
        assert run.returncode == 0, explain([run])
        got = {int(rank): info for rank, info in records(run.output, "PROBE")}
        assert sorted(got) == [0, 1, 2, 3], explain([run])
        assert [got[r]["host"] for r in range(4)] == ["h1", "h1", "h2", "h2"]  # mpirun fills -H in order
        for info in got.values():
            assert (info["sum"], info["mark"], info["cwd"]) == (10.0, "via-mpirun", str(work))
        deadline = time.monotonic() + 10
        while any(p not in sshd for p in h2.pids()) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert [p for p in h2.pids() if p not in sshd] == [] and h1.pids() == []

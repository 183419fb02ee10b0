"""The job secret: proofs at init (comm.world.membership) and hvdrun's side (launch.secret).

Ranks are threads sharing one real in-process store (``HashStore``); the multi-host case (a
stranger's torchrun agent joining the rendezvous) is in tests/multihost/test_faults_secret.py.
"""

from __future__ import annotations

import socket
import threading

import pytest
import torch.distributed as dist

from hvd_trainer.comm.base.errors import JobSecretError
from hvd_trainer.comm.world.membership import SECRET_ENV, check_membership, proof, strangers
from hvd_trainer.launch import cli
from hvd_trainer.launch.options import parse_options
from hvd_trainer.launch.secret import MASK, job_secret, masked

pytestmark = pytest.mark.timeout(60)


def _run_ranks(secrets_by_rank: list[str | None], namespace: str = "w1") -> dict[int, BaseException | None]:
    store = dist.HashStore()
    results: dict[int, BaseException | None] = {}

    def rank_main(rank: int) -> None:
        env = {SECRET_ENV: secrets_by_rank[rank]} if secrets_by_rank[rank] else {}
        try:
            check_membership(store, rank, len(secrets_by_rank), namespace, environ=env, timeout_seconds=10)
            results[rank] = None
        except BaseException as exc:  # noqa: BLE001 - the test inspects it
            results[rank] = exc

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(len(secrets_by_rank))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return results


def test_ranks_with_the_same_secret_or_none_at_all_pass() -> None:
    assert _run_ranks(["s3cret"] * 3) == {0: None, 1: None, 2: None}
    assert _run_ranks([None, None]) == {0: None, 1: None}


def test_a_rank_with_another_secret_is_named_by_every_member_and_refuses_itself() -> None:
    results = _run_ranks(["good", "good", "other"])
    for rank in range(3):
        assert isinstance(results[rank], JobSecretError), results
    for rank in (0, 1):
        assert str(results[rank]).startswith("rank 2 (pid ")
        assert "joined this job without its secret (HOROVOD_SECRET_KEY)" in str(results[rank])
    assert "rank 0 (pid" in str(results[2]) and "rank 1 (pid" in str(results[2])  # its view: the others


def test_a_rank_without_a_secret_learns_it_is_the_stranger() -> None:
    results = _run_ranks(["good", None])
    assert isinstance(results[1], JobSecretError) and "has no HOROVOD_SECRET_KEY" in str(results[1])
    assert isinstance(results[0], JobSecretError) and str(results[0]).startswith("rank 1 (pid ")


def test_a_proof_is_bound_to_its_rank_and_world() -> None:
    p = proof("k", "w1", 0)
    assert strangers({0: f"{p}|h1|10"}, "k", "w1") == []
    assert strangers({1: f"{p}|h1|10"}, "k", "w1") == [(1, "h1", "10")]  # copied to another rank
    assert strangers({0: f"{p}|h1|10"}, "k", "w2") == [(0, "h1", "10")]  # from an earlier world
    assert "k" not in p and len(p) == 64


def test_hvdrun_makes_a_secret_per_job_and_takes_the_users_when_set() -> None:
    one, _ = parse_options(["-np", "2", "x.py"])
    assert one is not None
    first, warn = job_secret(one, {})
    second, _ = job_secret(one, {})
    assert warn is None and first and second and first != second and len(first) == 32
    assert job_secret(one, {SECRET_ENV: "mine"}) == ("mine", None)
    ssh, _ = parse_options(["-np", "4", "-H", "a:2,b:2", "x.py"])  # one command, over ssh
    assert ssh is not None and job_secret(ssh, {})[0] is not None
    multi, _ = parse_options(["-np", "4", "-H", "a:2,b:2", "--no-ssh", "x.py"])  # the same line on each
    assert multi is not None
    secret, warn = job_secret(multi, {})
    assert secret is None and warn is not None and f"export the same {SECRET_ENV} on every host" in warn
    assert job_secret(multi, {SECRET_ENV: "shared"}) == ("shared", None)
    assert masked({SECRET_ENV: "x", "A": "1"}) == {SECRET_ENV: MASK, "A": "1"}


def test_dry_run_shows_the_secret_masked_never_its_value(capsys, monkeypatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID", "OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(SECRET_ENV, "do-not-print-me")
    here = socket.gethostname()
    for extra in ([], ["--mpi"], ["-H", f"{here}:1,b:1", "--no-ssh"], ["-H", "a:1,b:1"]):
        assert cli.main(["--dry-run", "-np", "2", *extra, "x.py"]) == 0
        captured = capsys.readouterr()
        assert "do-not-print-me" not in captured.out + captured.err
    assert cli.main(["--dry-run", "-np", "2", "x.py"]) == 0
    assert f"{SECRET_ENV}='{MASK}'" in capsys.readouterr().out
    assert cli.main(["--dry-run", "--mpi", "-np", "2", "x.py"]) == 0
    assert f"-x {SECRET_ENV} " in capsys.readouterr().out  # by name only

"""Join the job with ``hvd.init()`` and write what this rank sees to ``$HVD_TEST_OUT/rank<r>.json``.

Used by tests/engines (Kubernetes "pods", Slurm ``srun``/``sbatch``): the world as
``hvd_trainer`` detected it from the launcher's variables alone, plus two collectives whose
values are closed-form in the ranks (``sum(rank + 1)`` and the gathered ranks).
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import torch

import hvd_trainer as hvd
from hvd_trainer.comm.world.world import detect_launch_env

torch.set_num_threads(1)
launch = detect_launch_env()
world = hvd.init(timeout_seconds=60)
total = hvd.allreduce(torch.tensor([float(world.rank + 1)]), op=hvd.Sum).item()
ranks = hvd.allgather(torch.tensor([world.rank])).tolist()
report = {
    "rank": world.rank, "size": world.size, "local_rank": world.local_rank,
    "local_size": world.local_size, "cross_rank": world.cross_rank, "cross_size": world.cross_size,
    "launcher": launch.launcher, "master_addr": launch.master_addr, "master_port": launch.master_port,
    "sum_rank_plus_1": total, "gathered_ranks": ranks, "pod": os.environ.get("HVD_TEST_POD"),
    "host": socket.gethostname(), "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
}
out = Path(os.environ["HVD_TEST_OUT"])
out.mkdir(parents=True, exist_ok=True)
(out / f"rank{world.rank}.json").write_text(json.dumps(report))
hvd.shutdown()

"""What a rank sees: ``PROBE <rank> {host, cwd, mark, sum}`` (``mark`` = $HOROVOD_TEST_MARK).

``--fail-rank R``: rank R raises after the allreduce, the others wait in a barrier (they must be
stopped by the failure). ``--sleep S``: every rank prints ``READY <rank> {...}`` and sleeps.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import time

import torch

import hvd_trainer.torch as hvd


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--fail-rank", type=int)
    p.add_argument("--sleep", type=float)
    args = p.parse_args()
    hvd.init()
    rank = hvd.rank()
    total = hvd.allreduce(torch.tensor([float(rank + 1)]), op=hvd.Sum).item()
    info = {"host": socket.gethostname(), "cwd": os.getcwd(), "mark": os.environ.get("HOROVOD_TEST_MARK"),
            "sum": total, "pid": os.getpid()}
    print(f"PROBE {rank} {json.dumps(info)}", flush=True)
    if args.sleep:
        print(f"READY {rank} {json.dumps(info)}", flush=True)
        time.sleep(args.sleep)
    if args.fail_rank == rank:
        print(f"FAIL_AT {time.time():.3f}", flush=True)
        raise SystemExit(f"rank {rank} fails on purpose")
    if args.fail_rank is not None:
        hvd.barrier()
    hvd.shutdown()


if __name__ == "__main__":
    main()

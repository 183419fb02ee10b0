"""What Horovod's examples/pytorch/pytorch_synthetic_benchmark.py does, with hvd_trainer's import.

A conv net on random data, ``DistributedOptimizer(named_parameters=..., compression=fp16,
op=hvd.Average)``, broadcast of parameters and optimizer state, warm-up then timed iterations,
and the images/s of every rank summed as Horovod's example prints it.
"""

from __future__ import annotations

import sys
import timeit

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import hvd_trainer.torch as hvd  # was: import horovod.torch as hvd

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from standin import report  # noqa: E402

BATCH, WARMUP, ITERS, BATCHES_PER_ITER = 8, 2, 3, 2


def main() -> None:
    hvd.init()
    torch.set_num_threads(1)
    torch.manual_seed(hvd.rank())
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(4), nn.Flatten(),
                          nn.Linear(128, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size())
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=hvd.Compression.fp16, op=hvd.Average)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    data = torch.randn(BATCH, 3, 32, 32)
    target = torch.LongTensor(BATCH).random_() % 10

    def benchmark_step() -> None:
        optimizer.zero_grad()
        F.cross_entropy(model(data), target).backward()
        optimizer.step()

    timeit.timeit(benchmark_step, number=WARMUP)
    img_secs = []
    for x in range(ITERS):
        t = timeit.timeit(benchmark_step, number=BATCHES_PER_ITER)
        img_secs.append(BATCH * BATCHES_PER_ITER / t)
        if hvd.rank() == 0:
            print(f"Iter #{x}: {img_secs[-1]:.1f} img/sec per CPU")
    mean = float(np.mean(img_secs))
    total = hvd.allreduce(torch.tensor(mean), op=hvd.Sum, name="img_secs").item()
    if hvd.rank() == 0:
        print(f"Total img/sec on {hvd.size()} CPU(s): {total:.1f}")
    report("torch_synthetic_benchmark", hvd.rank(), mean=mean, total=total,
           weights=torch.cat([p.detach().flatten() for p in model.parameters()]).tolist())


if __name__ == "__main__":
    main()

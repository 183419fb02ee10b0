"""Per-step cost of gradient synchronisation on one GPU: our hook reducer vs torch DDP vs none.

Run (a CUDA machine; a world of one over NCCL): ``python bench/gpu_step_overhead.py``
Options: ``--model resnet50|mlp`` (resnet50 needs torchvision), ``--batch 64``, ``--steps 40``,
``--repeats 3``. Without CUDA it runs on the CPU with a small MLP (a smoke test, not a number).

Each variant runs forward + backward + SGD step of the same model on the same batch:
``plain`` (no communication), ``ddp`` (``DistributedDataParallel``, C++ reducer, 25 MiB buckets)
and ``hvd`` (:class:`~hvd_trainer.comm.GradientReducer` hooks + fused NCCL allreduce, the path of
``Trainer(strategy="horovod")`` and ``hvd.DistributedOptimizer``). In a world of one the
allreduce moves no bytes between GPUs, so the ratios isolate the per-step bookkeeping and launch
cost that each framework adds; the median over ``--repeats`` interleaved runs is compared.

Prints, last:
    RATIO hvd_vs_ddp_step_cuda=<x>       (< 1: faster than DDP)
    RATIO hvd_vs_plain_step_cuda=<x>
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import hvd_trainer as hvd
from hvd_trainer.comm import GradientReducer


def _model(name: str) -> torch.nn.Module:
    if name == "resnet50":
        import torchvision

        return torchvision.models.resnet50()
    layers = [m for _ in range(30) for m in (torch.nn.Linear(256, 256), torch.nn.ReLU())]
    return torch.nn.Sequential(*layers, torch.nn.Linear(256, 10))


def _timed(step, steps: int, device: torch.device) -> float:
    for _ in range(5):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps * 1e3


def _make_step(model, opt, x, y, reducer: GradientReducer | None):
    def step() -> None:
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        if reducer is not None:
            reducer.wait()
        opt.step()

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--model", default=None, help="resnet50 (default on CUDA) or mlp")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    world = hvd.init()
    device = world.device
    name = args.model or ("resnet50" if device.type == "cuda" else "mlp")
    model = _model(name).to(device)
    if name == "resnet50":
        x = torch.randn(args.batch, 3, 224, 224, device=device)
    else:
        x = torch.randn(args.batch, 256, device=device)
    y = torch.randint(0, 10, (args.batch,), device=device)
    ddp = torch.nn.parallel.DistributedDataParallel(
        model, device_ids=[device.index] if device.type == "cuda" else None
    )
    times: dict[str, list[float]] = {"plain": [], "ddp": [], "hvd": []}
    for _ in range(args.repeats):
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        times["plain"].append(_timed(_make_step(model, opt, x, y, None), args.steps, device))
        times["ddp"].append(_timed(_make_step(ddp, opt, x, y, None), args.steps, device))
        reducer = GradientReducer(model.named_parameters(), world=world)
        times["hvd"].append(_timed(_make_step(model, opt, x, y, reducer), args.steps, device))
        reducer.remove()
    med = {k: statistics.median(v) for k, v in times.items()}
    n = sum(1 for _ in model.parameters())
    print(f"device={device} model={name} params={n} batch={args.batch} "
          + " ".join(f"{k}={v:.3f}ms/step" for k, v in med.items()))
    print(f"RATIO hvd_vs_ddp_step_cuda={med['hvd'] / med['ddp']:.3f}")
    print(f"RATIO hvd_vs_plain_step_cuda={med['hvd'] / med['plain']:.3f}")
    hvd.shutdown()


if __name__ == "__main__":
    main()

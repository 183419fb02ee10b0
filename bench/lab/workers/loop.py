"""A plain torch training loop on the lab: hvd_trainer's ``DistributedOptimizer`` vs torch DDP.

Modes (``--modes``, run in this order in the same processes, ``--rounds`` times):
``hvd`` (defaults), ``hvd_bf16`` (``compression=bf16``), ``hvd_zero1`` / ``hvd_zero2``
(``zero_stage=1`` / ``2``: the momentum buffers sharded; stage 2 also the gradients; with
``_overlap``: ``zero_overlap_exchange=True``, the parameter exchange overlapping the next
forward), ``ddp``
(defaults), ``ddp_bf16`` (DDP's ``bf16_compress_hook``), and ``local`` (no communication at
all: the compute time; run it without a launcher). Each mode builds the same model from the
same seed, takes ``--warmup`` steps, then times ``--steps`` between two barriers and prints
one ``LAB`` record per rank.
"""

from __future__ import annotations

import argparse

import torch

from bench.lab.models import ResNetSmall, synthetic_batch
from bench.lab.workers.common import Window, emit, reducer_layout

MODES = ("hvd", "hvd_bf16", "hvd_zero1", "hvd_zero2", "hvd_zero1_overlap", "hvd_zero2_overlap", "ddp",
         "ddp_bf16", "local")


def _wrap(mode: str, model: torch.nn.Module) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    import hvd_trainer as hvd

    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    if mode == "local":
        return model, opt
    if mode.startswith("hvd"):
        compression = hvd.Compression.bf16 if mode == "hvd_bf16" else hvd.Compression.none
        zero_stage = int(mode[len("hvd_zero")]) if mode.startswith("hvd_zero") else 0
        return model, hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                               compression=compression, zero_stage=zero_stage,
                                               zero_overlap_exchange=mode.endswith("_overlap"))
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    ddp = torch.nn.parallel.DistributedDataParallel(model)
    if mode == "ddp_bf16":
        ddp.register_comm_hook(None, _bf16_hook(default_hooks.bf16_compress_hook))
    return ddp, opt


def _bf16_hook(hook):  # noqa: ANN001, ANN202
    """DDP's own ``bf16_compress_hook`` under another name: DDP refuses that name unless it runs on
    NCCL 2.10+ (a check by name, torch/nn/parallel/distributed.py ``_check_comm_hook``), while the
    hook itself (cast to bf16, allreduce, cast back) runs on gloo as well."""

    def ddp_bf16_compress(state, bucket):  # noqa: ANN001, ANN202
        return hook(state, bucket)

    return ddp_bf16_compress


def run_mode(mode: str, round_: int, steps: int, warmup: int, batch: int) -> None:
    """Train ``warmup + steps`` steps in ``mode``; print the timed window's record."""
    import hvd_trainer as hvd

    distributed = mode != "local"
    rank = hvd.rank() if distributed else 0
    torch.manual_seed(0)
    net, opt = _wrap(mode, ResNetSmall())
    x, y = synthetic_batch(batch, seed=rank)
    window = Window()
    for i in range(warmup + steps):
        if i == warmup:
            if distributed:
                hvd.barrier()
            window.start()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
    if distributed:
        hvd.barrier()
    emit(workload="loop", mode=mode, round=round_, steps=steps, batch=batch,
         world=hvd.size() if distributed else 1, **window.stop(),
         **reducer_layout(getattr(opt, "_reducer", None)))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--modes", default="hvd,ddp")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--batch", type=int, default=32)
    args = p.parse_args()
    modes = args.modes.split(",")
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        raise SystemExit(f"unknown loop modes {unknown}; choose from {MODES}")
    torch.set_num_threads(1)
    if modes != ["local"]:
        import hvd_trainer as hvd

        hvd.init()
    for r in range(args.rounds):
        for mode in modes:
            run_mode(mode, r, args.steps, args.warmup, args.batch)


if __name__ == "__main__":
    main()

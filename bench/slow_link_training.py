"""Slow-link training modes side by side: synchronous fp32, bf16, int8 and PowerSGD with error
feedback, DiLoCo local steps; a small GPT (the recipe's model and Shakespeare bytes) or a small
CNN (scikit-learn's 8x8 digits) in a plain torch loop.

Run every mode under the same launcher (the shaped-link lab runs it on its namespace hosts):

    hvdrun -np 2 python -m bench.slow_link_training --mode sync --steps 200
    hvdrun -np 2 python -m bench.slow_link_training --mode powersgd:4 --steps 200
    hvdrun -np 2 python -m bench.slow_link_training --mode localsgd:32 --steps 200 --model cnn
    python -m bench.slow_link_training --mode local --steps 200      # compute only, one process

Modes: ``sync`` (fp32 allreduce of the gradients every step), ``bf16``, ``int8``,
``powersgd[:R]`` (rank R, default the library's), ``localsgd[:H]`` (DiLoCo, outer step every H
steps, default 32), ``localsgd_int8[:H]`` (the same, the outer gradient int8-quantised),
``localsgd_overlap[:H]`` (the same, its outer step hidden behind ``H // 4`` inner steps: ``overlap_steps``),
``localsgd_overlap_bf16[:H]`` (the same, the outer gradient in bf16), ``localsgd_stream[:H]``
(Streaming DiLoCo: 4 parts, one part's outer step every ``H / 4`` steps, hidden behind
``H / 8``: ``fragments=4, overlap_steps=H // 8``), ``auto``
(``compression="auto"``: the link probe's choice), ``local`` (no communication; world of one),
and torch's own for comparison: ``ddp`` (DDP,
fp32) and ``ddp_powersgd[:R]`` (DDP with its PowerSGD comm hook, error feedback and warm start,
compressing from the 2nd step, or from ``--ddp-powersgd-start``; its bytes are not counted by
hvd_trainer: ``comm_bytes_sent=-1``,
the lab's interface counters still are). Each rank prints one ``LAB {json}`` record
(``bench.lab.records`` reads it: the timed window's seconds, steps, the host's interface bytes)
with ``val_loss`` and ``comm_bytes_sent`` (what hvd_trainer's comm layer counted for this rank:
ring-collective payload, see ``GradientReducer.wire_bytes_sent`` and ``OuterSync.bytes_sent``);
rank 0 also prints a ``RESULT`` line. :func:`run_mode` is the workload function.

Subnormal floats are flushed to zero (``torch.set_flush_denormal``) so that the step times
compare communication, not a trajectory's subnormal arithmetic. The timed window excludes
``--warmup`` steps and validation. ``--eval-every N`` also validates
every N steps (not timed) and adds the ``curve`` of (step, training seconds, val_loss, bytes) to
the record: the lab's time-to-loss figures (``python -m bench.lab --workloads slow_link``).
Validation runs on every rank on the same held-out data after the last step (local steps: after
a final outer step, so the ranks' weights are equal).
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from bench.lab.workers.common import Window, emit
from hvd_trainer.comm.ops.compression import DEFAULT_POWERSGD_RANK

__all__ = ["MODES", "SlowLinkArgs", "parse_mode", "run_mode"]

MODES = ("sync", "bf16", "int8", "powersgd", "localsgd", "localsgd_int8", "localsgd_overlap",
         "localsgd_overlap_bf16", "localsgd_stream", "auto", "local", "ddp", "ddp_powersgd")


@dataclass
class SlowLinkArgs:
    """One run of one mode."""

    mode: str = "sync"
    model: str = "gpt"
    steps: int = 50
    warmup: int = 3
    batch: int = 16
    """Sequences (gpt) or images (cnn) per rank per step."""
    lr: float = 3e-3
    seed: int = 0
    round: int = 0
    val_batches: int = 8
    eval_every: int = 0
    """Also validate after every this many steps (warmup steps counted; 0: at the end only),
    outside the timed window: the record's ``curve`` of (step, train seconds, val_loss)."""
    outer_lr: float = 0.7
    """Local-steps modes: the outer SGD's learning rate (DiLoCo: 0.7)."""
    outer_momentum: float = 0.9
    """Local-steps modes: the outer Nesterov momentum (DiLoCo: 0.9; 0: none)."""
    stop_below: float = 0.0
    """With ``eval_every``: stop at the first validation at or after ``min_steps`` whose
    val_loss is at most this (0: run every step)."""
    min_steps: int = 0
    ddp_powersgd_start: int = 2
    """``ddp_powersgd``: plain allreduce steps before its PowerSGD starts (``PowerSGDState``'s
    ``start_powerSGD_iter``; torch's default is 1,000)."""
    schedule_steps: int = 0
    """0: AdamW at the constant ``lr``, no weight decay. N > 0: AdamW as the GPT recipe configures
    it (betas 0.9 / 0.99, weight decay 0.1 on matrices, ``recipes._gpt_config.OptimConfig``) with
    its schedule: linear warm-up, cosine decay from ``lr`` to its ``min_lr`` at step N, then
    ``min_lr``."""

STREAM_FRAGMENTS = 4
"""``localsgd_stream``'s parts (``fragments``)."""


def parse_mode(mode: str) -> tuple[str, int]:
    """``"powersgd:4"`` -> ``("powersgd", 4)``; the number defaults to the library's PowerSGD rank
    (``powersgd``; :data:`~hvd_trainer.comm.ops.compression.DEFAULT_POWERSGD_RANK`), 4
    (``ddp_powersgd``) or 32 (local steps' H), and is 0 for the other modes.

    Raises:
        ValueError: an unknown mode or a bad number.
    """
    name, _, num = mode.partition(":")
    if name not in MODES:
        raise ValueError(f"unknown mode {mode!r}; choose from {MODES} (powersgd:R, localsgd:H).")
    default = {"powersgd": DEFAULT_POWERSGD_RANK, "localsgd": 32, "localsgd_int8": 32, "localsgd_overlap": 32,
               "localsgd_overlap_bf16": 32, "localsgd_stream": 32, "ddp_powersgd": 4}.get(name, 0)
    if num and (not num.isdigit() or int(num) < 1 or not default):
        raise ValueError(f"mode {mode!r}: only powersgd:R, ddp_powersgd:R and the localsgd*:H modes "
                         "take a number >= 1.")
    return name, int(num) if num else default


# -- models and data ---------------------------------------------------------------------------
class _Digits:
    """scikit-learn's 1,797 8x8 digits: the last 297 are validation."""

    def __init__(self) -> None:
        from sklearn.datasets import load_digits

        d = load_digits()
        x = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0
        y = torch.tensor(d.target, dtype=torch.long)
        self.train, self.val = (x[:1500], y[:1500]), (x[1500:], y[1500:])

    def batch(self, n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.randint(0, self.train[0].shape[0], (n,), generator=gen)
        return self.train[0][idx], self.train[1][idx]

    def val_batches(self, n: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        x, y = self.val
        return [(x[i : i + n], y[i : i + n]) for i in range(0, min(len(x), n * count), n)]

    tokens_per_sample = 1


class _Bytes:
    """Shakespeare bytes (the GPT recipe's data): random windows for training, fixed ones for
    validation."""

    def __init__(self, block: int) -> None:
        from recipes._gpt_data import load_split

        self.block = block
        self.train_bytes, self.val_bytes = (t.long() for t in load_split(0.05))

    def _windows(self, data: torch.Tensor, starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = torch.stack([data[s : s + self.block + 1] for s in starts.tolist()])
        return rows[:, :-1], rows[:, 1:]

    def batch(self, n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        return self._windows(self.train_bytes, torch.randint(0, len(self.train_bytes) - self.block - 1, (n,),
                                                             generator=gen))

    def val_batches(self, n: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        stride = (len(self.val_bytes) - self.block - 1) // (n * count)
        starts = torch.arange(n * count) * stride
        return [self._windows(self.val_bytes, starts[i * n : (i + 1) * n]) for i in range(count)]

    @property
    def tokens_per_sample(self) -> int:
        return self.block


def _cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),
        nn.MaxPool2d(2), nn.Flatten(), nn.Linear(64 * 16, 128), nn.ReLU(), nn.Linear(128, 10))


def _build(model: str) -> tuple[nn.Module, _Digits | _Bytes]:
    if model == "cnn":
        return _cnn(), _Digits()
    from recipes._gpt_data import VOCAB_SIZE
    from recipes._gpt_model import GPT, GPTShape

    shape = GPTShape(vocab_size=VOCAB_SIZE, block_size=128, n_layer=3, n_head=4, n_embd=96, dropout=0.0)
    return GPT(shape), _Bytes(shape.block_size)


def _loss(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    out = net(x)
    return F.cross_entropy(out.flatten(0, 1) if out.dim() == 3 else out, y.flatten() if out.dim() == 3 else y)


# -- one mode ----------------------------------------------------------------------------------
def _ddp(name: str, num: int, net: nn.Module, start: int = 2) -> nn.Module:
    """``net`` in torch's DDP (``ddp``), with DDP's PowerSGD hook for ``ddp_powersgd``."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

    if name != "ddp_powersgd":
        return nn.parallel.DistributedDataParallel(net)
    # One bucket (an explicit bucket_cap_mb also sizes the first one): torch's PowerSGD hook
    # issues its Q allreduce from the P allreduce's completion callback, which on gloo may run
    # while the main thread starts the next bucket's P allreduce, in another order on each rank
    # (seen here: gloo "Received data size doesn't match expected size" on the 2nd host).
    ddp = nn.parallel.DistributedDataParallel(net, bucket_cap_mb=64)
    if name == "ddp_powersgd":
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=num,
                                            start_powerSGD_iter=start)
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    return ddp


Schedule = torch.optim.lr_scheduler.LambdaLR


def _inner(net: nn.Module, args: SlowLinkArgs) -> tuple[torch.optim.Optimizer, Schedule]:
    """The inner AdamW and its schedule (a constant one without ``schedule_steps``; see
    ``SlowLinkArgs.schedule_steps``)."""
    if not args.schedule_steps:
        inner = torch.optim.AdamW(net.parameters(), lr=args.lr, weight_decay=0.0)
        return inner, Schedule(inner, lambda _: 1.0)
    from recipes._gpt_config import OptimConfig

    o = OptimConfig(lr=args.lr)
    groups = [{"params": [p for p in net.parameters() if p.dim() >= 2], "weight_decay": o.weight_decay},
              {"params": [p for p in net.parameters() if p.dim() < 2], "weight_decay": 0.0}]
    inner = torch.optim.AdamW(groups, lr=o.lr, betas=(o.beta1, o.beta2))
    return inner, Schedule(inner, lambda step: o.lr_factor(step, args.schedule_steps))


def _optimizer(name: str, num: int, net: nn.Module, inner: torch.optim.Optimizer,  # noqa: ANN202
               args: SlowLinkArgs):
    """``inner`` as mode ``name`` steps it (itself, ``LocalSGD`` or ``DistributedOptimizer``)."""
    import hvd_trainer as hvd

    if name in ("local", "ddp", "ddp_powersgd"):
        return inner
    if name.startswith("localsgd"):
        outer_wire = {"localsgd_int8": "int8", "localsgd_overlap_bf16": "bf16"}.get(name)
        overlap = max(1, num // 4) if name.startswith("localsgd_overlap") and num > 1 else 0
        fragments = STREAM_FRAGMENTS if name == "localsgd_stream" else 1
        if fragments > 1:  # one part's step every num / 4 steps, hidden behind num / 8
            overlap = num // (2 * fragments)
        return hvd.LocalSGD(inner, net, sync_every=num, compression=outer_wire, outer_lr=args.outer_lr,
                            outer_momentum=args.outer_momentum, overlap_steps=overlap, fragments=fragments)
    hvd.broadcast_parameters(net.state_dict(), root_rank=0)
    compression = {"sync": None, "bf16": "bf16", "int8": "int8", "powersgd": f"powersgd:{num}",
                   "auto": "auto"}[name]
    return hvd.DistributedOptimizer(inner, named_parameters=net.named_parameters(), compression=compression)


def _bytes_sent(opt: torch.optim.Optimizer) -> int:
    import hvd_trainer as hvd

    if isinstance(opt, hvd.LocalSGD):
        return opt.outer.bytes_sent
    return getattr(opt, "wire_bytes_sent", -1)


def run_mode(args: SlowLinkArgs) -> dict[str, float]:
    """Train ``args.warmup + args.steps`` steps in ``args.mode`` (``hvd_trainer.init()`` done, except
    for ``local``); print this rank's ``LAB`` record (and ``RESULT`` on rank 0); return the record.
    """
    import hvd_trainer as hvd

    name, num = parse_mode(args.mode)
    if args.eval_every and name.startswith("localsgd") and args.eval_every % num:
        raise ValueError(f"--eval-every {args.eval_every} must be a multiple of H={num} in mode {args.mode} "
                         "(the ranks' weights are equal only after an outer step).")
    distributed = name != "local"
    rank, world = (hvd.rank(), hvd.size()) if distributed else (0, 1)
    torch.manual_seed(args.seed)
    net, data = _build(args.model)
    inner, schedule = _inner(net, args)
    opt = _optimizer(name, num, net, inner, args)
    if name.startswith("ddp"):
        net = _ddp(name, num, net, args.ddp_powersgd_start)  # DDP broadcasts rank 0's parameters itself
    steps, timed, sent, curve = _train(args, net, opt, schedule, data, rank, distributed)
    if name == "local":
        sent = 0
    if name.startswith("ddp"):
        sent = -1  # not ours to count
    val_loss = _validate(net, data, args)
    tokens_per_step = args.batch * data.tokens_per_sample * world
    tokens = steps * tokens_per_step
    record = {"workload": f"slow_link_{args.model}", "mode": args.mode, "round": args.round,
              "seed": args.seed, "schedule_steps": args.schedule_steps, "steps": steps,
              "batch": args.batch * data.tokens_per_sample, "world": world,
              **timed,
              "val_loss": val_loss, "comm_bytes_sent": sent, "tokens_per_s": tokens / timed["seconds"],
              "tokens_per_step": tokens_per_step, "curve": curve, "outer_lr": args.outer_lr,
              "compression": getattr(getattr(opt, "compression", None), "name", None),
              "outer_momentum": args.outer_momentum}
    emit(**record)
    if rank == 0:
        print(f"RESULT mode={args.mode} model={args.model} world_size={world} steps={steps} "
              f"tokens_per_s={record['tokens_per_s']:.0f} val_loss={val_loss:.4f} comm_bytes_sent={sent} "
              f"comm_bytes_per_token={max(sent, 0) * world / tokens:.3f}", flush=True)
    return record


def _train(args: SlowLinkArgs, net: nn.Module, opt: torch.optim.Optimizer,
           schedule: Schedule, data: _Digits | _Bytes, rank: int,
           distributed: bool) -> tuple[int, dict[str, float], int, list[dict[str, float]]]:
    """The training loop: ``(timed steps, window, comm bytes sent, curve)``; validation (every
    ``eval_every`` steps) is outside the window's seconds."""
    import hvd_trainer as hvd

    gen = torch.Generator().manual_seed(args.seed * 1000 + rank)
    window = Window()
    curve: list[dict[str, float]] = []
    eval_s = 0.0
    compute_s: list[float] = []  # per timed step: batch, forward and backward
    step_call_s: list[float] = []  # per timed step: opt.step() (launches, waits, outer steps)
    for i in range(args.warmup + args.steps):
        if i == args.warmup:
            if distributed:
                hvd.barrier()
            window.start()
            bytes_before = _bytes_sent(opt)
        t0 = time.perf_counter()
        opt.zero_grad()
        _loss(net, *data.batch(args.batch, gen)).backward()
        t1 = time.perf_counter()
        opt.step()
        schedule.step()
        if i >= args.warmup:
            compute_s.append(t1 - t0)
            step_call_s.append(time.perf_counter() - t1)
        if not args.eval_every or i < args.warmup or (i + 1) % args.eval_every:
            continue
        t0 = time.perf_counter()
        val = _validate(net, data, args)
        if distributed:  # the ranks' mean (equal weights: the same value) -> one stop decision
            val = float(hvd.allreduce(torch.tensor([val], dtype=torch.float64), op=hvd.Average,
                                      name="bench.val_loss"))
        curve.append({"step": i + 1, "seconds": t0 - window.started - eval_s,
                      "val_loss": val, "comm_bytes_sent": _bytes_sent(opt) - bytes_before})
        eval_s += time.perf_counter() - t0
        if args.stop_below and i + 1 >= args.min_steps and val <= args.stop_below:
            break  # the same value on every rank: all stop here
    if isinstance(opt, hvd.LocalSGD):
        opt.settle()  # equal weights for validation; its bytes count
    if distributed:
        hvd.barrier()
    timed = window.stop()
    timed["seconds"] -= eval_s
    timed.update(_step_breakdown(compute_s, step_call_s))
    return i + 1 - args.warmup, timed, _bytes_sent(opt) - bytes_before, curve


def _step_breakdown(compute_s: list[float], step_call_s: list[float]) -> dict[str, float]:
    """Where a timed step's seconds went: ``compute_s`` (batch, forward, backward) and
    ``opt_step_s`` (``opt.step()``), each the mean over the window's steps, and
    ``opt_step_max_s`` / ``opt_step_p90_s``, the longest and 90th-percentile ``opt.step()``
    (a blocking outer step or a wait on one still on the wire shows there). Seconds; the
    window's final ``settle()`` and barrier are in ``seconds`` only."""
    if not compute_s:
        return {}
    ordered = sorted(step_call_s)
    return {"compute_s": statistics.fmean(compute_s), "opt_step_s": statistics.fmean(step_call_s),
            "opt_step_max_s": ordered[-1], "opt_step_p90_s": ordered[int(0.9 * (len(ordered) - 1))]}


@torch.no_grad()
def _validate(net: nn.Module, data: _Digits | _Bytes, args: SlowLinkArgs) -> float:
    net.eval()
    losses = [float(_loss(net, x, y)) for x, y in data.val_batches(args.batch, args.val_batches)]
    net.train()
    return sum(losses) / len(losses) if losses else math.nan


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", default="sync", help=f"one of {MODES}; powersgd:R, localsgd:H")
    p.add_argument("--model", default="gpt", choices=("gpt", "cnn"))
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--round", type=int, default=0)
    p.add_argument("--seed", type=int, default=0, help="model initialisation and batches")
    p.add_argument("--schedule-steps", type=int, default=0,
                   help="the GPT recipe's AdamW and lr schedule, decayed over N steps (0: constant lr)")
    p.add_argument("--ddp-powersgd-start", type=int, default=2,
                   help="ddp_powersgd: plain allreduce steps before PowerSGD (start_powerSGD_iter)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--eval-every", type=int, default=0,
                   help="also validate every N steps (not timed); the LAB record's curve")
    p.add_argument("--stop-below", type=float, default=0.0,
                   help="with --eval-every: stop once val_loss <= this, at or after --min-steps")
    p.add_argument("--min-steps", type=int, default=0)
    p.add_argument("--outer-lr", type=float, default=0.7, help="local-steps modes: outer SGD lr")
    p.add_argument("--outer-momentum", type=float, default=0.9,
                   help="local-steps modes: outer Nesterov momentum")
    a = p.parse_args(argv)
    parse_mode(a.mode)  # fail before init
    torch.set_num_threads(a.threads)
    # Subnormal floats make CPU arithmetic many times slower, and whether a run meets them depends
    # on its trajectory (seen: a local-steps GPT run's inner steps went from 65 to 163 ms over
    # 288 steps, every value the same with flushing): flushed, step times compare communication.
    torch.set_flush_denormal(True)
    if parse_mode(a.mode)[0] != "local":
        import hvd_trainer as hvd

        hvd.init()
    run_mode(SlowLinkArgs(mode=a.mode, model=a.model, steps=a.steps, warmup=a.warmup, batch=a.batch, lr=a.lr,
                          round=a.round, seed=a.seed, eval_every=a.eval_every,
                          ddp_powersgd_start=a.ddp_powersgd_start, schedule_steps=a.schedule_steps,
                          stop_below=a.stop_below, min_steps=a.min_steps, outer_lr=a.outer_lr,
                          outer_momentum=a.outer_momentum))


if __name__ == "__main__":
    main()

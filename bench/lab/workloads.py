"""The lab's workloads: how each is launched on the hosts, and the lines it prints.

Every workload runs its distributed modes under ``hvdrun`` (same-line mode: the same command on
every host, ``-H h1:P,h2:P,... --no-ssh``) and its ``local`` mode (no communication: the compute
time) as the same script on every host at once without a launcher, so the CPU is as busy as in
the distributed run. Rounds are interleaved: round 1 of every mode, then round 2, ...
"""

from __future__ import annotations

import math
import statistics
import sys
from dataclasses import dataclass, replace

from bench.lab.net import LinkMeasure
from bench.lab.records import Summary, median_spread, parse, summarise, wire_efficiency
from bench.lab.slow_link import report
from bench.lab.ttq import DDP_STEP, TARGET, equal_tokens_step
from bench.lab.ttq import report as ttq_report
from hvd_trainer.comm.ops.compression import DEFAULT_POWERSGD_RANK, DEFAULT_POWERSGD_WARMUP_STEPS
from hvd_trainer.comm.reduce.auto import DEFAULT_MEASURE_STEPS, DEFAULT_SKIP_STEPS
from hvd_trainer.comm.reduce.localsgd import DEFAULT_SYNC_WARMUP_STEPS
from tests.e2e.hvdrun_helpers import clean_env
from tests.multihost.helpers import HVDRUN, explain, run_on_hosts
from tests.multihost.netns import Cluster

__all__ = ["LabArgs", "WORKLOADS", "run_workload"]

DECIDES_AT = DEFAULT_SKIP_STEPS + DEFAULT_MEASURE_STEPS
"""The optimizer step after which ``"auto"`` runs its choice (across hosts)."""
WORKLOADS = ("allreduce", "loop", "lightning", "gpt", "keras", "slow_link", "auto", "local_steps", "ttq")
DEFAULT_SIZES = (64 * 2**10, 256 * 2**10, 2**20, 4 * 2**20, 16 * 2**20, 64 * 2**20)


@dataclass
class LabArgs:
    """What one lab run does (the command line's options)."""

    hosts: int = 2
    procs: int = 1
    rounds: int = 2
    steps: int = 10
    warmup: int = 3
    sizes: tuple[int, ...] = DEFAULT_SIZES
    seconds_per_size: float = 8.0
    loop_modes: tuple[str, ...] = ("hvd", "ddp", "hvd_bf16", "ddp_bf16")
    keras_backends: tuple[str, ...] = ("torch", "tensorflow")
    lightning_modes: tuple[str, ...] = ("horovod", "ddp")
    slow_link_modes: tuple[str, ...] = ("powersgd:16", "ddp_powersgd:16", "localsgd:32", "localsgd_int8:32")
    """Modes of ``slow_link`` besides the synchronous ``sync`` and ``ddp`` it always runs."""
    slow_link_steps: int = 384
    """Steps of the synchronous runs (the other modes: up to 3x, stopping at the target)."""
    slow_link_eval_every: int = 32
    slow_link_target: float = 0.0
    """A known target val_loss (0: run ``sync`` and ``ddp`` to find it)."""
    slow_link_max_factor: float = 2.0
    """The other modes stop at the target or after this many times ``slow_link_steps``."""
    local_steps_modes: tuple[str, ...] = ("localsgd:32", "localsgd_overlap:32")
    """Modes of ``local_steps``; the first is the one the others are compared with."""
    local_steps_models: tuple[str, ...] = ("cnn", "gpt")
    """Models of ``local_steps`` (``bench.slow_link_training --model``)."""
    slow_link_outer: tuple[float, float] = (1.0, 0.0)
    """Outer lr and momentum of the local-steps modes. Plain averaging by default: from scratch
    at this scale DiLoCo's 0.7 / 0.9 lagged (README, "Slow links")."""
    ttq_seeds: tuple[int, ...] = (1, 2, 3)
    """``ttq``: seeds, each a target run and every mode in turn (seed by seed: interleaved)."""
    ttq_steps: int = 1500
    """``ttq``: DDP's steps to the target (the demo's 1,500)."""
    ttq_modes: tuple[str, ...] = ("localsgd:32", "powersgd", f"ddp_powersgd:{DEFAULT_POWERSGD_RANK}")
    """``ttq``: the modes timed to the target, with the library's defaults (outer lr 0.7 and
    Nesterov momentum 0.9, 128 warm-up steps; PowerSGD's default rank and warm-up; DDP's hook at
    the same rank, starting after the same warm-up)."""
    ttq_targets: tuple[float, ...] = ()
    """``ttq``: known targets, one per seed (DDP's val_loss after ``ttq_steps``, e.g. from an
    unshaped run; empty: the targets are trained here, on the lab's link)."""
    ttq_eval_every: int = 32
    ttq_max_factor: float = 2.0
    """``ttq``: a mode stops after this many times ``ttq_steps`` if it never reaches the target."""
    timeout_seconds: float = 1200.0


class _Launcher:
    """Starts a worker on every host, with or without hvdrun; a fresh rendezvous port each time."""

    def __init__(self, c: Cluster, args: LabArgs) -> None:
        self.c, self.args, self.port = c, args, 29400

    def run(self, module: list[str], distributed: bool, **env: str) -> list[dict]:
        worker = [sys.executable, "-m", *module]
        if distributed:
            self.port += 1
            spec = ",".join(f"{h.name}:{self.args.procs}" for h in self.c.hosts)
            argv = [*HVDRUN, "-np", str(self.args.procs * len(self.c.hosts)), "-H", spec, "--port",
                    str(self.port), "--no-ssh", *worker]
        else:
            argv = worker
        runs = run_on_hosts(self.c.hosts, argv, timeout=self.args.timeout_seconds, env=clean_env(**env))
        if any(r.returncode != 0 for r in runs):
            raise RuntimeError(f"lab worker failed: {' '.join(argv)}\n{explain(runs)}")
        return parse([r.output for r in runs])


def _ratio(name: str, value: float) -> None:
    print(f"RATIO {name}={value:.3f}", flush=True)


def _report_steps(tag: str, workload: str, summaries: dict[tuple, Summary], compute: Summary,
                  link: LinkMeasure) -> dict[str, Summary]:
    out: dict[str, Summary] = {}
    for (wl, mode), s in sorted(summaries.items()):
        if wl != workload or mode.endswith("local"):
            continue
        eff = wire_efficiency(s.step_s, compute.step_s, s.bytes_per_step, link.wire_bytes_per_s)
        print(f"STEP {tag} {workload} {mode} step_s={s.step_s:.3f} samples_per_s={s.samples_per_s:.1f} "
              f"wire_bytes_per_step={s.bytes_per_step:.0f} compute_s={compute.step_s:.3f} "
              f"wire_limit_s={s.bytes_per_step / link.wire_bytes_per_s:.3f} efficiency={eff:.3f} "
              f"rounds={s.rounds}", flush=True)
        _ratio(f"{tag}_{workload}_{mode}_wire_efficiency", eff)
        out[mode] = s
    return out


def _versus(tag: str, workload: str, got: dict[str, Summary], pairs: list[tuple[str, str]],
            recs: list[dict]) -> None:
    """Per pair ``(a, b)`` of modes that both ran: ``RATIO <tag>_<workload>_<a>_vs_<b>`` (samples/s
    of the medians), then the same ratio per round (``b``'s step time over ``a``'s in the same
    round) with its median and spread, and each mode's per-step overhead beyond compute (its step
    time less the ``local`` run's of the same round, seconds; median and spread over the rounds of
    the first pair it is in; once per mode)."""
    step_s = _step_s_per_round(recs)
    rounds = sorted({r for (w, _, r) in step_s if w == workload})
    shown: set[str] = set()  # a mode's OVERHEAD line once, with its first pair
    for a, b in pairs:
        if a not in got or b not in got:
            continue
        _ratio(f"{tag}_{workload}_{a}_vs_{b}", got[a].samples_per_s / got[b].samples_per_s)
        both = [r for r in rounds if (workload, a, r) in step_s and (workload, b, r) in step_s]
        per_round = [step_s[(workload, b, r)] / step_s[(workload, a, r)] for r in both]
        if per_round:
            print(f"RATIO {tag}_{workload}_{a}_vs_{b}_per_round {median_spread(per_round)}", flush=True)
        for mode in (a, b):
            extra = [step_s[(workload, mode, r)] - step_s[(workload, "local", r)] for r in both
                     if (workload, "local", r) in step_s]
            if extra and mode not in shown:
                shown.add(mode)
                print(f"OVERHEAD {tag} {workload} {mode} beyond_compute_s {median_spread(extra, digits=4)}",
                      flush=True)


def _in_turn(modes: tuple[str, ...] | list[str], round_: int) -> list[str]:
    """``modes`` in the order they run in round ``round_``: as given in even rounds, reversed in
    odd ones (ABBA), so no mode always runs first in its processes or right after another."""
    return list(modes) if round_ % 2 == 0 else list(modes)[::-1]


def _allreduce(tag: str, launch: _Launcher, link: LinkMeasure) -> list[dict]:
    args, plan = launch.args, []
    for size in args.sizes:
        est = size / link.goodput_bytes_per_s  # a 2-host ring sends about the message each way
        if est > args.seconds_per_size:
            print(f"SKIP {tag} allreduce size={size}: ~{est:.0f} s per call at this rate "
                  f"(> --seconds-per-size {args.seconds_per_size:g})", flush=True)
            continue
        plan.append(f"{size}:{max(2, min(50, math.ceil(args.seconds_per_size / 2 / est)))}")
    if not plan:
        return []
    recs = launch.run(["bench.lab.workers.allreduce", "--sizes", ",".join(plan), "--rounds",
                       str(args.rounds)], distributed=True)
    summaries = summarise(recs, key=("size_bytes", "mode"))
    n = args.hosts * args.procs
    for size in sorted({k[0] for k in summaries}):
        bus = {mode: size / summaries[(size, mode)].step_s * 2 * (n - 1) / n for mode in ("hvd", "torch")}
        print(f"BW {tag} allreduce size_bytes={size} hvd_busbw_bytes_per_s={bus['hvd']:.0f} "
              f"torch_busbw_bytes_per_s={bus['torch']:.0f} iperf3_goodput_bytes_per_s="
              f"{link.goodput_bytes_per_s:.0f}", flush=True)
        _ratio(f"{tag}_allreduce_{size}_busbw_vs_iperf3", bus["hvd"] / link.goodput_bytes_per_s)
        _ratio(f"{tag}_allreduce_{size}_hvd_vs_torch", bus["hvd"] / bus["torch"])
        if (size, "hier") in summaries:  # time ratio: < 1 is faster than the flat allreduce
            hier, flat = summaries[(size, "hier")].step_s, summaries[(size, "hvd")].step_s
            print(f"BW {tag} allreduce size_bytes={size} hier_s={hier:.4f} flat_s={flat:.4f}", flush=True)
            _ratio(f"{tag}_allreduce_{size}_hier_time_vs_flat", hier / flat)
    return recs


def _common(args: LabArgs) -> list[str]:
    return ["--steps", str(args.steps), "--warmup", str(args.warmup)]


def _loop(tag: str, launch: _Launcher, link: LinkMeasure) -> list[dict]:
    args = launch.args
    recs: list[dict] = []
    for r in range(args.rounds):  # the local round between distributed ones: interleaved
        new = launch.run(["bench.lab.workers.loop", "--modes", ",".join(_in_turn(args.loop_modes, r)),
                          "--rounds", "1", *_common(args)], distributed=True)
        new += launch.run(["bench.lab.workers.loop", "--modes", "local", *_common(args)], distributed=False)
        recs += [{**rec, "round": r} for rec in new]
    s = summarise(recs)
    got = _report_steps(tag, "loop", s, s[("loop", "local")], link)
    _versus(tag, "loop", got, [("hvd", "ddp"), ("hvd_bf16", "ddp_bf16"), ("hvd_bf16", "hvd"),
                                ("ddp_bf16", "ddp"), ("hvd_zero1", "ddp"), ("hvd_zero2", "ddp"),
                                ("hvd_zero1", "hvd"), ("hvd_zero2", "hvd"),
                                ("hvd_zero1_overlap", "ddp"), ("hvd_zero2_overlap", "ddp")], recs)
    return recs


def _lightning(tag: str, launch: _Launcher, link: LinkMeasure, model: str) -> list[dict]:
    args, recs = launch.args, []
    worker = ["bench.lab.workers.lightning_fit", "--model", model, *_common(args)]
    for r in range(args.rounds):
        for mode in (*_in_turn(args.lightning_modes, r), "local"):
            recs += [{**rec, "round": r} for rec in
                     launch.run([*worker, "--mode", mode, "--round", str(r)], distributed=mode != "local")]
    workload = f"lightning_{model}"
    s = summarise(recs)
    got = _report_steps(tag, workload, s, s[(workload, "local")], link)
    _versus(tag, workload, got, [("horovod", "ddp"), ("horovod_bf16", "ddp_bf16"),
                                 ("horovod_bf16", "horovod"), ("ddp_bf16", "ddp")], recs)
    return recs


def _keras(tag: str, launch: _Launcher, link: LinkMeasure) -> list[dict]:
    args, recs = launch.args, []
    worker = ["bench.lab.workers.keras_fit", *_common(args)]
    for r in range(args.rounds):
        for backend in args.keras_backends:
            for mode in ("hvd", "local"):
                recs += launch.run([*worker, "--mode", mode, "--round", str(r)], distributed=mode == "hvd",
                                   KERAS_BACKEND=backend)
    s = summarise(recs)
    for backend in args.keras_backends:
        sub = {k: v for k, v in s.items() if k[1].startswith(backend)}
        _report_steps(tag, "keras", sub, s[("keras", f"{backend}_local")], link)
    return recs


def _slow_link(tag: str, launch: _Launcher) -> list[dict]:
    """Time to the synchronous fp32 run's final val_loss, per mode (one run each, GPT model).

    ``sync`` and ``ddp`` train ``slow_link_steps`` steps; the target is the larger of their final
    val_loss (or ``slow_link_target`` when given: then they are not run). Every other mode trains
    until it validates at or below the target (at least ``slow_link_steps``, at most
    ``slow_link_max_factor`` times as many). :func:`bench.lab.slow_link.report` prints the lines.
    """
    args = launch.args
    steps, every = args.slow_link_steps, args.slow_link_eval_every
    worker = ["bench.slow_link_training", "--model", "gpt", "--warmup", "0", "--eval-every", str(every),
              "--outer-lr", str(args.slow_link_outer[0]), "--outer-momentum", str(args.slow_link_outer[1])]
    runs: dict[str, list[dict]] = {}
    if args.slow_link_target:
        target = args.slow_link_target
    else:
        for mode in ("sync", "ddp"):
            runs[mode] = launch.run([*worker, "--mode", mode, "--steps", str(steps)], distributed=True)
        target = max(runs[m][0]["curve"][-1]["val_loss"] for m in ("sync", "ddp"))
    print(f"SLOW {tag} target_val_loss={target:.4f} (the larger final val_loss of sync and ddp after "
          f"{steps} steps)", flush=True)
    most = int(args.slow_link_max_factor * steps) // every * every
    for mode in args.slow_link_modes:
        runs[mode] = launch.run([*worker, "--mode", mode, "--steps", str(most), "--stop-below",
                                 f"{target:.6f}", "--min-steps", str(steps)], distributed=True)
    report(tag, runs, steps, target)
    return [{**r, "target_val_loss": target, "sync_steps": steps} for recs in runs.values() for r in recs]


def _step_s_per_round(recs: list[dict]) -> dict[tuple[str, str, int], float]:
    """The slowest rank's seconds per step, per ``(workload, mode, round)`` of ``recs``."""
    step_s: dict[tuple[str, str, int], float] = {}
    for rec in recs:
        key = (rec["workload"], rec["mode"], rec["round"])
        step_s[key] = max(step_s.get(key, 0.0), rec["seconds"] / rec["steps"])
    return step_s


def _print_breakdown(tag: str, model: str, mode: str, recs: list[dict]) -> None:
    """One ``PHASES`` line: the medians over ``recs`` (every rank and round of one mode) of
    ``bench.slow_link_training``'s per-step breakdown (forward and backward, ``opt.step()``: mean,
    90th percentile, longest), seconds; nothing for records without it."""
    keys = ("compute_s", "opt_step_s", "opt_step_p90_s", "opt_step_max_s")
    recs = [r for r in recs if all(k in r for k in keys)]
    if recs:
        medians = " ".join(f"{k}={statistics.median(r[k] for r in recs):.4f}" for k in keys)
        print(f"PHASES {tag} local_steps {model} {mode} {medians} records={len(recs)}", flush=True)


def _auto(tag: str, launch: _Launcher) -> list[dict]:
    """``compression="auto"`` against plain ``sync`` in interleaved rounds: tokens/s, the median
    of each mode and of the per-round ratios with their spread. Across hosts auto runs plain for
    its first ``DECIDES_AT`` steps while it times them, and a chosen PowerSGD runs
    ``DEFAULT_POWERSGD_WARMUP_STEPS`` fp32 steps after that (its synchronous warm-up); both are
    added to ``--warmup`` (for both modes), so the timed steps run what it chose, past its start."""
    args, recs = launch.args, []
    common = _common(replace(args, warmup=args.warmup + DECIDES_AT + DEFAULT_POWERSGD_WARMUP_STEPS))
    worker = ["bench.slow_link_training", "--model", "gpt", *common]
    for r in range(args.rounds):
        for mode in ("sync", "auto"):
            recs += launch.run([*worker, "--mode", mode, "--round", str(r)], distributed=True)
    rate = _step_s_per_round(recs)  # the records carry their round (the worker's --round)
    per_round = [rate[("slow_link_gpt", "sync", r)] / rate[("slow_link_gpt", "auto", r)]
                 for r in range(args.rounds)]
    print(f"RATIO {tag}_auto_vs_sync_per_round {median_spread(per_round)}", flush=True)
    s = summarise(recs)
    chosen = sorted({r.get("compression") for r in recs if r["mode"] == "auto"} - {None})
    print(f"AUTO {tag} compression=auto chose {', '.join(chosen) or '?'}", flush=True)
    for mode in ("sync", "auto"):
        print(f"STEP {tag} auto {mode} step_s={s[('slow_link_gpt', mode)].step_s:.3f} tokens_per_s="
              f"{s[('slow_link_gpt', mode)].samples_per_s:.0f} rounds={s[('slow_link_gpt', mode)].rounds}",
              flush=True)
    _ratio(f"{tag}_auto_vs_sync_tokens_per_s",
           s[("slow_link_gpt", "auto")].samples_per_s / s[("slow_link_gpt", "sync")].samples_per_s)
    return recs


def _local_steps(tag: str, launch: _Launcher) -> list[dict]:
    """Compute utilisation of the local-steps modes (``--local-steps-modes``; by default
    blocking vs hidden outer step, ``H=32``, ``overlap_steps=8``), on the CNN and the GPT model:
    the step time of ``local`` (the same script with no communication, run on every host at
    once) over the mode's, per interleaved round; median and spread over the rounds, and each
    mode's utilisation over the first mode's. The window (``--steps`` after ``--warmup``) ends with a
    blocking outer step. The library's synchronous warm-up (``DEFAULT_SYNC_WARMUP_STEPS``, the
    modes' default) is added to ``--warmup``, outside the window: the figure is the steady
    state of local steps, not their start."""
    args, recs = launch.args, []
    common = _common(replace(args, warmup=args.warmup + DEFAULT_SYNC_WARMUP_STEPS))
    for model in args.local_steps_models:
        worker = ["bench.slow_link_training", "--model", model, *common]
        for r in range(args.rounds):
            for mode in (*args.local_steps_modes, "local"):
                new = launch.run([*worker, "--mode", mode, "--round", str(r)], distributed=mode != "local")
                recs += [{**rec, "round": r} for rec in new]
    step_s = _step_s_per_round(recs)
    for model in args.local_steps_models:
        w = f"slow_link_{model}"
        util = {m: [step_s[(w, "local", r)] / step_s[(w, m, r)] for r in range(args.rounds)]
                for m in args.local_steps_modes}
        for mode, values in util.items():
            steps = [step_s[(w, mode, r)] for r in range(args.rounds)]
            print(f"STEP {tag} local_steps {model} {mode} step_s={statistics.median(steps):.4f} local_step_s="
                  f"{statistics.median(step_s[(w, 'local', r)] for r in range(args.rounds)):.4f} "
                  f"rounds={args.rounds}", flush=True)
            _print_breakdown(tag, model, mode, [r for r in recs if (r["workload"], r["mode"]) == (w, mode)])
            print(f"RATIO {tag}_local_steps_{model}_{mode.replace(':', '')}_utilisation="
                  f"{statistics.median(values):.3f} spread={min(values):.3f}-{max(values):.3f} "
                  f"rounds={args.rounds}", flush=True)
        _print_breakdown(tag, model, "local", [r for r in recs if (r["workload"], r["mode"]) == (w, "local")])
        first = args.local_steps_modes[0]
        for mode in args.local_steps_modes[1:]:
            gain = [a / b for a, b in zip(util[mode], util[first], strict=True)]
            print(f"RATIO {tag}_local_steps_{model}_{mode.replace(':', '')}_vs_{first.replace(':', '')}="
                  f"{statistics.median(gain):.3f} spread={min(gain):.3f}-{max(gain):.3f} "
                  f"rounds={args.rounds}", flush=True)
    return recs


def _ttq(tag: str, launch: _Launcher) -> list[dict]:
    """Time to DDP's quality (:mod:`bench.lab.ttq`), seed by seed, every run with the GPT recipe's
    AdamW and lr schedule over ``ttq_steps`` (``--schedule-steps``): the target (DDP fp32 trained
    ``ttq_steps`` steps, unless given), DDP's step time on this link (``--steps`` after
    ``--warmup``), then each of ``ttq_modes`` trained on the link to the first validation at or
    after ``ttq_steps`` and on to the target (at most ``ttq_max_factor`` times the steps)."""
    args, recs = launch.args, []
    steps, every = args.ttq_steps, args.ttq_eval_every
    least = equal_tokens_step(steps, every)
    most = max(least, int(args.ttq_max_factor * steps) // every * every)
    base = ["bench.slow_link_training", "--model", "gpt", "--schedule-steps", str(steps),
            "--ddp-powersgd-start", str(DEFAULT_POWERSGD_WARMUP_STEPS)]
    known = dict(zip(args.ttq_seeds, args.ttq_targets, strict=False))
    extra = {"ttq_steps": steps, "ttq_eval_every": every}

    def run(seed: int, ttq: str, argv: list[str]) -> list[dict]:
        new = launch.run([*base, "--seed", str(seed), *argv], distributed=True)
        recs.extend({**r, "ttq": ttq, **extra} for r in new)
        return new

    for seed in args.ttq_seeds:
        if seed in known:
            target = known[seed]
            recs.append({"seed": seed, "ttq": TARGET, "val_loss": target, "given": True, **extra})
        else:
            trained = run(seed, TARGET, ["--mode", "ddp", "--steps", str(steps), "--warmup", "0"])
            target = trained[0]["val_loss"]
        run(seed, DDP_STEP, ["--mode", "ddp", *_common(args)])
        for mode in args.ttq_modes:
            run(seed, mode, ["--mode", mode, "--warmup", "0", "--eval-every", str(every), "--steps",
                             str(most), "--stop-below", f"{target:.6f}", "--min-steps", str(least)])
        ttq_report(tag, recs, steps, every)  # the seeds so far (a long run shows as it goes)
    return recs


def run_workload(name: str, tag: str, c: Cluster, args: LabArgs, link: LinkMeasure) -> list[dict]:
    """Run workload ``name`` on ``c`` (already shaped); print its lines; return its records.

    Raises:
        ValueError: an unknown workload.
        RuntimeError: a worker failed (every host's output tail is in the message).
    """
    launch = _Launcher(c, args)
    if name == "allreduce":
        return _allreduce(tag, launch, link)
    if name == "loop":
        return _loop(tag, launch, link)
    if name in ("lightning", "gpt"):
        return _lightning(tag, launch, link, "cnn" if name == "lightning" else "gpt")
    if name == "keras":
        return _keras(tag, launch, link)
    if name == "slow_link":
        return _slow_link(tag, launch)
    if name == "ttq":
        return _ttq(tag, launch)
    if name == "auto":
        return _auto(tag, launch)
    if name == "local_steps":
        return _local_steps(tag, launch)
    raise ValueError(f"unknown workload {name!r}; choose from {WORKLOADS}")

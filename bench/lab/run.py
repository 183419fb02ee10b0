"""``python -m bench.lab``: workloads on namespace hosts whose links are shaped, against iperf3.

Examples (root; the lab makes and removes its own network namespaces)::

    python -m bench.lab --rates 20mbit --workloads loop                 # the CNN loop at 20 Mbit/s
    python -m bench.lab --rates 20mbit,100mbit,1gbit,unshaped --rounds 3
    python -m bench.lab --hosts 2 --procs 2 --rates 100mbit --workloads allreduce
    python -m bench.lab --rates 20mbit,100mbit --workloads slow_link --records curves.jsonl
    python -m bench.lab --rates unshaped --workloads auto --rounds 3
    python -m bench.lab --rates 20mbit --workloads ttq --steps 32 --ttq-targets 1.61,1.62,1.60

For every rate: shape each host's port (``tc`` TBF, or HTB with ``--qdisc htb``), measure one
iperf3 TCP stream (``LINK`` line and ``RATIO lab_<rate>_iperf3_goodput_vs_rate``), then run each
workload side by side with its peer in interleaved rounds, printing ``STEP``/``BW`` lines and
``RATIO`` lines (samples/s of ours vs the peer, wire efficiency, allreduce bus bandwidth vs
iperf3). The load average is printed before and after: take figures on an idle machine.
Where the lab cannot run (not root, no namespaces, tc or iperf3) it prints ``SKIP lab: <why>``
and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

from bench.lab.net import UNSHAPED, measure_link, parse_rate, shape, skip_reason
from bench.lab.workloads import DEFAULT_SIZES, WORKLOADS, LabArgs, run_workload

__all__ = ["main"]


def _load() -> str:
    return "load_average=" + ",".join(f"{v:.2f}" for v in os.getloadavg())


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.lab",
                                description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--rates", default="20mbit", help=f"comma-separated tc rates or {UNSHAPED!r}")
    p.add_argument("--workloads", default="allreduce,loop,lightning", help=f"comma-separated: {WORKLOADS}")
    p.add_argument("--hosts", type=int, default=2)
    p.add_argument("--procs", type=int, default=1, help="processes per host")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=10, help="timed steps per mode and round")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    p.add_argument("--qdisc", choices=("tbf", "htb"), default="tbf")
    p.add_argument("--sizes", default=",".join(str(s) for s in DEFAULT_SIZES),
                   help="allreduce message sizes, bytes")
    p.add_argument("--seconds-per-size", type=float, default=8.0,
                   help="about how long each allreduce size is timed per mode; larger sizes are skipped")
    p.add_argument("--loop-modes", default="hvd,ddp,hvd_bf16,ddp_bf16")
    p.add_argument("--keras-backends", default="torch,tensorflow")
    p.add_argument("--lightning-modes", default="horovod,ddp",
                   help="of horovod, ddp, horovod_bf16, ddp_bf16 (also for the GPT recipe)")
    p.add_argument("--local-steps-modes", default="localsgd:32,localsgd_overlap:32",
                   help="local_steps workload: modes, the first the one the others are compared with")
    p.add_argument("--local-steps-models", default="cnn,gpt",
                   help="local_steps workload: models of bench.slow_link_training (cnn, gpt)")
    p.add_argument("--slow-link-modes", default="powersgd:16,ddp_powersgd:16,localsgd:32,localsgd_int8:32",
                   help="slow_link workload: modes of bench.slow_link_training besides sync and ddp")
    p.add_argument("--slow-link-steps", type=int, default=384,
                   help="slow_link workload: steps of the synchronous runs (others: to the target)")
    p.add_argument("--slow-link-eval-every", type=int, default=32)
    p.add_argument("--slow-link-target", type=float, default=0.0,
                   help="slow_link workload: a known target val_loss (skips the sync and ddp runs)")
    p.add_argument("--slow-link-max-factor", type=float, default=2.0,
                   help="slow_link workload: the other modes stop at the target or after this x steps")
    p.add_argument("--slow-link-outer", default="1.0,0.0",
                   help="slow_link workload: outer lr,momentum of the local-steps modes")
    p.add_argument("--ttq-seeds", default="1,2,3", help="ttq workload: seeds, each run in turn")
    p.add_argument("--ttq-steps", type=int, default=1500, help="ttq workload: DDP's steps to the target")
    p.add_argument("--ttq-modes", default=",".join(LabArgs.ttq_modes),
                   help="ttq workload: the modes timed to the target (bench.slow_link_training's)")
    p.add_argument("--ttq-targets", default="",
                   help="ttq workload: known targets, one per seed (DDP's val_loss after --ttq-steps "
                        "with --schedule-steps the same, e.g. from a loopback run); empty: trained on "
                        "the lab's link")
    p.add_argument("--iperf-seconds", type=float, default=3.0)
    p.add_argument("--records", metavar="FILE", help="also write every worker record here (JSON lines)")
    return p


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    rates = a.rates.split(",")
    workloads = a.workloads.split(",")
    for rate in rates:
        parse_rate(rate)  # a bad rate fails before anything is made
    unknown = sorted(set(workloads) - set(WORKLOADS))
    if unknown:
        raise SystemExit(f"unknown workloads {unknown}; choose from {list(WORKLOADS)}")
    if a.hosts < 2:
        raise SystemExit(f"--hosts {a.hosts}: the lab needs at least 2 hosts")
    reason = skip_reason()
    if reason is not None:
        print(f"SKIP lab: {reason}", flush=True)
        return 0
    args = LabArgs(hosts=a.hosts, procs=a.procs, rounds=a.rounds, steps=a.steps, warmup=a.warmup,
                   sizes=tuple(int(s) for s in a.sizes.split(",")), seconds_per_size=a.seconds_per_size,
                   loop_modes=tuple(a.loop_modes.split(",")),
                   keras_backends=tuple(a.keras_backends.split(",")),
                   lightning_modes=tuple(a.lightning_modes.split(",")),
                   local_steps_modes=tuple(a.local_steps_modes.split(",")),
                   local_steps_models=tuple(a.local_steps_models.split(",")),
                   slow_link_modes=tuple(a.slow_link_modes.split(",")), slow_link_steps=a.slow_link_steps,
                   slow_link_eval_every=a.slow_link_eval_every, slow_link_max_factor=a.slow_link_max_factor,
                   slow_link_target=a.slow_link_target,
                   slow_link_outer=tuple(float(v) for v in a.slow_link_outer.split(",")),
                   ttq_seeds=tuple(int(v) for v in a.ttq_seeds.split(",")), ttq_steps=a.ttq_steps,
                   ttq_modes=tuple(a.ttq_modes.split(",")),
                   ttq_targets=tuple(float(v) for v in a.ttq_targets.split(",") if v))
    if args.ttq_targets and len(args.ttq_targets) != len(args.ttq_seeds):
        raise SystemExit(f"--ttq-targets gives {len(args.ttq_targets)} values for "
                         f"{len(args.ttq_seeds)} seeds: one per seed")
    from tests.multihost.netns import cluster

    # SIGTERM (a timeout, pkill) unwinds like Ctrl-C, so cluster() removes its namespaces.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    start = time.monotonic()
    print(f"LAB hosts={a.hosts} procs_per_host={a.procs} rates={a.rates} workloads={a.workloads} "
          f"rounds={a.rounds} steps={a.steps} qdisc={a.qdisc} cores={os.cpu_count()} {_load()}", flush=True)
    records: list[dict] = []
    with cluster(a.hosts) as c:
        for rate in rates:
            shape(c, rate, a.qdisc)
            link = measure_link(c, seconds=a.iperf_seconds)
            tag = f"lab_{rate}"
            bits = parse_rate(rate)
            print(f"LINK {tag} goodput_bytes_per_s={link.goodput_bytes_per_s:.0f} "
                  f"({link.goodput_bytes_per_s * 8 / 1e6:.2f} Mbit/s) wire_bytes_per_s="
                  f"{link.wire_bytes_per_s:.0f} ({link.wire_bytes_per_s * 8 / 1e6:.2f} Mbit/s)", flush=True)
            if bits is not None:
                ratio = link.goodput_bytes_per_s * 8 / bits
                print(f"RATIO {tag}_iperf3_goodput_vs_rate={ratio:.3f}", flush=True)
            for name in workloads:
                records += [{**rec, "rate": rate} for rec in run_workload(name, tag, c, args, link)]
    if a.records:
        Path(a.records).write_text("".join(json.dumps(rec, sort_keys=True) + "\n" for rec in records))
    print(f"LAB done in {time.monotonic() - start:.0f} s {_load()}", flush=True)
    return 0

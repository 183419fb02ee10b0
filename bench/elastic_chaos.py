"""Chaos bench of elastic recovery: SIGKILL a worker, again and again, and count what it costs.

Run (one host, 2 processes; the issue's defaults: a 300 s chaos run, a kill every 60 s, the killed
worker's replacement back 5 s later)::

    PYTHONPATH=. python bench/elastic_chaos.py
    PYTHONPATH=. python bench/elastic_chaos.py --duration 60 --kill-every 20 --baseline 20   # shorter
    PYTHONPATH=. python bench/elastic_chaos.py --phases recovery --modes inprocess,restart
    PYTHONPATH=. python bench/elastic_chaos.py --phases chaos --modes inprocess,restart --rounds 3

The workload (bench/chaos_worker.py): a 0.8 M-parameter GPT (recipes/_gpt_model.py, 4 layers,
width 128, 64 tokens, batch 8 per rank) trained with the torch API, ``TorchState`` +
``hvd.DistributedOptimizer`` (AdamW) + ``ElasticSampler`` under ``@elastic.run``, a step of about
80-150 ms per rank on one CPU core each. Three ways to survive a lost worker, side by side:

- ``inprocess``: ``hvdrun -np 2 --min-np 1 --max-np 2 --recovery in-process``, commit every step:
  the survivors keep their processes and go on alone from their in-memory commit; hvdrun restarts
  only the killed worker, which joins at their next commit;
- ``restart``: ``hvdrun -np 2 --min-np 2 --max-np 2 --recovery restart`` (one host, so torchrun,
  which counts whole hosts, needs ``--min-np`` = ``--max-np``),
  commit every step: torchrun's agent stops every worker and starts them all again; they resume
  from the commit file;
- ``ckptN``: plain torchrun restarts (``hvdrun -np 2 --max-restarts R``, not elastic) with a
  commit (checkpoint file) every N steps (``--ckpt-every``): as ``restart``, but the steps after
  the last checkpoint are redone.

The bench kills workers from outside, by the pids they print (``CHAOS_START``), always a
non-zero slot (seeded random), so slot 0's per-step lines give the survivors' timeline. Before
a kill it leaves ``delay.<slot>`` for the worker script: the killed slot's next process sleeps
that long first (a replacement that comes back late; in the restart paths everyone waits for it,
since the agent restarts all its workers together). Phases, each over the modes in turn:

1. ``recovery``: one kill ~``--settle`` s after the first step, no restart delay. Per mode
   ``RATIO recovery_s_<mode>``: from the SIGKILL to slot 0's first completed step past the last
   step the killed process completed (redone steps count; target <= 3 s for ``inprocess``); the
   ``KILL`` line also gives ``resumed_s`` (the first step in the new world, whatever its number)
   and ``redone_steps``;
2. ``chaos``: ``--rounds`` rounds (default 1), each running every mode in turn (interleaved, so
   a drift of the machine's speed reaches every mode alike): a failure-free run of ``--baseline``
   s, then a run of ``--duration`` s with a kill every ``--kill-every`` s (none in the last
   ``--restart-delay`` + 15 s, so every replacement is back before the stop).
   ``RATIO chaos_efficiency_<mode>`` = committed steps per second of the chaos run / the
   failure-free run's, ``RATIO chaos_sample_efficiency_<mode>`` the same in committed samples
   per second (a step of a lone survivor trains its own samples only; target >= 0.90 for
   ``inprocess``), each the median over the rounds with its spread, and
   ``RATIO failure_free_inprocess_vs_restart`` (steps/s without faults, per round: what
   committing through the in-process machinery costs).

Joiner (both phases): from the replacement process's start (after its delay) to its first
completed step, ``RATIO joiner_s_<mode>`` (median; target for ``inprocess``: 5 s plus the state
transfer at link rate; the state is printed in MB, on one host the transfer is local). Nothing
lost: after each chaos run every complete epoch saw every sample exactly once
(``RATIO chaos_samples_exactly_once_<mode>``, every round), and the ``inprocess`` final weights equal a
one-process replay of the committed steps, bit for bit on CPU
(``RATIO chaos_final_weights_equal_replay``; ``--replay-all`` checks the other modes too). The
replay (the first round's only) runs on one core (the workers' kernels, the same sums): it takes
about half as long as the chaos run on an idle machine. The load average is printed before and
after, and after each run: on a busy machine the step times and so the rates move, the recovery
times less. The workers' full output is kept under ``--keep DIR``.

On the lab (``--lab RATE``, root: two namespace hosts whose ports are shaped to RATE with ``tc``,
the link measured with ``iperf3`` first; see bench/chaos_lab.py): one worker per host,
``-H h1:1,h2:1 --min-np 1 --max-np 2`` with ``--recovery in-process`` or ``restart``; the faults hit
h2 in turn (``--faults worker,cut,host``: its worker SIGKILLed, its link cut for
``--cut-seconds``, every process of it SIGKILLed), and the bench starts h2's hvdrun line again
``--restart-delay`` s after it ended, once its link is up, as a node manager would::

    PYTHONPATH=. python bench/elastic_chaos.py --lab 1gbit --phases chaos --modes inprocess,restart --rounds 3

What the phases take with the defaults: about 1.5 min (recovery), then per mode the baseline,
the chaos run and two start-ups, ~7 min: ~25 min in all, plus the replay.
"""

from __future__ import annotations

import argparse
import functools
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "bench" / "chaos_worker.py"
HVDRUN = [sys.executable, "-c", "import sys; from hvd_trainer.launch.cli import main; sys.exit(main())"]
_LINE = re.compile(r"(CHAOS_[A-Z]+) (.*)$")
if str(ROOT) not in sys.path:  # run as a script from anywhere: bench.chaos_worker must import
    sys.path.insert(0, str(ROOT))


@dataclass
class Kill:
    slot: int
    pid: int
    t: float
    kind: str = "worker"


@dataclass
class Run:
    """One hvdrun job of the chaos worker and what it printed."""

    mode: str
    directory: Path
    starts: list[dict] = field(default_factory=list)
    firsts: list[dict] = field(default_factory=list)
    steps: list[dict] = field(default_factory=list)
    kills: list[Kill] = field(default_factory=list)
    returncode: int | None = None
    hung: bool = False
    lines: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def take(self, line: str, host: str = "") -> None:
        self.lines.append(line)
        match = _LINE.search(line)
        if match is None:
            return
        values = dict(kv.split("=", 1) for kv in match.group(2).split())
        record: dict = {k: float(v) if "." in v else int(v) for k, v in values.items()}
        record["host"] = host
        with self.lock:
            if match.group(1) == "CHAOS_START":
                self.starts.append(record)
            if match.group(1) == "CHAOS_FIRST":
                self.firsts.append(record)
            if match.group(1) in ("CHAOS_FIRST", "CHAOS_STEP"):
                self.steps.append(record)

    def timeline(self, slot: int = 0) -> list[dict]:
        """The steps ``slot`` completed, in time order (every process of that slot)."""
        with self.lock:
            return sorted((s for s in self.steps if s["slot"] == slot), key=lambda s: s["t"])

    def pid_of(self, slot: int) -> int | None:
        with self.lock:
            mine = [s for s in self.starts if s["slot"] == slot]
        return mine[-1]["pid"] if mine else None

    def latest_start(self, host: str) -> dict | None:
        """The newest ``CHAOS_START`` record printed by ``host``'s hvdrun (the lab's runs)."""
        with self.lock:
            mine = [s for s in self.starts if s["host"] == host]
        return mine[-1] if mine else None

    def first_step_time(self) -> float | None:
        steps = self.timeline()
        return steps[0]["t"] if steps else None

    def tail(self, n: int = 30) -> str:
        return "\n".join(self.lines[-n:])


@dataclass
class Mode:
    name: str
    flags: list[str]
    commit_every: int


def modes(args: argparse.Namespace) -> dict[str, Mode]:
    np_ = str(args.np)
    restarts = ["--max-restarts", str(args.max_restarts)]
    ckpt = f"ckpt{args.ckpt_every}"
    return {
        "inprocess": Mode("inprocess", ["--min-np", "1", "--max-np", np_, "--recovery", "in-process",
                                        *restarts], 1),
        # torchrun grows and shrinks by whole hosts: one host, so --min-np = --max-np
        "restart": Mode("restart", ["--min-np", np_, "--max-np", np_, "--recovery", "restart", *restarts], 1),
        ckpt: Mode(ckpt, restarts, args.ckpt_every),
    }


def env_for_workers() -> dict[str, str]:
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
            "TORCHELASTIC_RUN_ID", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *paths])
    env["OMP_NUM_THREADS"] = "1"
    return env


def _sleep_until(t: float) -> None:
    while (left := t - time.time()) > 0:
        time.sleep(min(left, 0.05))


def wait_first_step(run: Run, proc: subprocess.Popen, timeout: float) -> float:
    deadline = time.time() + timeout
    while (t0 := run.first_step_time()) is None:
        if proc.poll() is not None or time.time() > deadline:
            raise RuntimeError(f"{run.mode}: no first step (rc={proc.poll()})\n{run.tail()}")
        time.sleep(0.05)
    return t0


def _kill(run: Run, slot: int, delay: float) -> None:
    pid = run.pid_of(slot)
    if pid is None:
        print(f"  {run.mode}: no pid known for slot {slot}; no kill", flush=True)
        return
    (run.directory / f"delay.{slot}").write_text(str(delay))
    t = time.time()
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        (run.directory / f"delay.{slot}").unlink(missing_ok=True)
        print(f"  {run.mode}: slot {slot} pid {pid} already gone; no kill", flush=True)
        return
    run.kills.append(Kill(slot, pid, t))


def launch(mode: Mode, args: argparse.Namespace, directory: Path, kill_at: list[float], duration: float,
           delay: float, rng: random.Random) -> Run:
    """Run the worker under ``mode``'s hvdrun for ``duration`` s after its first step, killing a
    random non-zero slot at each offset of ``kill_at`` (seconds after the first step); with
    ``--lab``, :func:`bench.chaos_lab.launch_lab` on the lab's two hosts instead."""
    if args.lab is not None:
        return args.lab_launch(mode, args, directory, kill_at, duration, delay)
    directory.mkdir(parents=True)
    run = Run(mode.name, directory)
    cmd = [*HVDRUN, "-np", str(args.np), *mode.flags, "python", str(WORKER), str(directory),
           str(mode.commit_every)]
    log = (directory / "output.log").open("w")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env_for_workers(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)

    def pump() -> None:
        for line in proc.stdout:  # type: ignore[union-attr]
            log.write(line)
            run.take(line.rstrip("\n"))

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        t0 = wait_first_step(run, proc, args.start_timeout)
        for offset in kill_at:
            _sleep_until(t0 + offset)
            _kill(run, rng.randrange(1, args.np), delay)
        _sleep_until(t0 + duration)
        (directory / "stop").touch()
        run.returncode = proc.wait(timeout=args.stop_timeout)
    except subprocess.TimeoutExpired:
        run.hung = True
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # the session this bench started for hvdrun
            proc.wait()
        reader.join(timeout=5)
        log.close()
    if run.hung or run.returncode != 0:
        print(f"  {mode.name}: hvdrun {'did not stop' if run.hung else f'exited {run.returncode}'}; "
              f"output in {directory / 'output.log'}\n{run.tail()}", flush=True)
    return run


# -- measures -------------------------------------------------------------------------------------


def rate(run: Run) -> float:
    """Steps per second from slot 0's first completed step to its last (redone steps do not count:
    the step number is the committed training position)."""
    steps = run.timeline()
    first, last = steps[0], steps[-1]
    return (last["step"] - first["step"]) / (last["t"] - first["t"])


def per_kill(run: Run) -> list[dict]:
    """For each kill, from the SIGKILL: ``resumed``, slot 0's first step in the new world (a step
    past the last one the killed process completed, or a step of a new slot 0 process);
    ``recovery``, its first step past the killed process's last (the progress before the kill is
    back: redone steps count); ``redone``, the steps done again; ``joiner``, from the killed
    slot's next process start to its first completed step."""
    out = []
    slot0 = run.timeline()
    for kill in run.kills:
        done = max((s["step"] for s in run.steps if s["pid"] == kill.pid), default=0)
        before = [s for s in slot0 if s["t"] < kill.t]
        old_pid = before[-1]["pid"] if before else None
        after = [s for s in slot0 if s["t"] > kill.t]
        resumed = next((s for s in after if s["step"] > done or s["pid"] != old_pid), None)
        past = next((s for s in after if s["step"] > done), None)
        start = next((s for s in run.starts if s["slot"] == kill.slot and s["t"] > kill.t), None)
        first = start and next((f for f in run.firsts if f["pid"] == start["pid"]), None)
        out.append({
            "slot": kill.slot, "kind": kill.kind,
            "resumed": resumed["t"] - kill.t if resumed else None,
            "recovery": past["t"] - kill.t if past else None,
            "redone": max(0, done - resumed["step"] + 1) if resumed else None,
            "joiner": first["t"] - start["t"] if first else None,
        })
    return out


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def report_kills(run: Run) -> list[dict]:
    rows = per_kill(run)
    for i, r in enumerate(rows):
        print(f"  KILL {run.mode} #{i + 1} {r['kind']} slot={r['slot']} recovery_s={_fmt(r['recovery'])} "
              f"resumed_s={_fmt(r['resumed'])} redone_steps={r['redone']} joiner_s={_fmt(r['joiner'])}",
              flush=True)
    return rows


def _median(values: list[float | None]) -> float | None:
    got = [v for v in values if v is not None]
    return statistics.median(got) if got else None


def load_final(run: Run) -> dict | None:
    import torch

    path = run.directory / "final.pt"
    return torch.load(path) if path.is_file() else None


def samples_exactly_once(final: dict, n_samples: int) -> bool:
    """Every complete epoch of the history saw each sample once; the last, partial one at most once."""
    epochs: dict[int, list[int]] = {}
    for epoch, per_rank in final["history"]:
        epochs.setdefault(epoch, []).extend(i for r in per_rank for i in r)
    last = max(epochs)
    for epoch, seen in epochs.items():
        if epoch < last and sorted(seen) != list(range(n_samples)):
            return False
        if epoch == last and len(seen) != len(set(seen)):
            return False
    return len(final["history"]) == final["step"]


def weights_equal_replay(final: dict) -> bool:
    import torch

    from bench.chaos_worker import replay

    torch.set_num_threads(1)  # the workers' thread count: the same kernels, the same sums
    start = time.perf_counter()
    want = replay(final["history"])
    print(f"  replay of {len(final['history'])} steps took {time.perf_counter() - start:.1f} s", flush=True)
    return all(torch.equal(final["model"][name], tensor) for name, tensor in want.items())


# -- phases ---------------------------------------------------------------------------------------


def phase_recovery(args: argparse.Namespace, table: dict[str, Mode], tmp: Path, rng: random.Random) -> None:
    rows: dict[str, list[dict]] = {}
    for name in args.modes:
        run = launch(table[name], args, tmp / f"recovery-{name}", [args.settle],
                     args.settle + args.after_kill, 0.0, rng)
        rows[name] = report_kills(run)
    for name, got in rows.items():
        rec, resumed = _median([r["recovery"] for r in got]), _median([r["resumed"] for r in got])
        print(f"RATIO recovery_s_{name}={_fmt(rec)}", flush=True)
        print(f"  {name}: resumed_s={_fmt(resumed)} joiner_s={_fmt(_median([r['joiner'] for r in got]))}")


def kill_offsets(args: argparse.Namespace) -> list[float]:
    """Every ``--kill-every`` s, none in the last ``--restart-delay`` + 15 s of the run."""
    out, t = [], args.kill_every
    while t <= args.duration - args.restart_delay - 15:
        out.append(t)
        t += args.kill_every
    return out


def sample_rate(run: Run, final: dict | None) -> float | None:
    """Committed samples per second over the same window as :func:`rate` (a step alone counts
    only the survivors' samples), from the final history; ``None`` without one."""
    if final is None:
        return None
    steps = run.timeline()
    samples = sum(len(r) for _, per_rank in final["history"][steps[0]["step"]:] for r in per_rank)
    return samples / (steps[-1]["t"] - steps[0]["t"])


def _chaos_round(name: str, base: Run, chaos: Run, args: argparse.Namespace, replay: bool) -> dict:
    """One round's figures of mode ``name`` (its ``KILL`` lines printed)."""
    rows = report_kills(chaos)
    final, base_final = load_final(chaos), load_final(base)
    samples, base_samples = sample_rate(chaos, final), sample_rate(base, base_final)
    got = {"steps": rate(chaos) / rate(base), "base_rate": rate(base),
           "samples": None if samples is None or base_samples is None else samples / base_samples,
           "joiner": [r["joiner"] for r in rows],
           "once": final is not None and samples_exactly_once(final, args.n_samples) and not chaos.hung,
           "replay": None}
    if replay:
        got["replay"] = final is not None and weights_equal_replay(final)
    return got


def _spread(name: str, values: list[float | None], target: str = "") -> str:
    got = [v for v in values if v is not None]
    if not got:
        return f"RATIO {name}=-"
    return (f"RATIO {name}={statistics.median(got):.3f} spread={min(got):.3f}-{max(got):.3f} "
            f"rounds={len(got)}{target}")


def _report_chaos(name: str, rounds: list[dict], lab: bool = False) -> None:
    """The figures of ``rounds`` of one mode; the in-process target is 0.90 on one host, 0.85 on
    the lab."""
    target = {"inprocess": " target>=0.85" if lab else " target>=0.90"}.get(name, "")
    print(_spread(f"chaos_efficiency_{name}", [r["steps"] for r in rounds]), flush=True)
    print(_spread(f"chaos_sample_efficiency_{name}", [r["samples"] for r in rounds], target), flush=True)
    print(f"RATIO joiner_s_{name}={_fmt(_median([j for r in rounds for j in r['joiner']]))}", flush=True)
    print(f"RATIO chaos_samples_exactly_once_{name}={int(all(r['once'] for r in rounds))}", flush=True)
    replays = [r["replay"] for r in rounds if r["replay"] is not None]
    if replays:
        suffix = "" if name == "inprocess" else f"_{name}"
        print(f"RATIO chaos_final_weights_equal_replay{suffix}={int(all(replays))} "
              f"(rounds replayed: {len(replays)})", flush=True)


def phase_chaos(args: argparse.Namespace, table: dict[str, Mode], tmp: Path, rng: random.Random) -> None:
    """``--rounds`` rounds; in each, every mode's failure-free run and chaos run, the modes in
    turn (interleaved, so a drift of the machine's speed reaches every mode alike)."""
    results: dict[str, list[dict]] = {name: [] for name in args.modes}
    kill_at = kill_offsets(args)
    for k in range(args.rounds):
        for name in args.modes:
            base = launch(table[name], args, tmp / f"baseline-{name}-{k}", [], args.baseline, 0.0, rng)
            chaos = launch(table[name], args, tmp / f"chaos-{name}-{k}", kill_at, args.duration,
                           args.restart_delay, rng)
            print(f"  round {k + 1} {name}: failure-free {rate(base):.2f} steps/s, chaos {rate(chaos):.2f} "
                  f"steps/s ({len(chaos.kills)} kills at {kill_at} s, restart delay "
                  f"{args.restart_delay:g} s), {chaos.timeline()[-1]['step']} steps, load "
                  f"{os.getloadavg()[0]:.2f}", flush=True)
            # the one-process replay takes about as long as the run: the first round's only
            replay = k == 0 and (name == "inprocess" or args.replay_all)
            results[name].append(_chaos_round(name, base, chaos, args, replay))
    for name, rounds in results.items():
        _report_chaos(name, rounds, lab=args.lab is not None)
    if "inprocess" in results and "restart" in results:
        ratios = [a["base_rate"] / b["base_rate"] for a, b in zip(results["inprocess"], results["restart"],
                                                                  strict=True)]
        print(_spread("failure_free_inprocess_vs_restart", ratios), flush=True)


def _state_mb() -> float:
    from bench.chaos_worker import build

    model, _, _ = build()
    params = sum(p.numel() for p in model.parameters())
    return params * 4 * 3 / 2**20  # weights and AdamW's two moments, float32


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--phases", default="recovery,chaos", help="recovery,chaos (default: both)")
    parser.add_argument("--modes", default="inprocess,restart,ckpt", help="inprocess,restart,ckpt")
    parser.add_argument("--np", type=int, default=2, help="processes (one host)")
    parser.add_argument("--duration", type=float, default=300.0, help="chaos run, seconds (D)")
    parser.add_argument("--kill-every", type=float, default=60.0, help="seconds between kills (K)")
    parser.add_argument("--restart-delay", type=float, default=5.0,
                        help="the killed slot's next process sleeps this long first (chaos phase)")
    parser.add_argument("--baseline", type=float, default=None, help="failure-free run, seconds (default K)")
    parser.add_argument("--ckpt-every", type=int, default=50, help="steps between checkpoints of ckptN")
    parser.add_argument("--settle", type=float, default=8.0,
                        help="recovery phase: kill this long after the first step")
    parser.add_argument("--after-kill", type=float, default=12.0, help="recovery phase: run on this long")
    parser.add_argument("--seed", type=int, default=0, help="which slot each kill hits")
    parser.add_argument("--rounds", type=int, default=1,
                        help="chaos phase: rounds, each running every mode in turn (medians and spread)")
    parser.add_argument("--replay-all", action="store_true",
                        help="check the weights of every mode's chaos run (default: inprocess only)")
    parser.add_argument("--keep", help="keep the workers' output and files in this directory")
    parser.add_argument("--lab", metavar="RATE", default=None,
                        help="run on two namespace hosts whose ports are shaped to RATE (e.g. 1gbit, "
                             "100mbit, unshaped; root, tc, iperf3): one worker per host, the faults on "
                             "h2 in turn: worker killed, link cut, host killed (bench/chaos_lab.py)")
    parser.add_argument("--faults", default="worker,cut,host",
                        help="--lab: the faults on h2, in turn (worker, cut, host)")
    parser.add_argument("--cut-seconds", type=float, default=40.0,
                        help="--lab: how long a cut lasts (longer than the default peer timeout, "
                             "HOROVOD_GLOO_TIMEOUT_SECONDS: a partition, not a blip)")
    parser.add_argument("--start-timeout", type=float, default=120.0)
    parser.add_argument("--stop-timeout", type=float, default=120.0)
    args = parser.parse_args()
    args.phases = [p for p in args.phases.split(",") if p]
    args.modes = [f"ckpt{args.ckpt_every}" if m == "ckpt" else m for m in args.modes.split(",") if m]
    args.baseline = args.kill_every if args.baseline is None else args.baseline
    args.max_restarts = int(args.duration // args.kill_every) + 3
    from bench.chaos_worker import N_SAMPLES

    args.n_samples = N_SAMPLES
    if args.np < 2:
        parser.error("--np must be at least 2 (slot 0 is never killed)")
    args.faults = [f for f in args.faults.split(",") if f]
    if not args.faults or any(f not in ("worker", "cut", "host") for f in args.faults):
        parser.error(f"--faults {','.join(args.faults)}: choose from worker, cut, host")
    if args.lab is not None and (args.np != 2 or any(m.startswith("ckpt") for m in args.modes)):
        parser.error("--lab runs -np 2 (one worker per host) with the modes inprocess and restart")
    return args


def main() -> None:
    args = parse_args()
    if args.lab is None:
        run_bench(args, modes(args))
        return
    from bench.chaos_lab import lab_modes, launch_lab
    from bench.lab.net import measure_link, shape, skip_reason
    from tests.multihost.netns import cluster

    if (why := skip_reason()) is not None:
        raise SystemExit(f"--lab cannot run here: {why}")
    with cluster(2) as c:
        shape(c, args.lab)
        link = measure_link(c)
        print(f"LAB rate={args.lab} iperf3_goodput_mbit={link.goodput_bytes_per_s * 8 / 1e6:.1f} "
              f"wire_mbit={link.wire_bytes_per_s * 8 / 1e6:.1f} hosts=2 cut_s={args.cut_seconds:g}",
              flush=True)
        args.lab_launch = functools.partial(launch_lab, c=c)
        run_bench(args, lab_modes(args.max_restarts))


def run_bench(args: argparse.Namespace, table: dict[str, Mode]) -> None:
    unknown = [m for m in args.modes if m not in table]
    if unknown:
        raise SystemExit(f"unknown mode(s) {unknown}; choose from inprocess, restart, ckpt")
    print(f"LOAD before={os.getloadavg()[0]:.2f} cores={os.cpu_count()} np={args.np} "
          f"state={_state_mb():.1f} MB modes={','.join(args.modes)}", flush=True)
    rng = random.Random(args.seed)
    keep = Path(args.keep) if args.keep else None
    with tempfile.TemporaryDirectory(prefix="elastic_chaos_") as scratch:
        tmp = keep or Path(scratch)
        if "recovery" in args.phases:
            phase_recovery(args, table, tmp, rng)
        if "chaos" in args.phases:
            phase_chaos(args, table, tmp, rng)
    print(f"LOAD after={os.getloadavg()[0]:.2f}", flush=True)


if __name__ == "__main__":
    main()

"""Per-step cost of DistributedOptimizer's allreduce in Keras ``fit``, per backend.

For each backend, two processes (hvdrun) fit the same MLP, alternating ``--repeats`` times in
the same processes (so machine noise hits all variants alike):

* ``plain``: the plain optimizer (no allreduce), the compute of a step;
* ``dist``: ``hvd_trainer.keras.DistributedOptimizer`` (gradients averaged over the 2 ranks
  every step; TF: the graph/numpy bridge and one fused gloo allreduce; torch: hook-driven
  buckets);
* ``inline``: the plain fit plus one blocking ``hvd_trainer.allreduce_`` of a flat float32
  buffer as large as all gradients in every step (a callback at the batch's end): the cost of a
  distributed step with no bridge, hooks or copies (see ``bench/step_overhead.py`` for why it
  exceeds ``plain + bare``);
* ``bare``: that allreduce alone, back to back.

Step times are medians over epoch 2 (tracing excluded); each ratio is computed per repetition
and its median printed, per backend (``tf``, ``torch``):

    RATIO keras_<b>_comm_overhead=t_dist / t_plain
    RATIO keras_<b>_overhead_vs_bare_allreduce=(t_dist - t_plain) / t_bare     (goal <= 1.10)
    RATIO keras_<b>_overhead_vs_inline_allreduce=(t_dist - t_plain) / (t_inline - t_plain)
    RATIO keras_<b>_inline_overhead_vs_bare_allreduce=(t_inline - t_plain) / t_bare

Usage: python bench/keras_overhead.py [--steps 40] [--hidden 1024] [--batch 128] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _worker(args: argparse.Namespace) -> None:
    import keras
    import numpy as np
    import torch

    import hvd_trainer
    import hvd_trainer.keras as hvd_keras

    world = hvd_trainer.init()
    if keras.backend.backend() == "torch":
        torch.set_num_threads(1)

    class StepTimer(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.times: list[float] = []

        def on_train_batch_begin(self, batch, logs=None):
            self._t = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            self.times.append(time.perf_counter() - self._t)

    rs = np.random.RandomState(world.rank)
    x = rs.randn(args.steps * args.batch, 784).astype("float32")
    y = rs.randint(0, 10, size=len(x))

    params = sum(int(np.prod(s)) for s in [(784, args.hidden), (args.hidden,),
                                            (args.hidden, args.hidden), (args.hidden,),
                                            (args.hidden, 10), (10,)])
    flat = torch.randn(params)

    class InlineAllreduce(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            hvd_trainer.allreduce_(flat, op=hvd_trainer.Sum)

    def median_step(mode: str) -> float:
        keras.utils.set_random_seed(0)
        model = keras.Sequential([
            keras.Input((784,)),
            keras.layers.Dense(args.hidden, activation="relu"),
            keras.layers.Dense(args.hidden, activation="relu"),
            keras.layers.Dense(10),
        ])
        opt = keras.optimizers.SGD(0.01, momentum=0.9)
        model.compile(optimizer=hvd_keras.DistributedOptimizer(opt) if mode == "dist" else opt,
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        timer = StepTimer()
        callbacks = [InlineAllreduce(), timer] if mode == "inline" else [timer]
        model.fit(x, y, batch_size=args.batch, epochs=2, verbose=0, shuffle=False, callbacks=callbacks)
        return float(np.median(timer.times[args.steps:]))  # epoch 2 only: tracing excluded

    out: dict[str, list[float]] = {}
    for _ in range(args.repeats):
        for mode in ("plain", "dist", "inline"):
            out.setdefault(mode, []).append(median_step(mode))
        out.setdefault("bare", []).append(_raw_allreduce_s(flat))
    if world.rank == 0:
        print("BENCH " + json.dumps({"params": params, **out}), flush=True)


def _raw_allreduce_s(buf) -> float:
    """Median time of one bare comm allreduce of the float32 tensor ``buf`` (the transport floor)."""
    import hvd_trainer

    times = []
    for i in range(23):
        start = time.perf_counter()
        hvd_trainer.allreduce_(buf, op=hvd_trainer.Sum)
        if i >= 3:
            times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def _run_backend(backend: str, argv: list[str]) -> dict:
    bin_dir = Path(sys.executable).parent
    env = {**os.environ, "KERAS_BACKEND": backend, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
           "TF_NUM_INTRAOP_THREADS": "1", "TF_NUM_INTEROP_THREADS": "1", "TF_CPP_MIN_LOG_LEVEL": "3"}
    cmd = [str(bin_dir / "hvdrun"), "-np", "2", sys.executable, __file__, "--worker", *argv]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    for line in proc.stdout.splitlines():
        _, mark, payload = line.partition("BENCH ")  # behind hvdrun's "[0]<stdout>:" prefix
        if mark:
            return json.loads(payload)
    raise RuntimeError(f"{' '.join(cmd)} failed:\n{(proc.stdout + proc.stderr)[-3000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--steps", type=int, default=40, help="steps per epoch (2 epochs per fit)")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5, help="alternating fits per variant")
    parser.add_argument("--backends", default="tensorflow,torch", help="comma-separated subset")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args, _ = parser.parse_known_args()
    if args.worker:
        _worker(args)
        return
    argv = [f"--steps={args.steps}", f"--hidden={args.hidden}", f"--batch={args.batch}",
            f"--repeats={args.repeats}"]
    ratios = {}
    for backend in args.backends.split(","):
        key = {"tensorflow": "keras_tf", "torch": "keras_torch"}[backend]
        r = _run_backend(backend, argv)
        med = {k: statistics.median(r[k]) * 1e3 for k in ("plain", "dist", "inline", "bare")}
        print(f"{backend}: params={r['params']} " + " ".join(f"{k}={v:.2f}" for k, v in med.items())
              + " (ms, medians over repetitions)", flush=True)
        added = {m: [t - p for t, p in zip(r[m], r["plain"], strict=True)] for m in ("dist", "inline")}
        rows = {
            "comm_overhead": (r["dist"], r["plain"]),
            "overhead_vs_bare_allreduce": (added["dist"], r["bare"]),
            "overhead_vs_inline_allreduce": (added["dist"], added["inline"]),
            "inline_overhead_vs_bare_allreduce": (added["inline"], r["bare"]),
        }
        for name, (num, den) in rows.items():
            per_rep = [n / d for n, d in zip(num, den, strict=True)]
            ratios[f"{key}_{name}"] = statistics.median(per_rep)
            print(f"  {key}_{name} per repetition: " + " ".join(f"{v:.2f}" for v in per_rep))
    print(f"load average: {os.getloadavg()[0]:.2f}")
    print("RATIO " + " ".join(f"{k}={v:.3f}" for k, v in ratios.items()), flush=True)

if __name__ == "__main__":
    main()

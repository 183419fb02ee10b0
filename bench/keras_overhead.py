"""Per-step cost of DistributedOptimizer's allreduce in Keras ``fit``, per backend.

For each backend, two processes (hvdrun) fit the same MLP twice, alternating: with
``DistributedOptimizer`` (gradients averaged over the 2 ranks every step) and with the plain
optimizer (no allreduce). Both runs use the same processes, data and thread settings, so the
ratio isolates the communication path (TF: numpy bridge + one fused gloo allreduce; torch:
hook-driven buckets). Prints the median per-step times and one line:

    RATIO keras_tf_comm_overhead=<x> keras_tf_overhead_vs_bare_allreduce=<y> ...

``*_overhead_vs_bare_allreduce`` is ``(t_dist - t_plain) / t_allreduce`` (goal <= 1.10): what
distribution adds to a step, in units of one bare allreduce of the same bytes.

Also printed: the time of one bare comm allreduce of the same number of bytes (the transport
floor; on a 2-core CPU machine it dominates the overhead).

Usage: python bench/keras_overhead.py [--steps 40] [--hidden 1024] [--batch 128] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _worker(args: argparse.Namespace) -> None:
    import keras
    import numpy as np

    import hvd_trainer
    import hvd_trainer.keras as hvd_keras

    world = hvd_trainer.init()
    if keras.backend.backend() == "torch":
        import torch

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

    def median_step(distributed: bool) -> float:
        keras.utils.set_random_seed(0)
        model = keras.Sequential([
            keras.Input((784,)),
            keras.layers.Dense(args.hidden, activation="relu"),
            keras.layers.Dense(args.hidden, activation="relu"),
            keras.layers.Dense(10),
        ])
        opt = keras.optimizers.SGD(0.01, momentum=0.9)
        model.compile(optimizer=hvd_keras.DistributedOptimizer(opt) if distributed else opt,
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        timer = StepTimer()
        model.fit(x, y, batch_size=args.batch, epochs=2, verbose=0, shuffle=False, callbacks=[timer])
        return float(np.median(timer.times[args.steps:]))  # epoch 2 only: tracing excluded

    plain, dist = [], []
    for _ in range(args.repeats):
        plain.append(median_step(False))
        dist.append(median_step(True))
    params = sum(int(np.prod(s)) for s in [(784, args.hidden), (args.hidden,),
                                            (args.hidden, args.hidden), (args.hidden,),
                                            (args.hidden, 10), (10,)])
    floor = _raw_allreduce_s(params)
    if world.rank == 0:
        print("BENCH " + json.dumps({"plain_s": min(plain), "dist_s": min(dist), "params": params,
                                     "raw_allreduce_s": floor}), flush=True)


def _raw_allreduce_s(numel: int) -> float:
    """Median time of one bare comm allreduce of ``numel`` float32 (the transport floor)."""
    import torch

    import hvd_trainer

    buf = torch.randn(numel)
    times = []
    for i in range(23):
        start = time.perf_counter()
        hvd_trainer.allreduce_(buf)
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
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="steps per epoch (2 epochs per fit)")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3, help="alternating fits per variant")
    parser.add_argument("--backends", default="tensorflow,torch", help="comma-separated subset")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args, _ = parser.parse_known_args()
    if args.worker:
        _worker(args)
        return
    argv = [f"--steps={args.steps}", f"--hidden={args.hidden}", f"--batch={args.batch}",
            f"--repeats={args.repeats}"]
    ratios = {}
    keys = {"tensorflow": "keras_tf_comm_overhead", "torch": "keras_torch_comm_overhead"}
    for backend in args.backends.split(","):
        key = keys[backend]
        r = _run_backend(backend, argv)
        ratios[key] = r["dist_s"] / r["plain_s"]
        print(f"{backend}: params={r['params']} plain={r['plain_s'] * 1e3:.2f} ms/step "
              f"distributed={r['dist_s'] * 1e3:.2f} ms/step "
              f"(bare allreduce of the gradients: {r['raw_allreduce_s'] * 1e3:.2f} ms)", flush=True)
        # the physical minimum on this machine: one bare fused allreduce of the gradient bytes
        floor_key = key.replace("_comm_overhead", "_overhead_vs_bare_allreduce")
        ratios[floor_key] = (r["dist_s"] - r["plain_s"]) / r["raw_allreduce_s"]
    print("RATIO " + " ".join(f"{k}={v:.3f}" for k, v in ratios.items()), flush=True)


if __name__ == "__main__":
    main()

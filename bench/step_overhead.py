"""What distribution adds to a training step, against the physical minimum: one bare allreduce.

For the torch ``DistributedOptimizer`` and the Lightning strategy ``"horovod"``, one 2-process
job (``hvdrun -np 2``, one thread per process) alternates, ``--repeats`` times in the same
processes so machine noise hits all variants alike:

* ``plain``: the same model, data and optimizer without distribution (plain ``torch.optim.SGD``;
  Lightning ``SingleDeviceStrategy``), i.e. the compute of a step;
* ``dist``: with distribution (gradients averaged over the 2 ranks every step);
* ``inline``: the plain step plus one blocking ``hvd_trainer.allreduce_`` of a separate flat
  float32 buffer as large as all gradients, inside the timed step (after backward): what a
  distributed step costs with no hooks, no copies and no overlap. It differs from ``plain +
  bare`` by what any in-step collective pays: the ranks wait for the slower one every step
  (their step times vary independently without a collective), and the buffer and the model
  evict each other from the caches;
* ``ddp``: the same with torch ``DistributedDataParallel`` (torch loop) or Lightning's
  ``strategy="ddp"``, in the same processes, as a reference;
* ``bare``: one ``hvd_trainer.allreduce_`` of that flat buffer, back to back, alone.

Step times are medians over the timed steps of each run; each ratio is computed per repetition,
and its median over repetitions is printed. Per front end:

* ``RATIO <front end>_overhead_vs_bare_allreduce=(t_dist - t_plain) / t_bare`` (the issue's goal
  is <= 1.10);
* ``RATIO <front end>_overhead_vs_inline_allreduce=(t_dist - t_plain) / (t_inline - t_plain)``:
  our overhead against the zero-overhead in-step floor (1.0 = nothing beyond the collective);
* ``RATIO <front end>_ddp_overhead_vs_bare_allreduce``: the same ratio for the DDP reference.

Keras's two backends print the same ratios in ``bench/keras_overhead.py``.

Run: ``python bench/step_overhead.py [--repeats 5] [--steps 40] [--hidden 1024] [--batch 128]``
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


def _mlp(hidden: int):
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(784, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, hidden),
                               torch.nn.ReLU(), torch.nn.Linear(hidden, 10))


def _torch_step_s(args, x, y, mode: str, flat) -> float:
    import torch

    import hvd_trainer as hvd

    model = _mlp(args.hidden)
    if mode == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    if mode == "dist":
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    times = []
    for i in range(args.steps + 5):
        xb, yb = x[i % 8], y[i % 8]
        t0 = time.perf_counter()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(xb), yb).backward()
        if mode == "inline":
            hvd.allreduce_(flat, op=hvd.Sum)
        opt.step()
        if i >= 5:
            times.append(time.perf_counter() - t0)
    if mode == "dist":
        opt.remove_hooks()
    return statistics.median(times)


def _lightning_step_s(args, x, y, mode: str, flat) -> float:
    import pytorch_lightning as pl
    import torch
    from pytorch_lightning.strategies import SingleDeviceStrategy
    from torch.utils.data import DataLoader, TensorDataset

    import hvd_trainer as hvd

    class Timer(pl.Callback):
        def __init__(self) -> None:
            self.times: list[float] = []

        def on_train_batch_start(self, *a) -> None:
            self._t = time.perf_counter()

        def on_after_backward(self, *a) -> None:
            if mode == "inline":
                hvd.allreduce_(flat, op=hvd.Sum)

        def on_train_batch_end(self, *a) -> None:
            self.times.append(time.perf_counter() - self._t)

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _mlp(args.hidden)

        def training_step(self, batch, _):
            xb, yb = batch
            return torch.nn.functional.cross_entropy(self.net(xb), yb)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)

    data = TensorDataset(torch.cat(list(x)), torch.cat(list(y)))
    loader = DataLoader(data, batch_size=args.batch, shuffle=False)
    timer = Timer()
    distributed = mode in ("dist", "ddp")
    strategy = {"dist": "horovod", "ddp": "ddp"}.get(mode) or SingleDeviceStrategy(torch.device("cpu"))
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=hvd.size() if distributed else 1,
                         max_steps=args.steps + 5, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[timer],
                         use_distributed_sampler=False)
    trainer.fit(Module(), loader)
    return statistics.median(timer.times[5:])


def _bare_allreduce_s(numel: int) -> float:
    import torch

    import hvd_trainer as hvd

    buf = torch.randn(numel)
    times = []
    for i in range(25):
        t0 = time.perf_counter()
        hvd.allreduce_(buf)
        if i >= 5:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _worker(args) -> None:
    import torch

    import hvd_trainer as hvd

    torch.set_num_threads(1)
    hvd.init()
    gen = torch.Generator().manual_seed(hvd.rank())
    x = torch.randn(8, args.batch, 784, generator=gen)
    y = torch.randint(0, 10, (8, args.batch), generator=gen)
    numel = sum(p.numel() for p in _mlp(args.hidden).parameters())
    flat = torch.randn(numel)
    out: dict[str, list[float]] = {}
    for _ in range(args.repeats):
        for front, fn in (("torch", _torch_step_s), ("lightning", _lightning_step_s)):
            for mode in MODES:
                out.setdefault(f"{front}_{mode}", []).append(fn(args, x, y, mode, flat))
            out.setdefault(f"{front}_bare", []).append(_bare_allreduce_s(numel))
    if hvd.rank() == 0:
        print("BENCH " + json.dumps({"numel": numel, **out}), flush=True)


MODES = ("plain", "dist", "inline", "ddp")


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args)
        return
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [str(Path(sys.executable).parent / "hvdrun"), "-np", "2", sys.executable, __file__, "--worker",
           f"--steps={args.steps}", f"--hidden={args.hidden}", f"--batch={args.batch}",
           f"--repeats={args.repeats}"]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=3600)
    result = None
    for line in proc.stdout.splitlines():
        _, mark, payload = line.partition("BENCH ")
        if mark:
            result = json.loads(payload)
    if result is None:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
    print(f"load average before the summary: {os.getloadavg()[0]:.2f}; params={result['numel']} "
          f"({result['numel'] * 4 / 1e6:.1f} MB of float32 gradients); repeats={args.repeats}")
    for front in ("torch", "lightning"):
        r = {k: result[f"{front}_{k}"] for k in (*MODES, "bare")}
        med = {k: statistics.median(v) * 1e3 for k, v in r.items()}
        print(f"{front}: " + " ".join(f"{k}={v:.2f}" for k, v in med.items()) + " (ms, medians)")
        added = {m: [t - p for t, p in zip(r[m], r["plain"], strict=True)] for m in MODES}
        for key, num, den in (("overhead_vs_bare_allreduce", added["dist"], r["bare"]),
                              ("overhead_vs_inline_allreduce", added["dist"], added["inline"]),
                              ("inline_overhead_vs_bare_allreduce", added["inline"], r["bare"]),
                              ("ddp_overhead_vs_bare_allreduce", added["ddp"], r["bare"])):
            per_rep = [n / d for n, d in zip(num, den, strict=True)]
            print(f"RATIO {front}_{key}={statistics.median(per_rep):.3f}   (per repetition: "
                  + " ".join(f"{v:.2f}" for v in per_rep) + ")", flush=True)


if __name__ == "__main__":
    main()

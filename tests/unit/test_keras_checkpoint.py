"""BestModelCheckpoint writes on rank 0 of the world it is given (no global lookup then), else of
the current world at each save (after in-process recovery the new world's rank 0 writes); in a
subprocess on the torch backend so the backend choice does not leak into other tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    import numpy as np
    import keras
    import torch
    import hvd_trainer
    from hvd_trainer.comm import World
    from hvd_trainer.keras.callbacks import BestModelCheckpoint

    out_dir = sys.argv[1]
    assert not hvd_trainer.is_initialized()  # the given world is used, the global never read
    x, y = np.ones((4, 3), "float32"), np.zeros((4, 1), "float32")
    written = {}
    for rank in (0, 1):
        world = World(rank=rank, size=2, local_rank=rank, local_size=2, cross_rank=0, cross_size=1,
                      device=torch.device("cpu"), backend="gloo")
        path = os.path.join(out_dir, f"best{rank}.keras")
        cb = BestModelCheckpoint(filepath=path, monitor="loss", world=world)
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        model.fit(x, y, epochs=2, verbose=0, callbacks=[cb])
        written[rank] = [os.path.exists(path), cb.world.rank]
    try:
        BestModelCheckpoint(filepath=os.path.join(out_dir, "x.keras"))
        written["no_world"] = None
    except ValueError as exc:
        written["no_world"] = str(exc)
    # no world given: rank 1 when made; rank 0 of the world that replaced it (rank 0 was lost)
    from hvd_trainer.comm.world.world import set_current
    set_current(World(rank=1, size=2, local_rank=1, local_size=2, cross_rank=0, cross_size=1,
                      device=torch.device("cpu"), backend="gloo"))
    path = os.path.join(out_dir, "reformed.keras")
    cb = BestModelCheckpoint(filepath=path, monitor="loss")
    model.fit(x, y, epochs=1, verbose=0, callbacks=[cb])
    written["rank_1"] = os.path.exists(path)
    set_current(World(rank=0, size=1, local_rank=0, local_size=1, cross_rank=0, cross_size=1,
                      device=torch.device("cpu"), backend="gloo"))
    model.fit(x, y, epochs=1, verbose=0, callbacks=[cb])
    written["reformed_rank_0"] = os.path.exists(path)
    print("JSON" + json.dumps(written))
    """
)


def test_best_model_checkpoint_writes_on_rank_0_of_the_given_world(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "KERAS_BACKEND": "torch", "TF_CPP_MIN_LOG_LEVEL": "3"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], capture_output=True, text=True,
                          env=env, timeout=240, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("JSON")][-1][4:])
    assert got["0"] == [True, 0]
    assert got["1"] == [False, 1]  # rank 1 of its world: nothing written
    assert "has not been initialized" in got["no_world"] and "HINT" in got["no_world"]
    assert got["rank_1"] is False and got["reformed_rank_0"] is True

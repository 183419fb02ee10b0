"""elastic.KerasState: commit/restore of weights and optimizer variables, and resume through
elastic.run from the persisted file (world of one, Keras on the torch backend, subprocess so
the backend choice does not leak into other tests); loading a commit empties the
DistributedOptimizer's gradient-accumulation window (torch and TensorFlow backends)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent(
    """
    import sys
    import numpy as np
    import keras
    from hvd_trainer import elastic

    def make():
        keras.utils.set_random_seed(0)
        m = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        m.compile(optimizer=keras.optimizers.Adam(0.1), loss="mse")
        return m

    x, y = np.ones((4, 3), "float32"), np.zeros((4, 2), "float32")
    model = make()
    model.fit(x, y, epochs=1, verbose=0)            # builds optimizer state
    state = elastic.KerasState(model, epoch=1)
    state.commit()
    w = [a.copy() for a in model.get_weights()]
    opt = [v.numpy().copy() for v in model.optimizer.variables]
    model.fit(x, y, epochs=1, verbose=0)
    state.epoch = 2
    assert not np.allclose(model.get_weights()[0], w[0])
    state.restore()
    assert state.epoch == 1
    assert all(np.array_equal(a, b) for a, b in zip(model.get_weights(), w))
    assert all(np.array_equal(v.numpy(), b) for v, b in zip(model.optimizer.variables, opt))

    run_dir = sys.argv[1]

    @elastic.run(checkpoint_dir=run_dir)
    def first(st):
        st.commit()

    first(state)
    other = make()                                  # fresh process stand-in: optimizer not built
    st2 = elastic.KerasState(other, epoch=0)

    @elastic.run(checkpoint_dir=run_dir)
    def second(st):
        return st.epoch, st.commit_count

    assert second(st2) == (1, 2), second(st2)
    assert all(np.array_equal(a, b) for a, b in zip(other.get_weights(), w))
    assert all(np.array_equal(v.numpy(), b) for v, b in zip(other.optimizer.variables, opt))
    print("KERAS_STATE_OK")
    """
)


def test_keras_state_commit_restore_and_resume(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "KERAS_BACKEND": "torch"}
    for name in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
        env.pop(name, None)
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "run")], env=env,
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0 and "KERAS_STATE_OK" in proc.stdout, proc.stdout + proc.stderr[-3000:]


WINDOW_SCRIPT = textwrap.dedent(
    """
    import numpy as np
    import keras
    import hvd_trainer
    import hvd_trainer.keras as hk

    hvd_trainer.init()
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer=hk.DistributedOptimizer(keras.optimizers.SGD(0.1), backward_passes_per_step=2),
                  loss="mse")
    x, y = np.ones((4, 3), "float32"), np.zeros((4, 2), "float32")
    state = hk.elastic.KerasState(model)
    state.commit()
    w0 = [a.copy() for a in model.get_weights()]

    def one_batch():
        model.fit(x, y, batch_size=4, epochs=1, verbose=0)
        return all(np.array_equal(a, b) for a, b in zip(model.get_weights(), w0))

    assert one_batch()      # the window's first pass: accumulated, nothing applied
    state.restore()         # the commit holds no window: it starts empty again
    assert one_batch()      # so this is a first pass again (without the reset: an update)
    assert not one_batch()  # the second pass applies the window
    print("WINDOW_OK")
    """
)


BACKENDS = ["torch"] + (["tensorflow"] if importlib.util.find_spec("tensorflow") else [])


@pytest.mark.parametrize("backend", BACKENDS)
def test_loading_a_commit_empties_the_accumulation_window(backend: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "KERAS_BACKEND": backend, "TF_CPP_MIN_LOG_LEVEL": "3"}
    for name in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
        env.pop(name, None)
    proc = subprocess.run([sys.executable, "-c", WINDOW_SCRIPT], env=env, capture_output=True, text=True,
                          timeout=180)
    assert proc.returncode == 0 and "WINDOW_OK" in proc.stdout, proc.stdout + proc.stderr[-3000:]

"""Lightning ``ClusterEnvironment`` that reads ranks through :func:`hvd_trainer.comm.detect_launch_env`.

Lightning's own environments miss launchers that Horovod users rely on (``mpirun`` without mpi4py,
``horovodrun``), and each reads environment variables in its own way. This environment asks the comm
layer, the one place that reads launcher variables, so Lightning and ``hvd_trainer.comm`` can never
disagree about who is rank 0.

It also understands Lightning's own single-node self-launch (``python train.py`` with
``Trainer(strategy="horovod", devices=N)``): Lightning's script launcher exports ``LOCAL_RANK`` and
``WORLD_SIZE`` (no ``RANK``) to the processes it starts; on one node the global rank equals the local
rank, so :meth:`HorovodEnvironment.environ` hands ``detect_launch_env`` (and the strategy's
``comm.init``) the torchrun view of them (:func:`~hvd_trainer.comm.base.launch_env.lightning_script_view`).
``os.environ`` is not modified.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from lightning_fabric.plugins import ClusterEnvironment
from typing_extensions import override

from hvd_trainer.comm import LaunchEnv, detect_launch_env, free_port, lightning_script_view

__all__ = ["HorovodEnvironment", "SelfLaunchError", "UnevenHostsError", "launch_devices"]


class SelfLaunchError(RuntimeError):
    """``python train.py`` with ``num_nodes > 1`` and no launcher: processes cannot be started here."""


class HorovodEnvironment(ClusterEnvironment):
    """Ranks and world size as the launcher (hvdrun, torchrun, mpirun, srun) reported them.

    Rank queries read :func:`~hvd_trainer.comm.detect_launch_env` every time, so the answer
    follows the environment after Lightning's self-launch exported its variables.
    """

    def __init__(self) -> None:
        super().__init__()
        self._main_port: int | None = None

    def launch_env(self) -> LaunchEnv:
        """What launched this process (a world of one when nothing did)."""
        return detect_launch_env(self.environ())

    @staticmethod
    def environ() -> Mapping[str, str]:
        """The launcher variables to read: ``os.environ``, or inside a process of Lightning's
        single-node self-launch its torchrun view (``RANK`` = ``LOCAL_RANK``), unwritten."""
        return lightning_script_view(os.environ) or os.environ

    @property
    @override
    def creates_processes_externally(self) -> bool:
        """True when a launcher (or Lightning's own script launcher) already started the ranks."""
        return self.launch_env().launcher != "none" or "LOCAL_RANK" in os.environ

    @property
    @override
    def main_address(self) -> str:
        return self.launch_env().master_addr or os.environ.get("MASTER_ADDR", "127.0.0.1")

    @property
    @override
    def main_port(self) -> int:
        port = self.launch_env().master_port
        if port is not None:
            return port
        if self._main_port is None:
            self._main_port = free_port()
        return self._main_port

    @staticmethod
    @override
    def detect() -> bool:
        return True

    @override
    def world_size(self) -> int:
        return self.launch_env().size

    @override
    def set_world_size(self, size: int) -> None:
        """Ignored: the launcher decides the world size."""

    @override
    def global_rank(self) -> int:
        return self.launch_env().rank

    @override
    def set_global_rank(self, rank: int) -> None:
        """Ignored: the launcher decides ranks."""

    @override
    def local_rank(self) -> int:
        return self.launch_env().local_rank

    @override
    def node_rank(self) -> int:
        env = self.launch_env()
        return env.rank // env.local_size

    @override
    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        """Refuse a multi-node self-launch: start those jobs with hvdrun, mpirun or srun.

        Raises:
            SelfLaunchError: ``num_nodes > 1`` and no launcher started this process.
        """
        if num_nodes > 1 and not self.creates_processes_externally:
            raise SelfLaunchError(
                f"Trainer(strategy='horovod', num_nodes={num_nodes}) cannot start processes on other "
                "nodes by itself. HINT: launch every node with hvdrun (or mpirun/srun), e.g. "
                f"`hvdrun -np {num_devices * num_nodes} -H host1:{num_devices},... python train.py`."
            )


class UnevenHostsError(ValueError):
    """The launch put different numbers of processes on the hosts; Lightning's own strategies
    (``ddp``, ``fsdp``, ...) need ``devices`` processes on each of ``num_nodes`` hosts."""


def launch_devices(environ: Mapping[str, str] | None = None) -> tuple[int | str, int]:
    """``(devices, num_nodes)`` for a ``pl.Trainer`` with one of Lightning's own strategies
    (``"ddp"``, ``"fsdp"``), read from the launch this process belongs to, so that
    ``devices * num_nodes`` is its world size under any launcher (hvdrun on one or several hosts,
    torchrun, mpirun, srun). ``("auto", 1)`` when nothing launched it (Lightning decides).

    ``strategy="horovod"`` needs neither: its cluster environment reads the launch itself.

    Example::

        devices, num_nodes = launch_devices()
        trainer = pl.Trainer(strategy="ddp", devices=devices, num_nodes=num_nodes)

    Raises:
        UnevenHostsError: the hosts run different numbers of processes (e.g. ``-H a:3,b:1``),
            which Lightning's strategies cannot describe.
    """
    env = detect_launch_env(environ if environ is not None else HorovodEnvironment.environ())
    if env.launcher == "none" or env.size == 1:
        return "auto", 1
    if env.size % env.local_size:
        raise UnevenHostsError(
            f"this host runs {env.local_size} of the job's {env.size} processes, not a whole share: "
            "Lightning's own strategies need the same number of processes on every host. "
            "HINT: give every host the same slot count (e.g. -H a:2,b:2), or use strategy='horovod'."
        )
    return env.local_size, env.size // env.local_size

"""``hvdrun``: Horovod-style flags translated into a torchrun (or mpirun) command."""

from hvd_trainer.launch.cli import build_torchrun_command, main

__all__ = ["build_torchrun_command", "main"]

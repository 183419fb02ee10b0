"""``hvdrun``: Horovod-style flags translated into a torchrun (or mpirun) command."""

from hvd_trainer.launch.cli import build_torchrun_command, main
from hvd_trainer.launch.errors import HvdrunError
from hvd_trainer.launch.options import HvdrunOptions, parse_options

__all__ = ["build_torchrun_command", "main", "HvdrunError", "HvdrunOptions", "parse_options"]

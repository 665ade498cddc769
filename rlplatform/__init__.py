"""rlplatform: one YAML file, one command, the same RL experiment at any scale."""

from time import time as _now

__version__ = "0.1.0"
IMPORTED_AT = _now()  # the command's start when its process was exec'd by a shell (train.command_start_time)

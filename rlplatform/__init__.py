"""rlplatform: one YAML file, one command, the same RL experiment at any scale."""

__version__ = "0.1.0"

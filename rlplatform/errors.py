"""The one exception type that the CLI turns into `error: ...` and exit code 2."""


class UserError(Exception):
    """Bad input from the user: printed as one line, never as a traceback."""


class TrainingFailed(Exception):
    """The algorithm failed mid-run (exit 1); the checkpoints written so far stay."""

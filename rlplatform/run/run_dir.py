"""The run directory: `runs/<experiment>/<timestamp>/` with config, manifest, metrics, events, checkpoints."""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

from rlplatform.config.files import to_yaml
from rlplatform.config.schema import ExperimentConfig
from rlplatform.errors import UserError

CONFIG_FILE = "config.yaml"
MANIFEST_FILE = "manifest.json"
EXTERNAL_FILE = "external.json"
WRITER_FILE = ".writer"


class WriterLock:
    """One writer per run directory: an exclusive `flock` on the directory itself, held while the run lives.

    The OS drops the lock when the process ends, however it ends, so a crash never leaves a stale lock
    (a `.writer` file left behind only names the last holder and is overwritten). `evaluate`, `report`
    and `dashboard` only read and take none.
    """

    def __init__(self, run_dir: Path):
        import fcntl

        self._info = run_dir / WRITER_FILE
        self._fd = os.open(run_dir, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._fd)
            holder = self._info.read_text().strip() if self._info.is_file() else "another process"
            raise UserError(f"run directory {run_dir} is in use by {holder}; wait for it to end or stop it") from None
        self._info.write_text(f"process {os.getpid()} on {socket.gethostname()} ({' '.join(sys.argv)})\n")

    def release(self) -> None:
        self._info.unlink(missing_ok=True)
        os.close(self._fd)  # closing the descriptor releases the flock


def check_writable(root: Path) -> None:
    """Fail before Ray starts if the runs root cannot be created or written."""
    existing = root
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise UserError(f"output directory is not writable: {root}")


def check_new_dataset_directory(path: Path, what: str, hint: str = "") -> None:
    """Fail before anything is written if `path` (named `what` in the message) cannot take a new dataset: a file, a
    directory that already holds one (nothing there is overwritten nor mixed with another), or not writable."""
    from rlplatform.adapter.offline_data import holds_dataset

    if path.exists() and not path.is_dir():
        raise UserError(f"{what} {path} is a file, not a directory")
    if holds_dataset(path):
        raise UserError(f"{what} {path} already holds a dataset: choose another directory{hint}")
    check_writable(path)


def new_run_dir(root: Path, experiment: str) -> Path:
    stamp = dt.datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    base = root / experiment / stamp
    run_dir, n = base, 1
    while run_dir.exists():
        n += 1
        run_dir = base.with_name(f"{stamp}_{n}")
    try:
        run_dir.mkdir(parents=True)
    except OSError as exc:
        raise UserError(f"cannot create run directory {run_dir}: {exc.strerror}") from None
    return run_dir


def write_config(run_dir: Path, config: ExperimentConfig) -> None:
    (run_dir / CONFIG_FILE).write_text(to_yaml(config))


def write_external(run_dir: Path, config: ExperimentConfig) -> None:
    """`external.json`: where an `env: external` run's simulators connect (docs/external.md)."""
    from rlplatform.client.protocol import PROTOCOL

    ext = config.external
    if ext is None:
        return
    facts = {"host": ext.host, "ports": ext.ports, "protocol": PROTOCOL, "token_required": bool(ext.token_file),
             "observation_space": ext.observation_space.model_dump(exclude_none=True),
             "action_space": ext.action_space.model_dump(exclude_none=True)}
    (run_dir / EXTERNAL_FILE).write_text(json.dumps(facts, indent=1))


def command_facts() -> dict[str, Any]:
    """What started the run: the command line, its directory and checkout (a sweep's trials record the driver's)."""
    return {"command": sys.argv, "cwd": os.getcwd(), "git_commit": _git_commit()}


def write_manifest(run_dir: Path, config: ExperimentConfig, extra: dict[str, Any]) -> None:
    manifest = {
        **command_facts(),
        "started": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "versions": library_versions(),
        "seed": config.seed,
        **extra,
    }
    path = run_dir / MANIFEST_FILE
    if path.exists():  # a resume keeps the first manifest and appends the later start
        first = json.loads(path.read_text())
        first.setdefault("resumes", []).append(manifest)
        manifest = first
    path.write_text(json.dumps(manifest, indent=1, default=str))


def library_versions(extra: tuple[str, ...] = ()) -> dict[str, Optional[str]]:
    """Python's and the installed versions of our main libraries (None where one is missing), plus `extra` packages."""
    from importlib.metadata import PackageNotFoundError, version

    found: dict[str, Optional[str]] = {"python": platform.python_version()}
    for package in ("rlplatform", "ray", "torch", "gymnasium", "numpy", *extra):
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            found[package] = None
    return found


def _git_commit() -> Optional[str]:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def record_start(run_dir: Path, key: str, value: Any) -> None:
    """A fact about the latest start of the run (placement, start-up timings) into the manifest."""
    path = run_dir / MANIFEST_FILE
    manifest = json.loads(path.read_text())
    target = manifest["resumes"][-1] if manifest.get("resumes") else manifest
    target[key] = value
    path.write_text(json.dumps(manifest, indent=1, default=str))

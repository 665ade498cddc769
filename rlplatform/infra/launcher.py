"""Ray's cluster launcher: `ray up`/`ray down` on our launcher YAMLs (cluster/*.yaml), and a tunnel to the
head's dashboard (`ray dashboard CONFIG`) so that the Jobs API never has to listen beyond the head."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import yaml

from rlplatform.errors import UserError

TUNNEL_TIMEOUT_S = 120.0


@dataclass
class LauncherConfig:
    """A Ray cluster launcher YAML, read once."""

    path: Path
    data: dict[str, Any]

    @property
    def provider_type(self) -> Optional[str]:
        return (self.data.get("provider") or {}).get("type")


def read_launcher_config(path: Path) -> LauncherConfig:
    if not path.is_file():
        raise UserError(f"cluster config not found: {path}")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise UserError(f"{path}: malformed YAML: {str(exc).splitlines()[0]}") from None
    return _launcher_config(path, data)


def try_launcher_config(path: Path) -> Optional[LauncherConfig]:
    """The launcher config at `path`; None when the file is something else (an experiment file)."""
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        return None
    return _launcher_config(path, data) if isinstance(data, dict) and "provider" in data else None


def _launcher_config(path: Path, data: Any) -> LauncherConfig:
    if not isinstance(data, dict) or "provider" not in data or "cluster_name" not in data:
        raise UserError(f"{path}: not a Ray cluster launcher config (needs cluster_name and provider)")
    return LauncherConfig(path, data)


def ray_executable() -> str:
    found = shutil.which("ray", path=str(Path(sys.executable).parent)) or shutil.which("ray")
    if not found:
        raise UserError("the `ray` command was not found (pip install 'ray[default]')")
    return found


def launcher_env(config: LauncherConfig) -> dict[str, str]:
    """`ray up` turns on autoscaler v2 on the head (Ray >= 2.50), which does not support the on-prem
    provider: with it the head never starts the workers of `provider: local` (ray-project/ray#57153)."""
    env = dict(os.environ)
    if config.provider_type == "local":
        env.setdefault("RAY_UP_enable_autoscaler_v2", "0")
    return env


def up_or_down(verb: str, config: LauncherConfig, no_config_cache: bool = False) -> int:
    cmd = [ray_executable(), verb, "-y", str(config.path)] + (["--no-config-cache"] if no_config_cache else [])
    return subprocess.call(cmd, env=launcher_env(config))


def head_status(config: LauncherConfig) -> int:
    return subprocess.call([ray_executable(), "exec", str(config.path), "ray status"])


class Tunnel:
    """`ray dashboard CONFIG`: forwards a local port to the head's dashboard over SSH."""

    def __init__(self, config: Path):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.process = subprocess.Popen(
            [ray_executable(), "dashboard", "--port", str(self.port), str(config)],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
        )
        deadline = time.time() + TUNNEL_TIMEOUT_S
        while time.time() < deadline:
            if self.process.poll() is not None:
                assert self.process.stderr is not None  # stderr=PIPE
                err = (self.process.stderr.read() or b"").decode(errors="replace").strip().splitlines()
                raise UserError(f"`ray dashboard {config}` failed: {err[-1] if err else 'exit ' + str(self.process.returncode)}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    return
            except OSError:
                time.sleep(0.5)
        self.close()
        raise UserError(f"no tunnel to the head's dashboard within {TUNNEL_TIMEOUT_S:.0f} s (is the cluster up? `rlplatform cluster up {config}`)")

    @property
    def address(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)

"""Real Ray nodes on one machine: each node its own loopback IP, temp dir and process session, token
auth on, stopped by process id (never `ray stop`, which would kill every Ray process on the host).

The one home of the tests' shared helpers for Ray nodes and run directories (`RayNode`, `free_port`,
`read_metrics`); conftest.py builds its `ray_head` fixture from `RayNode` and re-exports the others."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent
RAY = shutil.which("ray", path=str(Path(sys.executable).parent)) or "ray"
# Find a dead node within ~3 s instead of Ray's default ~30 s.
FAST_FAILURE_DETECTION = {"RAY_health_check_initial_delay_ms": "1000", "RAY_health_check_period_ms": "500",
                          "RAY_health_check_timeout_ms": "500", "RAY_health_check_failure_threshold": "3"}


def free_port() -> int:
    """A TCP port free on loopback now (the OS's choice)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def token_env(fast_failure_detection: bool = True) -> dict[str, str]:
    env = {**os.environ, "RAY_AUTH_MODE": "token", **(FAST_FAILURE_DETECTION if fast_failure_detection else {})}
    env.pop("RAY_ADDRESS", None)
    subprocess.run([RAY, "get-auth-token", "--generate"], env=env, capture_output=True, check=False)
    return env


class RayNode:
    """`ray start --block` in its own session: a head (address None) or a worker joining `address`.

    `fast_failure_detection`: the GCS declares a lost node dead within ~3 s (the multi-node tests kill
    nodes); off, Ray's own defaults, kinder to a loaded machine (the single head most tests share).
    Ray rewrites 127.0.0.1 to the host's address: give each node another loopback IP.
    """

    def __init__(self, ip: str, num_cpus: int, address: Optional[str] = None, dashboard: bool = False,
                 fast_failure_detection: bool = True):
        self.ip = ip
        self.temp_dir = tempfile.mkdtemp(prefix="rlp-mn-", dir="/tmp")  # short: unix socket paths are limited
        self.env = token_env(fast_failure_detection)
        cmd = [RAY, "start", "--block", f"--node-ip-address={ip}", f"--num-cpus={num_cpus}", "--num-gpus=0",
               f"--temp-dir={self.temp_dir}", "--disable-usage-stats",
               # The agent's HTTP port is fixed (52365) by default: a second Ray on the host would take it.
               f"--dashboard-agent-listen-port={free_port()}"]
        if address is None:
            self.port = free_port()
            self.address = f"{ip}:{self.port}"
            cmd += ["--head", f"--port={self.port}"]
            if dashboard:
                self.dashboard_port = free_port()
                self.dashboard_url = f"http://{ip}:{self.dashboard_port}"
                cmd += ["--include-dashboard=true", f"--dashboard-host={ip}", f"--dashboard-port={self.dashboard_port}"]
            else:
                cmd += ["--include-dashboard=false"]
        else:
            self.address = address
            cmd += [f"--address={address}"]
        self.process = subprocess.Popen(cmd, env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                        start_new_session=True)
        self._wait_up(dashboard and address is None)

    def _wait_up(self, dashboard: bool, timeout: float = 90) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.process.poll() is not None:
                err = self.process.stderr.read().decode(errors="replace")[-2000:]
                self.stop()
                raise RuntimeError(f"ray start on {self.ip} failed: {err}")
            if list(Path(self.temp_dir).glob("session_*/sockets/raylet*")) and (not dashboard or self._dashboard_up()):
                time.sleep(1.0)
                return
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"ray node on {self.ip} did not come up within {timeout:.0f} s")

    def _dashboard_up(self) -> bool:
        import urllib.request

        try:
            urllib.request.urlopen(f"{self.dashboard_url}/api/version", timeout=2)
            return True
        except OSError as exc:  # 401 counts as up: the server answers
            return getattr(exc, "code", None) is not None

    def raylet_pid(self) -> int:
        import psutil

        for proc in psutil.process_iter(["pid", "name", "cmdline"]):
            cmdline = proc.info["cmdline"] or []
            if cmdline and cmdline[0].endswith("/raylet") and any(self.temp_dir in part for part in cmdline):
                return proc.info["pid"]
        raise RuntimeError(f"no raylet found under {self.temp_dir}")

    def kill_raylet(self) -> None:
        os.kill(self.raylet_pid(), signal.SIGKILL)

    def stop(self) -> None:
        try:
            os.killpg(self.process.pid, signal.SIGTERM)  # its own session: the node and everything it started
        except ProcessLookupError:
            pass
        try:
            self.process.wait(timeout=8)  # a head's `ray start --block` can take 30 s to exit on SIGTERM
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(self.process.pid, signal.SIGKILL)  # stragglers of the session (workers, agents)
        except ProcessLookupError:
            pass
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def alive_nodes(address: str, env: dict[str, str]) -> int:
    """Number of alive nodes, asked from a separate driver (keeps this process free of Ray)."""
    code = f"import ray; ray.init(address={address!r}, logging_level='ERROR'); print(sum(n['Alive'] for n in ray.nodes()))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    return int(out.stdout.strip().splitlines()[-1])


def wait_for_nodes(address: str, env: dict[str, str], count: int, timeout: float = 60) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if alive_nodes(address, env) == count:
            return
        time.sleep(1)
    raise RuntimeError(f"the cluster at {address} did not reach {count} alive nodes")


def read_metrics(run_dir: Path) -> list[dict]:
    """The rows of a run's metrics.jsonl; none while the run has not written the file yet."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

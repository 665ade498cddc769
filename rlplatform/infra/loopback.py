"""Ray nodes on one machine, as a cluster's nodes: each on its own loopback IP, with its own temp dir and
process session, token authentication on, stopped by process id (never `ray stop`, which would stop every
Ray process on the host).

`bench soak --nodes` and the multi-node tests start clusters with it. Every node runs with `CLUSTER_RAY_ENV`,
the Ray settings our cluster configs (cluster/*.yaml) give their nodes.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Optional

# Every actor call's task events go to the GCS, which keeps up to 100k of them for the dashboard and the
# state API (`ray list tasks`). A training run makes tens of calls a second: with Ray's defaults the GCS of a
# 2-node soak grew all along (still at 10k: 65 -> 89 MB after the warm-up), with these it stays flat (58 -> 60
# MB, docs/reliability.md). Clusters keep the task view for the last 2k tasks and an exact count of dropped
# ones for the last 10k; a private local instance records none (internals/local_node.py). Every cluster
# config sets the same values, checked by tests/test_cluster_configs.py.
CLUSTER_RAY_ENV = {"RAY_task_events_max_num_task_in_gcs": "2000",
                   "RAY_task_events_max_dropped_task_attempts_tracked_per_job_in_gcs": "10000"}
# Find a dead node within ~3 s instead of Ray's default ~30 s (the multi-node tests kill nodes).
FAST_FAILURE_DETECTION = {"RAY_health_check_initial_delay_ms": "1000", "RAY_health_check_period_ms": "500",
                          "RAY_health_check_timeout_ms": "500", "RAY_health_check_failure_threshold": "3"}


def ray_executable() -> str:
    return shutil.which("ray", path=str(Path(sys.executable).parent)) or "ray"


def free_port() -> int:
    """A TCP port free on loopback now (the OS's choice)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def token_env(fast_failure_detection: bool = False) -> dict[str, str]:
    """This process's environment for a node or driver of a token-authenticated cluster (a token is generated
    into ~/.ray/auth_token if there is none)."""
    env = {**os.environ, "RAY_AUTH_MODE": "token", **CLUSTER_RAY_ENV,
           **(FAST_FAILURE_DETECTION if fast_failure_detection else {})}
    env.pop("RAY_ADDRESS", None)
    subprocess.run([ray_executable(), "get-auth-token", "--generate"], env=env, capture_output=True, check=False)
    return env


def node_process(temp_dir, executable: str):
    """The psutil.Process of a Ray executable (`raylet`, `gcs_server`) of the node whose temp dir is `temp_dir`,
    however the node was started (`ray start`, `ray up`); RuntimeError if there is none."""
    import psutil

    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if cmdline and cmdline[0].endswith(f"/{executable}") and any(str(temp_dir) in part for part in cmdline):
            return proc
    raise RuntimeError(f"no {executable} found under {temp_dir}")


class RayNode:
    """`ray start --block` in its own session: a head (address None) or a worker joining `address`.

    `fast_failure_detection`: the GCS declares a lost node dead within ~3 s; off, Ray's own defaults,
    kinder to a loaded machine. Ray rewrites 127.0.0.1 to the host's address: give each node another
    loopback IP (127.0.0.2, 127.0.0.3, ...).
    """

    def __init__(self, ip: str, num_cpus: float, address: Optional[str] = None, dashboard: bool = False,
                 fast_failure_detection: bool = True):
        self.ip = ip
        self.temp_dir = tempfile.mkdtemp(prefix="rlp-mn-", dir="/tmp")  # short: unix socket paths are limited
        self.env = token_env(fast_failure_detection)
        cmd = [ray_executable(), "start", "--block", f"--node-ip-address={ip}", f"--num-cpus={num_cpus:g}",
               "--num-gpus=0", f"--temp-dir={self.temp_dir}", "--disable-usage-stats",
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
                assert self.process.stderr is not None  # stderr=PIPE
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
        try:
            urllib.request.urlopen(f"{self.dashboard_url}/api/version", timeout=2)
            return True
        except OSError as exc:  # 401 counts as up: the server answers
            return getattr(exc, "code", None) is not None

    def processes(self) -> list:
        """psutil.Process of every process of this node: those Ray started for it (found by the node's temp
        dir on their command line: GCS, raylet, dashboard, agents, monitors) and everything below them
        (workers, actors)."""
        import psutil

        found: dict[int, psutil.Process] = {}
        for proc in psutil.process_iter(["pid", "cmdline"]):
            if any(self.temp_dir in part for part in proc.info["cmdline"] or []):
                found[proc.pid] = proc
                try:
                    found.update((child.pid, child) for child in proc.children(recursive=True))
                except psutil.Error:
                    continue
        found.pop(self.process.pid, None)  # `ray start --block` itself waits
        return list(found.values())

    def raylet_pid(self) -> int:
        return node_process(self.temp_dir, "raylet").pid

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


class LoopbackCluster:
    """A head (with the dashboard, as `ray up` starts it) and `workers` worker nodes on 127.0.0.2, .3, ...,
    with `cpus` CPUs each; a context manager that stops every node it started."""

    def __init__(self, workers: int, cpus: float, first_ip: int = 2):
        self.nodes: list[RayNode] = []
        try:
            self.head = self._add(RayNode(f"127.0.0.{first_ip}", cpus, dashboard=True, fast_failure_detection=False))
            for i in range(workers):
                self._add(RayNode(f"127.0.0.{first_ip + 1 + i}", cpus, address=self.head.address,
                                  fast_failure_detection=False))
        except BaseException:
            self.stop()
            raise

    def _add(self, node: RayNode) -> RayNode:
        self.nodes.append(node)
        return node

    @property
    def address(self) -> str:
        return self.head.address

    def stop(self) -> None:
        for node in reversed(self.nodes):
            node.stop()

    def __enter__(self) -> "LoopbackCluster":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

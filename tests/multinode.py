"""The tests' shared helpers for Ray nodes and run directories. Nodes are the product's own loopback nodes
(`rlplatform.infra.loopback`: each its own loopback IP, temp dir and process session, token auth on, stopped
by process id); conftest.py builds its `ray_head` fixture from `RayNode` and re-exports the others."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from rlplatform.infra.loopback import RayNode, free_port, ray_executable, token_env  # noqa: F401  (re-exported)

ROOT = Path(__file__).resolve().parent.parent
RAY = ray_executable()


def alive(pid: int) -> bool:
    """The process runs (a zombie is dead)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[-1][0] != "Z"
    except OSError:
        return False


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

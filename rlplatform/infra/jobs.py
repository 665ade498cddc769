"""Ray Jobs: `rlplatform train` submitted to a cluster as a job (the directory shipped as its working_dir),
its log streamed, and where its run directory ended up.

Token authentication: the Jobs API gets `Authorization: Bearer <token>` from RAY_AUTH_TOKEN,
RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token (the same lookup order as Ray's).
"""

from __future__ import annotations

import os
import re
import shlex
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

from rlplatform.errors import UserError

WORKING_DIR_EXCLUDES = [
    ".git", ".venv", "venv", "runs", "videos", "test-artifacts", ".pytest_cache", ".benchmarks",
    "**/__pycache__", "*.egg-info", "build", "dist", "*.mp4", "*.png", "docker", ".ci",
]
RUN_DIR_LINE = re.compile(r"^(?:run|sweep) directory: (.+?)\s*$", re.MULTILINE)
AGENT_WAIT_S = 90.0  # a head that has just started may not have its job agent yet


def auth_token() -> Optional[str]:
    """Ray's lookup order: RAY_AUTH_TOKEN, the file at RAY_AUTH_TOKEN_PATH, ~/.ray/auth_token."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return os.environ["RAY_AUTH_TOKEN"].strip()
    path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")
    if path.is_file():
        return path.read_text().strip() or None
    if os.environ.get("RAY_AUTH_TOKEN_PATH"):
        raise UserError(f"RAY_AUTH_TOKEN_PATH={path}: no such file")
    return None


def job_client(address: str):
    from ray.job_submission import JobSubmissionClient

    token = auth_token()
    headers = {"Authorization": f"Bearer {token}"} if token else None
    if not re.match(r"^https?://", address):
        address = f"http://{address}"
    try:
        return JobSubmissionClient(address, headers=headers)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise UserError(f"cannot reach the Jobs API at {address}: {str(exc).strip().splitlines()[-1]}") from None


def train_entrypoint(python: str, experiment: Optional[str], overrides: Sequence[str], profile: Optional[str],
                     ray_address: str, runs_dir: str, verb: str = "train") -> str:
    """The job's shell command: `python -m rlplatform train ...` (or `tune ...`, a sweep), every argument quoted
    except a leading `$HOME/` of `runs_dir`, left for the head's shell to expand."""
    parts = [shlex.quote(python), "-m", "rlplatform", verb]
    if experiment:
        parts.append(shlex.quote(experiment))
    for text in overrides:
        parts += ["--set", shlex.quote(text)]
    if profile:
        parts += ["--profile", shlex.quote(profile)]
    parts += ["--address", shlex.quote(ray_address)]
    home = "$HOME/"
    runs = f'"$HOME"/{shlex.quote(runs_dir[len(home):])}' if runs_dir.startswith(home) else shlex.quote(runs_dir)
    parts += ["--runs-dir", runs]
    return " ".join(parts)


def submit_job(client, entrypoint: str, runtime_env: dict, submission_id: Optional[str], timeout_s: float = AGENT_WAIT_S) -> str:
    """Submit; while a freshly started head has no job agent yet ("No available agent"), retry."""
    deadline = time.time() + timeout_s
    while True:
        try:
            return client.submit_job(entrypoint=entrypoint, runtime_env=runtime_env, submission_id=submission_id)
        except (RuntimeError, ConnectionError, ValueError) as exc:
            message = str(exc).strip().splitlines()[-1]
            if "No available agent" not in message or time.time() > deadline:
                raise UserError(f"the cluster refused the job: {message}") from None
            time.sleep(2.0)


async def stream_logs(client, job_id: str) -> None:
    async for chunk in client.tail_job_logs(job_id):
        sys.stdout.write(chunk)
        sys.stdout.flush()


def wait_finished(client, job_id: str, timeout_s: float = 60.0) -> str:
    deadline = time.time() + timeout_s
    status = str(client.get_job_status(job_id))
    while not status.endswith(("SUCCEEDED", "FAILED", "STOPPED")) and time.time() < deadline:
        time.sleep(1.0)
        status = str(client.get_job_status(job_id))
    return status.rsplit(".", 1)[-1]


def is_sweep_log(logs: str) -> bool:
    return "sweep directory: " in logs


def run_dir_from_logs(logs: str) -> Optional[str]:
    found = RUN_DIR_LINE.findall(logs)
    return found[-1] if found else None

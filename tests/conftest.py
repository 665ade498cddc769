import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session", autouse=True)
def hermetic_layout_cache(tmp_path_factory):
    """`--profile auto` reads layouts that `bench throughput` measured on this machine: tests start from none."""
    os.environ["RLPLATFORM_CACHE_DIR"] = str(tmp_path_factory.mktemp("rlplatform-cache"))


def run_cli(*args: str, timeout: float = 600, cwd: Path = ROOT, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run `python -m rlplatform ARGS` as a user would, in its own process."""
    return subprocess.run(
        [sys.executable, "-m", "rlplatform", *map(str, args)],
        capture_output=True, text=True, timeout=timeout, cwd=cwd, env={**os.environ, **(env or {})},
    )


def assert_user_error(result: subprocess.CompletedProcess, *fragments: str) -> str:
    """Exit code 2, exactly one line `error: ...` naming the problem, no traceback."""
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    assert "Traceback" not in output, output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), output
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def only_run_dir(runs: Path, experiment: str) -> Path:
    dirs = sorted((runs / experiment).iterdir())
    assert len(dirs) == 1, dirs
    return dirs[0]


@pytest.fixture
def runs(tmp_path: Path) -> Path:
    return tmp_path / "runs"


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RayHead:
    """A real Ray head node started by the test on loopback, with its own temp dir and token auth.

    Stopped by process id (never `ray stop`, which would kill every Ray process on the host).
    """

    def __init__(self, num_cpus: int = 2, ip: str = "127.0.0.2"):  # Ray rewrites 127.0.0.1 to the host's address
        import shutil
        import tempfile
        import time

        self.port = free_port()
        self.address = f"{ip}:{self.port}"
        self.temp_dir = tempfile.mkdtemp(prefix="rlp-ray-", dir="/tmp")  # short: unix socket paths are limited
        self.env = {**os.environ, "RAY_AUTH_MODE": "token"}
        ray_bin = shutil.which("ray", path=str(Path(sys.executable).parent)) or "ray"
        subprocess.run([ray_bin, "get-auth-token", "--generate"], env=self.env, capture_output=True, check=False)
        self.process = subprocess.Popen(
            [ray_bin, "start", "--head", "--block", f"--node-ip-address={ip}", f"--port={self.port}",
             f"--num-cpus={num_cpus}", "--num-gpus=0", f"--temp-dir={self.temp_dir}", "--include-dashboard=false",
             "--disable-usage-stats"],
            env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
        )
        deadline = time.time() + 60
        while time.time() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"ray start failed: {self.process.stderr.read().decode()[-2000:]}")
            if list(Path(self.temp_dir).glob("session_*/sockets/raylet*")):
                time.sleep(1.0)
                return
            time.sleep(0.5)
        self.stop()
        raise RuntimeError("ray head did not come up within 60 s")

    def stop(self) -> None:
        import shutil
        import signal

        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)  # its own session: the head and the processes it started
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
        shutil.rmtree(self.temp_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def ray_head():
    head = RayHead()
    yield head
    head.stop()

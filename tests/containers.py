"""A Docker engine for the container tests: a daemon (the one running, or `dockerd` started here and
stopped by process id), a CLI that builds with BuildKit, and the CPU image built from docker/Dockerfile.

Docker Hub may be out of reach (it is on the CI machine), so the base image can be made from Debian's
own mirror with debootstrap, and docker/wheelhouse/ is filled from this machine's pip: the image then
installs every wheel without a package index. The Dockerfile is the one users build; only its build
arguments differ. Each step's time goes to `Docker.timings` (the suite's budget, docs/benchmarks.md).
"""

from __future__ import annotations

import hashlib
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent
WHEELHOUSE = ROOT / "docker" / "wheelhouse"
BASE_IMAGE = "rlplatform-test-base:bookworm"  # debootstrap's Debian 12 with python3, python3-venv, ca-certificates
CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
DEBIAN_MIRROR = "http://deb.debian.org/debian"
PYTORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"


class Docker:
    """The docker CLI against a running daemon; `stop()` ends the daemon only if this process started it."""

    def __init__(self) -> None:
        self.timings: dict[str, float] = {}
        self.daemon: Optional[subprocess.Popen] = None
        self.state_dir = Path(tempfile.mkdtemp(prefix="rlp-dockerd-"))
        found = _all_on_path("docker")
        if not found:
            raise DockerUnavailable("no docker CLI on PATH")
        self.cli = found[0]
        if not self._answers():
            self._start_daemon()
        self.cli = self._buildkit_cli()

    def __call__(self, *args: str, timeout: float = 120, check: bool = True, **kwargs) -> subprocess.CompletedProcess:
        result = subprocess.run([self.cli, *args], capture_output=True, text=True, timeout=timeout,
                                env={**os.environ, "DOCKER_BUILDKIT": "1"}, **kwargs)
        if check and result.returncode != 0:
            raise RuntimeError(f"docker {' '.join(args)} failed ({result.returncode}):\n{result.stdout[-3000:]}{result.stderr[-3000:]}")
        return result

    def timed(self, step: str, *args: str, timeout: float = 600, **kwargs) -> subprocess.CompletedProcess:
        started = time.monotonic()
        try:
            return self(*args, timeout=timeout, **kwargs)
        finally:
            self.timings[step] = round(time.monotonic() - started, 1)

    def _answers(self) -> bool:
        return subprocess.run([self.cli, "info"], capture_output=True, timeout=30).returncode == 0

    def _start_daemon(self) -> None:
        dockerd = shutil.which("dockerd")
        if dockerd is None or os.geteuid() != 0:
            raise DockerUnavailable("no Docker daemon answers and none can be started here (dockerd needs root)")
        started = time.monotonic()
        with open(self.state_dir / "dockerd.log", "w") as log:
            self.daemon = subprocess.Popen([dockerd, "--pidfile", str(self.state_dir / "dockerd.pid")],
                                           stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.daemon.poll() is not None:
                raise RuntimeError(f"dockerd exited {self.daemon.returncode}: {(self.state_dir / 'dockerd.log').read_text()[-2000:]}")
            if self._answers():
                self.timings["dockerd start"] = round(time.monotonic() - started, 1)
                return
            time.sleep(0.5)
        self.stop()
        raise RuntimeError("dockerd did not answer within 60 s")

    def _buildkit_cli(self) -> str:
        """The first docker CLI on PATH that builds with BuildKit (docker >= 23 needs the buildx plugin for it;
        Debian's docker.io 20.10 has it built in)."""
        for cli in _all_on_path("docker"):
            probe = subprocess.run([cli, "build", "-q", "-"], input="FROM scratch\nLABEL rlplatform.probe=1\n", text=True,
                                   capture_output=True, timeout=60, env={**os.environ, "DOCKER_BUILDKIT": "1"})
            if probe.returncode == 0:
                return cli
        raise RuntimeError("no docker CLI here builds with BuildKit (RUN --mount): install docker-buildx, or Debian's docker.io")

    def stop(self) -> None:
        if self.daemon is not None and self.daemon.poll() is None:
            os.kill(self.daemon.pid, signal.SIGTERM)  # it stops its containers and the containerd it started
            try:
                self.daemon.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.daemon.pid, signal.SIGKILL)
                self.daemon.wait(timeout=10)
        shutil.rmtree(self.state_dir, ignore_errors=True)


class DockerUnavailable(Exception):
    pass


def _all_on_path(name: str) -> list[str]:
    out: list[str] = []
    for folder in os.environ.get("PATH", "").split(os.pathsep):
        path = os.path.realpath(os.path.join(folder, name))
        if os.access(path, os.X_OK) and os.path.isfile(path) and path not in out:
            out.append(path)
    return out


# ----------------------------------------------------------------------------- the base image and the wheels


def ensure_base_image(docker: Docker) -> Optional[str]:
    """A Debian bookworm base from Debian's mirror (kept in the daemon between sessions); None where
    debootstrap is missing: the build then uses the Dockerfile's own default, the official Python image."""
    if docker("image", "inspect", BASE_IMAGE, check=False).returncode == 0:
        return BASE_IMAGE
    debootstrap = shutil.which("debootstrap")
    if debootstrap is None:
        return None
    rootfs = Path(tempfile.mkdtemp(prefix="rlp-rootfs-"))
    try:
        started = time.monotonic()
        subprocess.run(["nice", "-n", "19", debootstrap, "--variant=minbase", "--include=python3,python3-venv,ca-certificates",
                        "bookworm", str(rootfs), DEBIAN_MIRROR], check=True, capture_output=True, timeout=600)
        docker.timings["debootstrap"] = round(time.monotonic() - started, 1)
        for cache in ("var/cache/apt/archives", "var/lib/apt/lists"):  # the image would carry them
            for entry in (rootfs / cache).glob("*"):
                if entry.is_file():
                    entry.unlink()
        started = time.monotonic()
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        subprocess.run([docker.cli, "import", "-", BASE_IMAGE], stdin=tar.stdout, check=True, capture_output=True, timeout=300)
        assert tar.wait(timeout=60) == 0
        docker.timings["docker import"] = round(time.monotonic() - started, 1)
    finally:
        shutil.rmtree(rootfs, ignore_errors=True)
    return BASE_IMAGE


def torch_version() -> str:
    from importlib.metadata import version

    return version("torch").split("+")[0]


def fill_wheelhouse() -> Optional[subprocess.Popen]:
    """Start `pip download` of the CPU torch and every wheel the project needs into docker/wheelhouse/;
    None where a stamp says that this pyproject.toml's wheels are there already.

    The CPU torch first from this machine's pip configuration (a `+cpu` build; the CI machine has it on
    disk), else from PyTorch's CPU index; then the rest, with torch pinned to that wheel."""
    WHEELHOUSE.mkdir(exist_ok=True)
    torch = f"torch=={torch_version()}+cpu"
    stamp = WHEELHOUSE / f".complete-{hashlib.sha256(((ROOT / 'pyproject.toml').read_text() + torch).encode()).hexdigest()[:16]}"
    if stamp.is_file():
        return None
    pip = f"{shlex.quote(sys.executable)} -m pip download --quiet --dest {shlex.quote(str(WHEELHOUSE))}"
    script = (f"{{ {pip} --no-deps '{torch}' || {pip} --no-deps '{torch}' --index-url {PYTORCH_CPU_INDEX}; }} "
              f"&& {pip} --find-links {shlex.quote(str(WHEELHOUSE))} '{torch}' 'setuptools>=68' {shlex.quote(str(ROOT))} "
              f"&& touch {shlex.quote(str(stamp))}")
    return subprocess.Popen(["nice", "-n", "19", "sh", "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def build_cpu_image(docker: Docker, tag: str, base: Optional[str]) -> None:
    """docker/Dockerfile as users build it, offline: every wheel from docker/wheelhouse/, the CA bundle as a secret."""
    args = ["build", "--progress=plain", "-f", str(ROOT / "docker" / "Dockerfile"), "-t", tag, "--build-arg", "PIP_NO_INDEX=1"]
    if base is not None:
        args += ["--build-arg", f"BASE_IMAGE={base}"]
    if CA_BUNDLE.is_file():
        args += ["--secret", f"id=ca,src={CA_BUNDLE}"]
    started = time.monotonic()
    result = subprocess.run(["nice", "-n", "19", docker.cli, *args, str(ROOT)], capture_output=True, text=True, timeout=900,
                            env={**os.environ, "DOCKER_BUILDKIT": "1"})
    docker.timings["docker build"] = round(time.monotonic() - started, 1)
    if result.returncode != 0:
        raise RuntimeError(f"docker build failed:\n{result.stderr[-5000:]}")

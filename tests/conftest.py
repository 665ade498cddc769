import os
import subprocess
import sys
from pathlib import Path

import pytest
from multinode import ROOT, RayNode, free_port, read_metrics  # noqa: F401  (shared helpers, one definition each)

# The markers are described once, in pyproject.toml. `-m "not slow"` is the quick tier (under two minutes on
# 2 cores, no Ray started): a test that needs a cluster, a browser, Docker or a learning run is slow too.
ONLY_WITH_SLOW = ("cluster", "browser", "learning", "docker")


def pytest_collection_modifyitems(config, items):
    unmarked = [f"{item.nodeid} ({', '.join(sorted(needs))})" for item in items
                if (needs := {m.name for m in item.iter_markers() if m.name in ONLY_WITH_SLOW})
                and item.get_closest_marker("slow") is None]
    if unmarked:
        raise pytest.UsageError("tests that need a cluster, a browser, Docker or a learning run must be "
                                "marked slow as well (the quick tier is -m \"not slow\"):\n  " + "\n  ".join(unmarked))


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


@pytest.fixture(scope="module")
def ray_head():
    """A real Ray head (2 CPUs, no GPU) on 127.0.0.2 for the module's `--address` runs; stopped by process id."""
    head = RayNode("127.0.0.2", num_cpus=2, fast_failure_detection=False)
    yield head
    head.stop()

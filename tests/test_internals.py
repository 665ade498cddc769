"""The speed-ups and every other private Ray/RLlib/torch use: one home, one switch, one version gate.

docs/internals.md lists each use with the test that guards it; these tests guard the home, the
switch and the gate themselves.
"""

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, only_run_dir

PACKAGE = ROOT / "rlplatform"
INTERNALS = PACKAGE / "internals"
LIBRARIES = ("ray", "torch", "copyreg", "gymnasium", "tree")


def _private_uses(path: Path) -> list[str]:
    """Imports and attribute reads of `_names` of Ray, RLlib, torch and co. (strings and comments aside)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    library_names: set[str] = set()
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in LIBRARIES:
                    library_names.add((alias.asname or alias.name).split(".")[0])
                    if any(part.startswith("_") for part in alias.name.split(".")):
                        found.append(f"{path}:{node.lineno}: import {alias.name}")
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in LIBRARIES:
            private_module = any(part.startswith("_") for part in node.module.split("."))
            for alias in node.names:
                library_names.add(alias.asname or alias.name)
                if private_module or alias.name.startswith("_"):
                    found.append(f"{path}:{node.lineno}: from {node.module} import {alias.name}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and root.id in library_names:
                found.append(f"{path}:{node.lineno}: {ast.unparse(node)}")
        if isinstance(node, ast.Attribute) and node.attr == "__wrapped__":
            found.append(f"{path}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_the_checker_sees_private_uses(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("import ray._private.node as n\nfrom ray._raylet import persist_port\nimport torch\n"
                      "torch._C._set_deterministic_algorithms(True)\nfrom ray.rllib.x import _hidden\n"
                      "f = torch.optim.Adam.step.__wrapped__\nname = 'ray._common.deprecation'  # a string\n")
    lines = {int(use.split(":")[1]) for use in _private_uses(sample)}
    assert lines == {1, 2, 4, 5, 6}, _private_uses(sample)


def test_no_module_outside_internals_uses_a_private_ray_rllib_or_torch_symbol():
    outside = [p for p in [*PACKAGE.rglob("*.py"), *(ROOT / "envs").rglob("*.py")] if INTERNALS not in p.parents]
    assert len(outside) > 30
    found = [use for path in outside for use in _private_uses(path)]
    assert not found, "private uses outside rlplatform/internals:\n" + "\n".join(found)


def test_every_private_use_in_internals_is_listed_in_docs():
    table = (ROOT / "docs" / "internals.md").read_text()
    for path in INTERNALS.glob("*.py"):
        if _private_uses(path):
            assert f"internals/{path.name}" in table, f"{path.name} uses private symbols but docs/internals.md does not list it"


def _python(code: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=cwd)


def test_importing_the_speedups_patches_nothing():
    code = (
        "import inspect\n"
        "from ray.rllib.connectors import connector_v2\n"
        "from ray.rllib.utils import torch_utils\n"
        "from ray.rllib.utils.debug import deterministic\n"
        "import rlplatform.internals.lean_env_runner, rlplatform.internals.lean_learner\n"
        "import rlplatform.adapter.algorithm_config, rlplatform.run.algorithm_host, rlplatform.cli\n"
        "assert connector_v2.inspect is inspect, connector_v2.inspect\n"
        "assert deterministic.set_torch_seed is torch_utils.set_torch_seed\n"
        "from rlplatform import internals\n"
        "internals.install_in_process()\n"
        "assert connector_v2.inspect is not inspect\n"
        "assert deterministic.set_torch_seed is not torch_utils.set_torch_seed\n"
        "print('ok')\n"
    )
    result = _python(code)
    assert result.stdout.strip() == "ok", result.stderr


def test_with_the_switch_off_the_algorithm_config_is_plain_rllib():
    code = (
        "import inspect\n"
        "from ray.rllib.connectors import connector_v2\n"
        "from ray.rllib.algorithms.ppo.torch.ppo_torch_learner import PPOTorchLearner\n"
        "from rlplatform.adapter.algorithm_config import build_algorithm_config, record_episode\n"
        "from rlplatform.config.experiment import resolve_experiment\n"
        "off = build_algorithm_config(resolve_experiment(None, ['speedups=false']).config)\n"
        "assert off.env_runner_cls is None and off.learner_class is PPOTorchLearner, (off.env_runner_cls, off.learner_class)\n"
        "assert off.callbacks_on_episode_end is record_episode and off.merge_env_runner_states == 'training_only'\n"
        "assert connector_v2.inspect is inspect  # nothing installed in this process\n"
        "on = build_algorithm_config(resolve_experiment(None).config)\n"
        "assert on.env_runner_cls.__name__ == 'SlimEnvRunner' and on.learner_class.__name__ == 'LeanPPOTorchLearner'\n"
        "assert on.merge_env_runner_states is False  # no connector of the experiment's own: nothing to merge\n"
        "own = build_algorithm_config(resolve_experiment(None).config.model_copy(update={'rllib': {'env_runners': {'env_to_module_connector': print}}}))\n"
        "assert own.merge_env_runner_states == 'training_only'  # a connector of its own may hold state: RLlib merges\n"
        "assert connector_v2.inspect is not inspect\n"
        "print('ok')\n"
    )
    result = _python(code)
    assert result.stdout.strip() == "ok", result.stderr


def test_the_version_gate_closes_on_another_ray_release():
    code = (
        "import ray\n"
        "ray.__version__ = '2.61.0'\n"
        "from rlplatform import internals\n"
        "from rlplatform.config.experiment import resolve_experiment\n"
        "config = internals.gated(resolve_experiment(None).config)\n"
        "assert config.speedups is False and internals.active(config, True) == []\n"
        "assert internals.enabled(True) is False and internals.enabled(False) is False\n"
        "print('ok')\n"
    )
    result = _python(code)
    assert result.stdout.strip() == "ok", result.stderr
    warnings = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(warnings) == 1 and warnings[0].startswith("warning: speed-ups off"), result.stderr
    assert "ray 2.60.0" in warnings[0] and "ray 2.61.0" in warnings[0]


@pytest.mark.slow
def test_a_run_on_a_faked_other_ray_version_warns_once_and_trains_as_plain_rllib(tmp_path):
    runs = tmp_path / "runs"
    code = (
        "import sys, ray\n"
        "ray.__version__ = '2.61.0'\n"
        "from rlplatform.cli import main\n"
        f"sys.exit(main(['train', '--runs-dir', {str(runs)!r}, '--set', 'stop.iterations=2', '--set', 'scale.env_runners=1',"
        " '--set', 'stop.return_mean=null', '--set', 'checkpoint.every=0']))\n"
    )
    result = _python(code, cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    warnings = [line for line in result.stderr.splitlines() if "speed-ups off" in line]
    assert len(warnings) == 1, result.stderr
    run_dir = only_run_dir(runs, "cartpole-ppo")
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["speedups"]["requested"] is True and manifest["speedups"]["active"] == []
    assert manifest["speedups"]["ray"] == "2.61.0"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [1, 2] and rows[-1]["env_steps"] > rows[0]["env_steps"] > 0


@pytest.mark.slow
def test_the_manifest_records_the_speedups_a_run_used(tmp_path):
    from conftest import run_cli

    runs = tmp_path / "runs"
    on = run_cli("train", "--runs-dir", runs, "--set", "stop.iterations=1", "--set", "checkpoint.every=0")
    assert on.returncode == 0, on.stderr
    off = run_cli("train", "--runs-dir", runs, "--set", "stop.iterations=1", "--set", "checkpoint.every=0",
                  "--set", "speedups=false")
    assert off.returncode == 0, off.stderr
    first, second = sorted((runs / "cartpole-ppo").iterdir())
    used = json.loads((first / "manifest.json").read_text())["speedups"]
    assert used["requested"] and {"local_node", "torch_seed", "lean_env_runner", "lean_learner"} <= set(used["active"])
    plain = json.loads((second / "manifest.json").read_text())["speedups"]
    assert plain == {**plain, "requested": False, "active": []}
    assert "speed-ups off" not in off.stderr  # switched off by the user: nothing to warn about

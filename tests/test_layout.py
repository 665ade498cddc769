"""The package layout: every subpackage is installed, envs/ under its own import name."""

import tomllib

from conftest import ROOT


def test_pyproject_installs_every_package_of_the_tree():
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    on_disk = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "rlplatform").rglob("__init__.py")}
    assert on_disk <= set(setuptools["packages"]), on_disk - set(setuptools["packages"])
    assert setuptools["package-dir"] == {"rlplatform_envs": "envs"} and "rlplatform_envs" in setuptools["packages"]
    assert "envs" not in setuptools["packages"]


def test_the_package_root_holds_only_the_entry_the_error_types_and_the_console():
    # The flat package had cluster.py beside cluster_command.py and envs_command.py beside envs/.
    top_level = {p.stem for p in (ROOT / "rlplatform").glob("*.py")}
    assert top_level <= {"__init__", "__main__", "cli", "console", "errors"}, top_level


def test_ci_runs_the_readmes_test_command():
    """`.ci/run` installs, then runs what the README tells a developer to run: lint, types and the tests."""
    readme = (ROOT / "README.md").read_text()
    install_and_test = next(line for line in readme.splitlines() if 'pip install -e ".[test]"' in line)
    readme_tests = install_and_test.split('pip install -e ".[test]" && ', 1)[1].strip()
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert readme_tests in ci_lines, (readme_tests, ci_lines)
    assert "ruff check ." in readme_tests and "mypy" in readme_tests

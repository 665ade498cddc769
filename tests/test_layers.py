"""Imports go one way, down the layers of docs/architecture.md, function-local imports included.

A module may import its own package and any package of a lower layer, never a higher layer nor a sibling
package of its own layer. `internals` has one door (the adapter), and RLlib is imported only where
docs/architecture.md says why. The checks parse the source; nothing is imported.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Iterator, NamedTuple

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Top to bottom (docs/architecture.md, "Layers"). `rlplatform_envs` is the envs/ folder.
LAYERS: list[set[str]] = [
    {"__main__"},
    {"cli"},
    {"commands"},
    {"bench", "serving"},
    {"export"},
    {"run"},
    {"dashboards", "infra"},
    {"adapter"},
    {"internals"},
    {"rlplatform_envs"},
    {"config"},
    {"console", "errors", "__init__"},
    {"client"},
]
LAYER_OF = {package: depth for depth, packages in enumerate(LAYERS) for package in packages}
# The only packages that may import `internals` besides itself: its one door.
INTERNALS_DOORS = {"adapter", "internals"}
# Where `ray.rllib` may be imported, and why (the same lines stand in docs/architecture.md).
RLLIB_ALLOWED = {
    "adapter": "the one RLlib boundary",
    "internals": "the speed-ups replace parts of RLlib",
    "bench": "bench learner times RLlib's own learner and RLlib's networks in plain torch",
    "rlplatform_envs": "multi-agent envs subclass RLlib's MultiAgentEnv or wrap PettingZoo with RLlib's wrapper",
}


class Import(NamedTuple):
    source: str  # path relative to the repository
    line: int
    importer: str  # the importing module's package (first part under rlplatform/, or rlplatform_envs)
    target: str  # the imported module, dotted


def _module_name(path: Path) -> list[str]:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[0] == "envs":
        parts[0] = "rlplatform_envs"
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return parts


def _package(parts: list[str], is_init: bool) -> str:
    if parts[0] == "rlplatform_envs":
        return "rlplatform_envs"
    if len(parts) == 1:  # rlplatform/__init__.py
        return "__init__"
    if len(parts) == 2 and not is_init and (ROOT / "rlplatform" / f"{parts[1]}.py").is_file():
        return parts[1]  # a top-level module: cli, console, errors, __main__
    return parts[1]


def imports_in(source: str, path: Path) -> Iterator[Import]:
    """Every import in `source` (a file at `path`), at any depth of the tree, resolved to a dotted module."""
    parts = _module_name(path)
    is_init = path.name == "__init__.py"
    package_parts = parts if is_init else parts[:-1]
    importer = _package(parts, is_init)
    rel = str(path.relative_to(ROOT))
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(rel, node.lineno, importer, alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package_parts[: len(package_parts) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            # `from rlplatform import internals` imports the subpackage: resolve names that are packages or modules
            for alias in node.names:
                candidate = f"{module}.{alias.name}"
                yield Import(rel, node.lineno, importer, candidate if _is_our_module(candidate) else module)


def _is_our_module(dotted: str) -> bool:
    parts = dotted.split(".")
    if parts[0] == "rlplatform":
        base = ROOT.joinpath(*parts)
    elif parts[0] == "rlplatform_envs":
        base = ROOT.joinpath("envs", *parts[1:])
    else:
        return False
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def target_package(dotted: str) -> str | None:
    """Our package that `dotted` names, or None for a library."""
    parts = dotted.split(".")
    if parts[0] == "rlplatform_envs":
        return "rlplatform_envs"
    if parts[0] != "rlplatform":
        return None
    return parts[1] if len(parts) > 1 else "__init__"


def violations(imp: Import) -> list[str]:
    problems = []
    where = f"{imp.source}:{imp.line}: {imp.importer} imports {imp.target}"
    target = target_package(imp.target)
    if target is not None and target != imp.importer:
        if LAYER_OF[target] < LAYER_OF[imp.importer]:
            problems.append(f"{where}: a higher layer")
        elif LAYER_OF[target] == LAYER_OF[imp.importer]:
            problems.append(f"{where}: a sibling of the same layer")
        if target == "internals" and imp.importer not in INTERNALS_DOORS:
            problems.append(f"{where}: internals is reached through rlplatform.adapter.speedups only")
    if (imp.target == "ray.rllib" or imp.target.startswith("ray.rllib.")) and imp.importer not in RLLIB_ALLOWED:
        problems.append(f"{where}: RLlib is imported only in {sorted(RLLIB_ALLOWED)}")
    if imp.importer == "config" and imp.target.split(".")[0] in ("ray", "torch"):
        problems.append(f"{where}: config is read, checked and sized before Ray or torch loads")
    return problems


def our_sources() -> list[Path]:
    return sorted((ROOT / "rlplatform").rglob("*.py")) + sorted((ROOT / "envs").rglob("*.py"))


def test_every_package_is_in_a_layer():
    packages = {_package(_module_name(p), p.name == "__init__.py") for p in our_sources()}
    assert packages <= set(LAYER_OF), f"packages without a layer: {sorted(packages - set(LAYER_OF))}"


def test_imports_go_down_the_layers():
    found = [problem for path in our_sources() for imp in imports_in(path.read_text(), path) for problem in violations(imp)]
    assert not found, "\n".join(found)


def planted(package: str, source: str) -> list[str]:
    """What the checks say of `source` as if it were a module of `package`."""
    module = ROOT / "rlplatform" / package / "planted.py"
    return [problem for imp in imports_in(source, module) for problem in violations(imp)]


@pytest.mark.parametrize("package, source, expected", [
    ("dashboards", "def f():\n    from rlplatform.run import loop\n", "imports rlplatform.run.loop: a higher layer"),
    ("dashboards", "def f():\n    from ..commands import train\n", "imports rlplatform.commands.train: a higher layer"),
    ("commands", "from rlplatform import internals\n", "internals is reached through"),
    ("commands", "import ray.rllib.core\n", "RLlib is imported only in"),
    ("config", "def gpus():\n    import torch\n", "before Ray or torch loads"),
    ("bench", "from rlplatform.serving import requests\n", "a sibling of the same layer"),
])
def test_a_planted_violation_is_caught_even_inside_a_function(package, source, expected):
    found = planted(package, source)
    assert any(expected in problem for problem in found), found


def test_a_downward_import_passes():
    assert planted("commands", "from rlplatform.export import spec\nfrom rlplatform.adapter import speedups\n") == []


def test_the_layers_are_the_ones_the_architecture_page_names():
    text = (ROOT / "docs" / "architecture.md").read_text()
    for packages in LAYERS:
        for package in packages - {"__init__", "__main__"}:
            assert f"`{package}`" in text, f"docs/architecture.md does not name the layer package {package}"
    for package in RLLIB_ALLOWED:
        assert RLLIB_ALLOWED[package] in text, f"docs/architecture.md does not say why {package} imports RLlib"

"""Experiment files as data: YAML read with our float rule, `--set KEY=VALUE` overrides, profile merges."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

from rlplatform.errors import UserError


class _Loader(yaml.SafeLoader):
    """PyYAML reads `1e-3` as a string (YAML 1.1); hyper-parameters are written that way, so accept it as a float."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
        |\.[0-9_]+(?:[eE][-+][0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)


def load_yaml_text(text: str) -> Any:
    return yaml.load(text, Loader=_Loader)


def read_yaml(path: Path, what: str = "experiment file") -> dict[str, Any]:
    if not path.is_file():
        raise UserError(f"{what} not found: {path}")
    try:
        data = load_yaml_text(path.read_text())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise UserError(f"malformed YAML in {path}{where}: {problem}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UserError(f"{path}: the top level must be a mapping of sections, not {type(data).__name__}")
    return data


def parse_override(text: str) -> tuple[list[str], Any]:
    """`a.b=c` -> (["a", "b"], c); the value is parsed as YAML."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key or any(not part for part in key.split(".")):
        raise UserError(f"bad --set {text!r}: expected KEY=VALUE, e.g. training.lr=1e-3")
    try:
        value = load_yaml_text(raw) if raw.strip() else None
    except yaml.YAMLError:
        raise UserError(f"bad --set {text!r}: the value is not valid YAML") from None
    return key.split("."), value


def apply_override(data: dict[str, Any], path: list[str], value: Any) -> None:
    node = data
    for depth, part in enumerate(path[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise UserError(f"bad --set {'.'.join(path)}: {'.'.join(path[: depth + 1])} is not a section")
        node = child
    node[path[-1]] = value


def deep_merge(base: dict[str, Any], overlay: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in overlay.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def to_yaml(config: BaseModel) -> str:
    # Python mode keeps floats such as .inf (JSON mode would turn them into null).
    return yaml.safe_dump(config.model_dump(), sort_keys=False)

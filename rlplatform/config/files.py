"""Experiment files as data: YAML read with our float rule, `--set KEY=VALUE` overrides, profile merges."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

from rlplatform.errors import UserError

# What an experiment file may hold at most: deeper input, and aliases that multiply it, are refused before it is
# built, so that nothing after reading (validation, `--print-config`, the run's config.yaml) recurses or expands
# without bound. A real experiment is a few levels deep and a few hundred values big.
MAX_DEPTH = 100
MAX_ALIAS_VALUES = 100_000  # values that aliases add to what the text itself holds
_MAX_INT_BITS = 13_000  # about 3,900 decimal digits: Python prints no integer of more than 4,300


class _Loader(yaml.SafeLoader):
    """PyYAML reads `1e-3` as a string (YAML 1.1); hyper-parameters are written that way, so accept it as a float.

    Bad input ends as a `yaml.YAMLError` with its place in the text, never as another exception: nesting deeper
    than MAX_DEPTH, aliases that refer to their own collection or add more than MAX_ALIAS_VALUES, and values PyYAML
    cannot build (the date 2001-13-45, `!!int abc`, an integer of 5,000 digits).
    """

    _depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise yaml.composer.ComposerError(None, None, f"nested deeper than {MAX_DEPTH} levels", self.peek_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def get_single_node(self) -> Any:
        node = super().get_single_node()
        if node is not None:
            _check_expansion(node)
        return node

    def construct_object(self, node: Any, deep: bool = False) -> Any:
        try:
            data = super().construct_object(node, deep=deep)
        except yaml.YAMLError:
            raise
        except Exception as exc:  # ValueError mostly; `!!timestamp x` gives an AttributeError
            raise _unreadable(node, str(exc).split(";")[0] if isinstance(exc, ValueError) else "malformed") from None
        if isinstance(data, int) and data.bit_length() > _MAX_INT_BITS:
            raise _unreadable(node, "too many digits")
        return data


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


def _unreadable(node: yaml.Node, reason: str) -> yaml.YAMLError:
    kind = node.tag.rpartition(":")[2] if isinstance(node, yaml.ScalarNode) else "value"
    return yaml.constructor.ConstructorError(None, None, f"cannot read {_shorten(node.value)!r} as {kind}: {reason}", node.start_mark)


def _shorten(text: Any, limit: int = 60) -> Any:
    return text[:limit] + "..." if isinstance(text, str) and len(text) > limit else text


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.MappingNode):
        return [child for pair in node.value for child in pair]
    return list(node.value) if isinstance(node, yaml.SequenceNode) else []


def _check_expansion(root: yaml.Node) -> None:
    """Refuse a node graph that aliases make recursive, deeper than MAX_DEPTH or MAX_ALIAS_VALUES bigger.

    Walks each node once (an alias shares its anchor's node), without recursion.
    """
    done: dict[int, tuple[int, int]] = {}  # id(node) -> (values it expands to, depth)
    path: set[int] = set()  # the nodes being walked: meeting one again is a cycle
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        if children_done:
            sizes = [done[id(child)] for child in _children(node)]
            size, depth = 1 + sum(s for s, _ in sizes), 1 + max((d for _, d in sizes), default=0)
            path.discard(id(node))
            if depth > MAX_DEPTH:
                raise yaml.composer.ComposerError(None, None, f"nested deeper than {MAX_DEPTH} levels (through aliases)", node.start_mark)
            done[id(node)] = (size, depth)
        elif id(node) in path:
            raise yaml.composer.ComposerError(None, None, "an alias refers to the collection that holds it", node.start_mark)
        elif id(node) not in done:
            path.add(id(node))
            stack.append((node, True))
            stack.extend((child, False) for child in _children(node) if id(child) not in done)
    if done[id(root)][0] - len(done) > MAX_ALIAS_VALUES:
        raise yaml.composer.ComposerError(None, None, f"aliases add more than {MAX_ALIAS_VALUES:,} values", root.start_mark)


def load_yaml_text(text: str) -> Any:
    """YAML -> data; bad input raises `yaml.YAMLError` (see `_Loader`)."""
    return yaml.load(text, Loader=_Loader)


def read_yaml(path: Path, what: str = "experiment file") -> dict[str, Any]:
    if not path.is_file():
        raise UserError(f"{what} not found: {path}")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(f"{path}: not a UTF-8 text file (byte {exc.start + 1}: {exc.reason})") from None
    except OSError as exc:
        raise UserError(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    try:
        data = load_yaml_text(text)
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
    except yaml.YAMLError as exc:
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise UserError(f"bad --set {_shorten(text)!r}: the value is not valid YAML ({problem})") from None
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

"""The speed-ups and every other private Ray/RLlib/torch use: one home, one switch, one version gate.

docs/internals.md lists each use with the test that guards it; these tests guard the home (a guard that
parses the tree for every touch of a private library symbol and checks it against that table), the
patches (in place with the speed-ups on, absent with them off), the switch and the gate themselves.
"""

import ast
import builtins
import functools
import importlib.util
import json
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import pytest
from conftest import ROOT, only_run_dir

PACKAGE = ROOT / "rlplatform"
INTERNALS = PACKAGE / "internals"


# ---- the guard: every touch of a private library symbol, found by parsing ---------------------------
#
# A touch is one of: an attribute `_name` (or `__wrapped__`) read, written or called on anything that is
# not ours; an import of a private module or name; a `def _name` in a class of ours that overrides a
# library class's `_name`; an assignment onto a library module or class (a monkeypatch), `setattr` on one,
# or a write to `os.environ`; a private keyword argument passed to a library's callable. Each is named by
# a symbol (the normal form docs/internals.md's table lists):
#   `Owner._name`           on `self`/`super()` in our subclass of a library class (or on a receiver of a
#                           known type): Owner is the nearest library class in the MRO that defines `_name`
#                           (assigns it, or defines it as a method), else the nearest library base; an override
#                           of a library's private method the same
#   `pkg.module._name...`   a chain through an imported library module or class, as its full dotted path
#   `pkg.module.name =`     an assignment onto a library module or class; `os.environ["KEY"] =` an env write
#   `Callee(_kw=)`          a private keyword argument (Callee: a class's name, else the function's dotted path)
# Library classes are read from their installed source files (parsed, never imported); our classes from
# the tree, with a mixin taken through every class of ours that uses it. Where the parser cannot see a
# receiver's type, RECEIVER_TYPES names it; an unknown receiver is reported as written (`expr._name`).
OUR_PACKAGES = {"rlplatform": PACKAGE, "rlplatform_envs": ROOT / "envs", "envs": ROOT / "envs"}
TABLE = ROOT / "docs" / "internals.md"

# Receivers whose type the parser cannot see: (file, enclosing function, receiver as written) -> class.
RECEIVER_TYPES = {
    ("internals/lean_ppo.py", "lean_sampling_applies", "algo_config"): "ray.rllib.algorithms.algorithm_config.AlgorithmConfig",
    ("internals/lean_ppo.py", "use_lean_ppo", "algo_config"): "ray.rllib.algorithms.algorithm_config.AlgorithmConfig",
    ("internals/columnar_fragment.py", "ColumnarFragments.start", "e"): "ray.rllib.env.single_agent_episode.SingleAgentEpisode",
    ("internals/columnar_fragment.py", "episodes_from_columns", "episode"):
        "ray.rllib.env.single_agent_episode.SingleAgentEpisode",
    ("internals/columnar_fragment.py", "metrics_shell", "shell"):
        "ray.rllib.env.single_agent_episode.SingleAgentEpisode",
    ("internals/columnar_fragment.py", "_buffer", "buffer"):
        "ray.rllib.env.utils.infinite_lookback_buffer.InfiniteLookbackBuffer",
    ("internals/lean_env_runner.py", "LeanEnvRunner._compute_actions", "module"):
        "ray.rllib.core.rl_module.rl_module.RLModule",
    ("internals/lean_learner.py", "_flat_tensor_batch", "batch"): "ray.rllib.policy.sample_batch.SampleBatch",
    ("internals/lean_learner.py", "LeanMiniBatchIterator.applies", "batch_iter"):
        "ray.rllib.utils.minibatch_utils.MiniBatchCyclicIterator",
    ("internals/lean_off_policy.py", "LeanOffPolicyUpdate.after_gradient_based_update", "self.module"):
        "ray.rllib.core.rl_module.multi_rl_module.MultiRLModule",
    ("internals/lean_off_policy.py", "LeanSACTorchLearner.lean_loss_and_gradients", "module"):
        "ray.rllib.algorithms.sac.torch.default_sac_torch_rl_module.DefaultSACTorchRLModule",
}
# What the walk finds that is a documented, public setting of its owner, not a private symbol.
DOCUMENTED = {
    "os._exit": "Python's os module documents it (exit without cleanup)",
    "torch.backends.cudnn.deterministic =": "torch's reproducibility notes document it (RLlib's own seeding sets it)",
    "torch.backends.cudnn.benchmark =": "torch's reproducibility notes document it (RLlib's own seeding sets it)",
    'os.environ["RAY_DEDUP_LOGS"] =': "Ray's logging guide (log deduplication)",
    'os.environ["RAY_AUTH_MODE"] =': "Ray's token authentication guide",
    'os.environ["RAY_AIR_NEW_OUTPUT"] =': "Ray AIR's environment variables (Tune's console output)",
    'os.environ["TUNE_DISABLE_AUTO_CALLBACK_LOGGERS"] =': "Tune's environment variables",
    'os.environ["TUNE_DISABLE_STRICT_METRIC_CHECKING"] =': "Tune's environment variables",
    'os.environ["TUNE_MAX_PENDING_TRIALS_PG"] =': "Tune's environment variables",
    'os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] =': "MLflow's environment variables",
    'os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] =': "MLflow's environment variables",
    'os.environ["WANDB_SILENT"] =': "wandb's environment variables",
    'os.environ["SDL_VIDEODRIVER"] =': "SDL's environment variables (headless rendering)",
    'os.environ["SDL_AUDIODRIVER"] =': "SDL's environment variables (headless rendering)",
}
OUR_ENV_PREFIX = "RLPLATFORM_"
# RLlib's documented extension points for a custom RLModule: underscored, but RLModule's `forward_*` docstrings say
# "This method should not be overridden. Override the `self._forward_*()` method instead", and MultiRLModule calls
# its modules' `_forward` directly. Overriding them (and calling the parent's) is RLlib's public API, not a touch of
# an internal; the guard still reports them, and only these, in the masked modules' file, pass outside internals
# (docs/internals.md).
RLMODULE_EXTENSION_POINTS = {("adapter/action_mask.py", f"DefaultPPOTorchRLModule.{name}")
                             for name in ("_forward", "_forward_train", "_forward_inference", "_forward_exploration")}


def _private(name: str) -> bool:
    """A `_name` (not a dunder), or `__wrapped__` (the undecorated function behind a library's wrapper)."""
    return name == "__wrapped__" or (name.startswith("_") and not (name.startswith("__") and name.endswith("__")))


def _ours(dotted: str) -> bool:
    return dotted.split(".")[0] in OUR_PACKAGES


@dataclass(frozen=True)
class Touch:
    path: str  # as docs/internals.md's module column names it: internals/x.py, run/x.py, envs/x.py
    line: int
    symbol: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.symbol}"


def _shown_path(path: Path) -> str:
    return str(path.relative_to(PACKAGE if PACKAGE in path.parents else ROOT))


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    parts[0] = "rlplatform_envs" if parts[0] == "envs" else parts[0]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _module_file(module: str) -> Optional[Path]:
    """The source file of a module, ours or installed; a top-level package is found, never imported."""
    parts = module.split(".")
    if parts[0] in OUR_PACKAGES:
        base = OUR_PACKAGES[parts[0]]
    else:
        try:
            spec = importlib.util.find_spec(parts[0])
        except (ImportError, ValueError):
            return None
        if spec is None or not spec.submodule_search_locations:
            return Path(spec.origin) if spec and len(parts) == 1 and (spec.origin or "").endswith(".py") else None
        base = Path(list(spec.submodule_search_locations)[0])
    candidates = [base.joinpath(*parts[1:], "__init__.py")]
    if len(parts) > 1:
        candidates.append(base.joinpath(*parts[1:-1], parts[-1] + ".py"))
    return next((c for c in candidates if c.is_file()), None)


@dataclass(eq=False)
class _Module:
    name: str
    tree: ast.Module
    ours: bool
    imports: dict = field(default_factory=dict)  # local name -> dotted path imported
    classes: dict = field(default_factory=dict)  # class name -> ClassDef (ours: nested ones too)
    parents: dict = field(default_factory=dict)  # node -> parent


def _parse(name: str, path: Path, source: str) -> _Module:
    module = _Module(name, ast.parse(source, filename=str(path)), _ours(name))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(module.tree):
        for child in ast.iter_child_nodes(node):
            module.parents[child] = node
        if isinstance(node, ast.Import):
            for alias in node.names:
                module.imports[alias.asname or alias.name.split(".")[0]] = alias.name if alias.asname else alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            source_module = node.module or ""
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source_module = ".".join(base + ([source_module] if source_module else []))
            for alias in node.names:
                if alias.name != "*":
                    module.imports[alias.asname or alias.name] = f"{source_module}.{alias.name}"
        elif isinstance(node, ast.ClassDef) and (module.ours or node in module.tree.body):
            module.classes.setdefault(node.name, node)
    return module


@functools.lru_cache(maxsize=None)
def _module(name: str) -> Optional[_Module]:
    path = _module_file(name)
    if path is None:
        return None
    try:
        return _parse(name, path, path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError):
        return None


@dataclass(eq=False)
class _Class:
    name: str
    module: Optional[_Module]
    node: Optional[ast.ClassDef]  # None: a class whose source is not readable (an extension type)
    ours: bool

    @property
    def short(self) -> str:
        return self.name.rpartition(".")[2]


_CLASSES: dict = {}


def _class(module: _Module, node: ast.ClassDef) -> _Class:
    return _CLASSES.setdefault((module.name, id(node)), _Class(node.name, module, node, module.ours))


def _opaque(dotted: str) -> _Class:
    return _CLASSES.setdefault(("?", dotted), _Class(dotted, None, None, _ours(dotted)))


def _resolve_class(dotted: str, depth: int = 0) -> Optional[_Class]:
    """The class a dotted path names, through re-exports; None where it is no class the parser can read."""
    parts = dotted.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        module = _module(".".join(parts[:cut]))
        if module is None:
            continue
        if cut != len(parts) - 1:
            return None
        name = parts[cut]
        if name in module.classes:
            return _class(module, module.classes[name])
        if name in module.imports and depth < 8:
            return _resolve_class(module.imports[name], depth + 1)
        return None
    return None


def _dotted(expr: ast.AST, module: _Module, aliases: Optional[dict] = None) -> Optional[str]:
    """A Name/Attribute chain as a dotted path from what its root was imported as; None if no import roots it."""
    if isinstance(expr, ast.Attribute):
        root = _dotted(expr.value, module, aliases)
        return f"{root}.{expr.attr}" if root else None
    if isinstance(expr, ast.Name):
        if aliases and expr.id in aliases:
            return aliases[expr.id]
        if expr.id in module.imports:
            return module.imports[expr.id]
        return f"{module.name}.{expr.id}" if module.ours and expr.id in module.classes else None
    if isinstance(expr, (ast.IfExp, ast.Subscript)):  # `A if torch else object`, `Generic[T]`
        return _dotted(expr.body if isinstance(expr, ast.IfExp) else expr.value, module, aliases)
    return None


def _aliases(module: _Module, node: ast.AST) -> dict:
    """Names that the module and the functions around `node` bind to an imported object: `original = mod.Node`,
    `a, b = mod.X, mod.Y`, and RLlib's lazy `torch, nn = try_import_torch()`."""
    scopes, cursor = [], node
    while cursor in module.parents:
        cursor = module.parents[cursor]
        if isinstance(cursor, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Module)):
            scopes.append(cursor)
    aliases: dict = {}
    for scope in reversed(scopes):  # the module first; inner scopes override
        for stmt in scope.body if isinstance(scope, ast.Module) else ast.walk(scope):
            if not isinstance(stmt, ast.Assign) or len(stmt.targets) != 1:
                continue
            target, value = stmt.targets[0], stmt.value
            if isinstance(target, ast.Tuple) and isinstance(value, ast.Call) and (
                    _dotted(value.func, module) or "").endswith("try_import_torch"):
                pairs = zip(target.elts, ("torch", "torch.nn"))
            elif isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple):
                pairs = ((t, _dotted(v, module, aliases)) for t, v in zip(target.elts, value.elts))
            else:
                pairs = [(target, _dotted(value, module, aliases))]
            for name, dotted in pairs:
                if isinstance(name, ast.Name) and dotted:
                    aliases[name.id] = dotted
    return aliases


@functools.lru_cache(maxsize=None)
def _bases(cls: _Class) -> tuple:
    if cls.node is None:
        return ()
    aliases = _aliases(cls.module, cls.node) if cls.module.ours else {}
    bases = []
    for expr in cls.node.bases:
        dotted = _dotted(expr, cls.module, aliases)
        if dotted is None:
            if not (isinstance(expr, ast.Name) and hasattr(builtins, expr.id)):  # object, list, Exception: skipped
                bases.append(_opaque(ast.unparse(expr)))
        elif cls.module.ours and isinstance(expr, ast.Name) and expr.id in cls.module.classes and expr.id not in aliases:
            bases.append(_class(cls.module, cls.module.classes[expr.id]))
        else:
            bases.append(_resolve_class(dotted) or _opaque(dotted))
    return tuple(bases)


@functools.lru_cache(maxsize=None)
def _mro(cls: _Class) -> tuple:
    """C3 linearisation over the parsed classes (the first candidate where C3 has none)."""
    sequences = [list(_mro(b)) for b in _bases(cls)] + [list(_bases(cls))]
    result = [cls]
    while any(sequences):
        sequences = [s for s in sequences if s]
        head = next((s[0] for s in sequences if not any(s[0] in other[1:] for other in sequences)), sequences[0][0])
        result.append(head)
        sequences = [[c for c in s if c is not head] for s in sequences]
    return tuple(result)


@functools.lru_cache(maxsize=None)
def _defines(cls: _Class) -> frozenset:
    """Names a class defines: methods, class attributes, `__slots__`, `self.x = ...` and `setattr(self, "x", ...)`
    (a bare annotation, `x: T`, defines nothing)."""
    if cls.node is None:
        return frozenset()
    names = set()
    for stmt in cls.node.body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(stmt.name)
        elif isinstance(stmt, (ast.Assign, ast.AnnAssign, ast.AugAssign)) and stmt.value is not None:  # not `x: T`
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            assigned = {leaf.id for t in targets for leaf in ast.walk(t) if isinstance(leaf, ast.Name)}
            names |= assigned
            if "__slots__" in assigned and stmt.value is not None:
                names |= {c.value for c in ast.walk(stmt.value) if isinstance(c, ast.Constant) and isinstance(c.value, str)}
    for method in cls.node.body:
        if isinstance(method, (ast.FunctionDef, ast.AsyncFunctionDef)) and method.args.args:
            me = method.args.args[0].arg
            for node in ast.walk(method):
                if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)) and node.value is not None:
                    for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                        names |= {leaf.attr for leaf in ast.walk(target) if isinstance(leaf, ast.Attribute)
                                  and isinstance(leaf.value, ast.Name) and leaf.value.id == me}
                elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr"
                      and len(node.args) > 1 and isinstance(node.args[0], ast.Name) and node.args[0].id == me
                      and isinstance(node.args[1], ast.Constant)):
                    names.add(node.args[1].value)
    return frozenset(names)


def _definer(classes, name: str, library_only: bool = False) -> Optional[_Class]:
    return next((c for c in classes if (not library_only or not c.ours) and name in _defines(c)), None)


def _our_files() -> list:
    return sorted([*PACKAGE.rglob("*.py"), *(ROOT / "envs").rglob("*.py")])


@functools.lru_cache(maxsize=None)
def _our_classes() -> tuple:
    modules = [_module(_module_name(path)) for path in _our_files()]
    return tuple(_class(m, node) for m in modules if m for node in ast.walk(m.tree) if isinstance(node, ast.ClassDef))


def _self_symbols(cls: _Class, name: str, after: bool = False, override: bool = False) -> set:
    """`self.name` (`super().name` with `after`; a `def name` in its body with `override`) in our class `cls`:
    `Owner.name` for the library class that defines the name, in each MRO that holds `cls` (a mixin's too).
    A name a library class defines counts even where a class of ours assigns it as well; one that no parsed
    class defines counts against the nearest library base; one only ours define is ours."""
    symbols, ours_alone = set(), False
    neighbours = [_class(cls.module, node) for node in ast.walk(cls.module.tree) if isinstance(node, ast.ClassDef)]
    for concrete in dict.fromkeys([cls, *(c for c in [*_our_classes(), *neighbours] if c is not cls and cls in _mro(c))]):
        order = _mro(concrete)
        order = order[order.index(cls) + 1:] if after or override else order
        owner = _definer(order, name, library_only=True)
        if owner is None and not override:
            ours_alone = ours_alone or _definer(order, name) is not None
            owner = None if ours_alone else next((c for c in order if not c.ours), None)
        if owner is not None:
            symbols.add(f"{owner.short}.{name}")
    if not symbols and not ours_alone and not override:
        symbols.add(f"{cls.short}.{name}")  # defined nowhere in sight (a mixin used by nothing we parse): reported
    return symbols


def _stored(target: ast.AST):
    """What an assignment target stores into, through tuple unpacking."""
    if isinstance(target, (ast.Tuple, ast.List)):
        for element in target.elts:
            yield from _stored(element)
    else:
        yield target.value if isinstance(target, ast.Starred) else target


class _Walk:
    def __init__(self, module: _Module, shown: str, receiver_types_used: set):
        self.module, self.shown, self.receiver_types_used = module, shown, receiver_types_used
        self.found: set = set()

    def add(self, node: ast.AST, symbol: str) -> None:
        self.found.add(Touch(self.shown, node.lineno, symbol))

    def around(self, node: ast.AST, kinds: tuple) -> list:
        found = []
        while node in self.module.parents:
            node = self.module.parents[node]
            if isinstance(node, kinds):
                found.append(node)
        return found

    def method_of(self, node: ast.AST) -> tuple:
        """(our class, the name its method's instance goes by) around a node in a method or a function in one."""
        scopes = self.around(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef))
        for i, scope in enumerate(scopes):
            if isinstance(scope, ast.ClassDef):
                method = scopes[i - 1] if i else None
                static = method is not None and any(getattr(d, "id", None) == "staticmethod" for d in getattr(method, "decorator_list", []))
                if isinstance(method, (ast.FunctionDef, ast.AsyncFunctionDef)) and method.args.args and not static:
                    return _class(self.module, scope), method.args.args[0].arg
                return _class(self.module, scope), None
        return None, None

    def receiver_type(self, node: ast.AST, receiver: ast.AST) -> Optional[str]:
        scopes = self.around(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
        key = (self.shown, ".".join(s.name for s in reversed(scopes)), ast.unparse(receiver))
        if key in RECEIVER_TYPES:
            self.receiver_types_used.add(key)
            return RECEIVER_TYPES[key]
        for function in scopes:  # a parameter's annotation
            if isinstance(function, ast.ClassDef) or not isinstance(receiver, ast.Name):
                continue
            for arg in [*function.args.posonlyargs, *function.args.args, *function.args.kwonlyargs]:
                if arg.arg == receiver.id and arg.annotation is not None:
                    annotation = arg.annotation
                    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
                        annotation = ast.parse(annotation.value, mode="eval").body
                    typed = _dotted(annotation, self.module)
                    if typed and (_ours(typed) or (not typed.startswith("typing.") and _resolve_class(typed))):
                        return typed
                    return None
        return None

    def library_chain(self, node: ast.AST) -> Optional[str]:
        """The whole `a.b.c` chain around `node` as a dotted path, where an imported library object roots it."""
        while isinstance(self.module.parents.get(node), ast.Attribute):
            node = self.module.parents[node]
        dotted = _dotted(node, self.module, _aliases(self.module, node))
        return dotted if dotted and not _ours(dotted) else None

    def access(self, node: ast.AST, receiver: ast.AST, name: str) -> None:
        """`receiver.name`, `name` private, on anything not rooted in an import."""
        cls, me = self.method_of(node)
        if cls is not None and isinstance(receiver, ast.Name) and receiver.id == me:
            symbols = _self_symbols(cls, name)
        elif cls is not None and isinstance(receiver, ast.Call) and getattr(receiver.func, "id", None) == "super":
            symbols = _self_symbols(cls, name, after=True)
        else:
            typed = self.receiver_type(node, receiver)
            if typed is None:
                symbols = {f"{ast.unparse(receiver)}.{name}"}
            elif _ours(typed):
                symbols = set()
            else:
                owner = _resolve_class(typed)
                symbols = {f"{(_definer(_mro(owner), name) or owner).short}.{name}"}
        for symbol in symbols:
            self.add(node, symbol)

    def env_key(self, key: ast.AST) -> str:
        if isinstance(key, ast.Name):  # a module constant
            name = key.id
            for stmt in self.module.tree.body:
                if isinstance(stmt, ast.Assign) and any(getattr(t, "id", None) == name for t in stmt.targets):
                    key = stmt.value
        return f'"{key.value}"' if isinstance(key, ast.Constant) else ast.unparse(key)

    def env_write(self, node: ast.AST, key: ast.AST) -> None:
        shown = self.env_key(key)
        if not shown.startswith(f'"{OUR_ENV_PREFIX}'):
            self.add(node, f"os.environ[{shown}] =")

    def is_environ(self, node: ast.AST, expr: ast.AST) -> bool:
        return _dotted(expr, self.module, _aliases(self.module, node)) == "os.environ"

    def walk(self) -> set:
        module = self.module
        for node in ast.walk(module.tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if not _ours(alias.name) and any(_private(p) for p in alias.name.split(".")):
                        self.add(node, alias.name)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level and not _ours(node.module):
                for alias in node.names:
                    if _private(alias.name) or any(_private(p) for p in node.module.split(".")):
                        self.add(node, f"{node.module}.{alias.name}")
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
                imported = module.imports.get(node.id, "")
                if imported and not _ours(imported) and any(_private(p) for p in imported.split(".")):
                    self.add(node, self.library_chain(node) or imported)  # a use through a private module's name
            elif isinstance(node, ast.Attribute) and _private(node.attr):
                chain = self.library_chain(node)
                if chain is not None:
                    self.add(node, chain)
                else:
                    self.access(node, node.value, node.attr)
            elif isinstance(node, ast.Call):
                self.call(node)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _private(node.name):
                if isinstance(module.parents.get(node), ast.ClassDef):
                    for symbol in _self_symbols(_class(module, module.parents[node]), node.name, override=True):
                        self.add(node, symbol)
            if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
                for target in node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]:
                    for stored in _stored(target):
                        if isinstance(stored, ast.Attribute):
                            owner = _dotted(stored.value, module, _aliases(module, node))
                            if owner and not _ours(owner):
                                self.add(node, f"{owner}.{stored.attr} =")
                        elif isinstance(stored, ast.Subscript) and self.is_environ(node, stored.value):
                            self.env_write(node, stored.slice)
        return self.found

    def call(self, node: ast.Call) -> None:
        func, args = node.func, node.args
        if isinstance(func, ast.Name) and func.id in ("getattr", "hasattr", "setattr", "delattr") and len(args) > 1:
            if isinstance(args[1], ast.Constant) and isinstance(args[1].value, str) and _private(args[1].value):
                chain = _dotted(args[0], self.module, _aliases(self.module, node))
                if chain and not _ours(chain):
                    self.add(node, f"{chain}.{args[1].value}")
                else:
                    self.access(node, args[0], args[1].value)
            owner = _dotted(args[0], self.module, _aliases(self.module, node))
            if func.id in ("setattr", "delattr") and owner and not _ours(owner):
                name = args[1].value if isinstance(args[1], ast.Constant) else f"<{ast.unparse(args[1])}>"
                self.add(node, f"{owner}.{name} =")
        if isinstance(func, ast.Attribute) and func.attr in ("setdefault", "update", "pop", "__setitem__") and (
                self.is_environ(node, func.value)):
            if func.attr == "update" or not args:
                self.add(node, "os.environ[...] =")
            else:
                self.env_write(node, args[0])
        if _dotted(func, self.module) in ("os.putenv", "os.unsetenv") and args:
            self.env_write(node, args[0])
        private_keywords = [k.arg for k in node.keywords if k.arg and _private(k.arg)]
        callee = self.callee(node) if private_keywords else None
        for keyword in private_keywords if callee else ():
            self.add(node, f"{callee}({keyword}=)")

    def callee(self, node: ast.Call) -> Optional[str]:
        """A called library class's name or function's dotted path; None for ours."""
        func = node.func
        cls, me = self.method_of(node)
        if cls is not None and isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == me:
            return min(_self_symbols(cls, func.attr), default=None)
        dotted = _dotted(func, self.module, _aliases(self.module, node))
        if dotted is None:
            return None if isinstance(func, ast.Name) else ast.unparse(func)  # a local function; a method of something
        if _ours(dotted):
            return None
        target = _resolve_class(dotted)
        return target.short if target is not None else dotted


def private_touches(path: Path, source: Optional[str] = None, receiver_types_used: Optional[set] = None) -> set:
    """Every touch of a private library symbol in one of our files (or in `source`, read as that file), less
    what DOCUMENTED lists."""
    name = _module_name(path)
    module = _module(name) if source is None else _parse(name, path, source)
    found = _Walk(module, _shown_path(path), set() if receiver_types_used is None else receiver_types_used).walk()
    return {touch for touch in found if touch.symbol not in DOCUMENTED}


def table_symbols(text: str) -> dict:
    """docs/internals.md's table: module (`internals/x.py`) -> the backticked symbols of its rows' second column."""
    section = text.split("\n## The table", 1)[1].split("\n## ", 1)[0]
    rows: dict = {}
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) < 2 or not cells[0].startswith("`"):
            continue
        rows.setdefault(cells[0].strip("`"), set()).update(re.findall(r"`([^`]+)`", cells[1]))
    return rows


def table_problems(found: set, table: dict) -> list:
    """A found touch whose symbol its module's rows do not list; a listed symbol its module no longer touches."""
    problems = [f"{touch}  is not listed in docs/internals.md's table for `{touch.path}`"
                for touch in sorted(found, key=lambda t: (t.path, t.line, t.symbol))
                if touch.symbol not in table.get(touch.path, set())]
    present = {(touch.path, touch.symbol) for touch in found}
    problems += [f"docs/internals.md lists `{symbol}` for `{path}`, which no longer touches it (a stale entry)"
                 for path, symbols in sorted(table.items()) for symbol in sorted(symbols) if (path, symbol) not in present]
    return problems


def _touches_everywhere(receiver_types_used: Optional[set] = None) -> set:
    return {touch for path in _our_files() for touch in private_touches(path, receiver_types_used=receiver_types_used)}


PLANTED = '''
import os
import ray
import torch
import ray._private.worker as ray_worker
from ray._raylet import persist_port
from ray.rllib.env import single_agent_env_runner
from ray.rllib.env.single_agent_env_runner import SingleAgentEnvRunner
from ray.rllib.policy.sample_batch import SampleBatch, _private_helper
from ray.rllib.utils.minibatch_utils import MiniBatchCyclicIterator
from rlplatform.internals.lean_env_runner import LeanEnvRunner
from rlplatform.internals.lean_learner import _fused_adam_supported

FLAG = "RLLIB_TEST_NO_TORCH_IMPORT"


class Planted(SingleAgentEnvRunner):
    def __init__(self):
        self._cache = {}

    def _sample(self, **kwargs):
        self._cache.clear()
        self._needs_initial_reset = False
        return self._ongoing_episodes + super()._reset_envs()

    def _own_helper(self):
        return self._cache


class Mixin:
    def sequence_number(self):
        return self._weights_seq_no


class Planted2(Mixin, LeanEnvRunner):
    pass


def plant(iterator: MiniBatchCyclicIterator, other):
    single_agent_env_runner.get_device = print
    setattr(torch.optim.Adam, "step", None)
    os.environ[FLAG] = "1"
    os.environ.setdefault("RAY_SOMETHING", "1")
    os.environ["RLPLATFORM_OURS"] = "1"
    ray.init(_system_config={})
    SampleBatch({}, _time_major=False)
    torch._C._set_deterministic_algorithms(True)
    _fused_adam_supported([])
    return (persist_port, ray_worker.global_worker.mode, torch.optim.Adam.step.__wrapped__, getattr(other, "_hidden"),
            iterator._batch, other._thing, other.public)
'''


def test_the_guard_reports_every_kind_of_touch_and_nothing_of_ours():
    found = {touch.symbol for touch in private_touches(INTERNALS / "planted.py", PLANTED)}
    assert found == {
        "ray._private.worker", "ray._private.worker.global_worker.mode",  # a private module, a use through it
        "ray._raylet.persist_port", "ray.rllib.policy.sample_batch._private_helper",  # private imports
        "SingleAgentEnvRunner._sample",  # a private method overridden
        "SingleAgentEnvRunner._needs_initial_reset", "SingleAgentEnvRunner._ongoing_episodes",  # through self
        "SingleAgentEnvRunner._reset_envs",  # through super()
        "SingleAgentEnvRunner._weights_seq_no",  # through a mixin's self, in the class that uses it
        "ray.rllib.env.single_agent_env_runner.get_device =", "torch.optim.Adam.step =",  # monkeypatches
        'os.environ["RLLIB_TEST_NO_TORCH_IMPORT"] =', 'os.environ["RAY_SOMETHING"] =',  # env writes
        "ray.init(_system_config=)", "SampleBatch(_time_major=)",  # private keyword arguments
        "torch._C._set_deterministic_algorithms", "torch.optim.Adam.step.__wrapped__",  # library chains
        "MiniBatchCyclicIterator._batch",  # a receiver of an annotated library type
        "other._hidden", "other._thing",  # receivers of unknown type, as written
    }, found  # and not: self._cache, _own_helper, our _fused_adam_supported, other.public, RLPLATFORM_ variables


def test_every_private_touch_in_internals_is_in_the_table_and_every_entry_is_found():
    found = {touch for touch in _touches_everywhere() if touch.path.startswith("internals/")}
    assert len({touch.symbol for touch in found}) > 60
    problems = table_problems(found, table_symbols(TABLE.read_text()))
    assert not problems, "\n".join(problems)


def test_nothing_outside_internals_touches_a_private_library_symbol():
    outside = sorted((t for t in _touches_everywhere()
                      if not t.path.startswith("internals/") and (t.path, t.symbol) not in RLMODULE_EXTENSION_POINTS),
                     key=str)
    assert len(_our_files()) > 60
    assert not outside, "private library symbols touched outside rlplatform/internals:\n" + "\n".join(map(str, outside))


def test_the_table_check_reports_an_unlisted_touch_and_a_stale_entry():
    found = {touch for touch in _touches_everywhere() if touch.path.startswith("internals/")}
    table = table_symbols(TABLE.read_text())
    assert table["internals/lean_env_runner.py"] >= {"EnvRunner._metrics_num_env_steps_sampled", "SingleAgentEnvRunner._sample"}
    unlisted = {**table, "internals/lean_env_runner.py": table["internals/lean_env_runner.py"] - {"SingleAgentEnvRunner._sample"}}
    problems = [p for p in table_problems(found, unlisted) if "SingleAgentEnvRunner._sample" in p]
    assert problems and all(p.startswith("internals/lean_env_runner.py:") and "is not listed" in p for p in problems)
    stale = {**table, "internals/torch_seed.py": table["internals/torch_seed.py"] | {"torch._C._gone"}}
    assert table_problems(found, stale) == table_problems(found, table) + [
        "docs/internals.md lists `torch._C._gone` for `internals/torch_seed.py`, which no longer touches it (a stale entry)"]


def test_every_receiver_type_the_guard_names_is_used():
    used: set = set()
    _touches_everywhere(used)
    assert set(RECEIVER_TYPES) == used, set(RECEIVER_TYPES) - used


def _python(code: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=cwd)


@pytest.mark.slow  # a Python process that imports RLlib (4 s on 2 cores)
def test_importing_the_speedups_patches_nothing():
    code = (
        "import inspect, os\n"
        "import rlplatform.internals.slim_env_runner  # first: its hook check runs before RLlib is loaded\n"
        "import ray._private.node as node_module, ray._private.utils as ray_utils\n"
        "from ray.rllib.connectors import connector_v2\n"
        "from ray.rllib.env import single_agent_env_runner\n"
        "from ray.rllib.utils import torch_utils\n"
        "from ray.rllib.utils.debug import deterministic\n"
        "import rlplatform.internals.lean_env_runner, rlplatform.internals.lean_learner, rlplatform.internals.local_node\n"
        "import rlplatform.internals.lean_off_policy, rlplatform.adapter.speedups, rlplatform.infra.local_ray\n"
        "import rlplatform.adapter.algorithm_config, rlplatform.run.algorithm_host, rlplatform.cli\n"
        "assert connector_v2.inspect is inspect, connector_v2.inspect\n"
        "assert deterministic.set_torch_seed is torch_utils.set_torch_seed\n"
        "assert node_module.Node.__module__ == 'ray._private.node', node_module.Node\n"
        "assert ray_utils.get_dashboard_dependency_error.__module__ == 'ray._private.utils'\n"
        "assert single_agent_env_runner.get_device.__module__ == 'ray.rllib.utils.framework'\n"
        "assert 'RLLIB_TEST_NO_TORCH_IMPORT' not in os.environ and not rlplatform.internals.slim_env_runner.TORCH_FREE\n"
        "from rlplatform import internals\n"
        "internals.install_in_process()\n"
        "assert connector_v2.inspect is not inspect\n"
        "assert deterministic.set_torch_seed is not torch_utils.set_torch_seed\n"
        "print('ok')\n"
    )
    result = _python(code)
    assert result.stdout.strip() == "ok", result.stderr


@pytest.mark.slow  # a Python process that imports RLlib (4 s on 2 cores)
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
        "from ray.rllib.utils import torch_utils\n"
        "from ray.rllib.utils.debug import deterministic\n"
        "assert connector_v2.inspect is inspect  # nothing installed in this process\n"
        "assert deterministic.set_torch_seed is torch_utils.set_torch_seed\n"
        "on = build_algorithm_config(resolve_experiment(None).config)\n"
        "assert on.env_runner_cls.__name__ == 'SlimEnvRunner' and on.learner_class.__name__ == 'LeanPPOTorchLearner'\n"
        "assert on.merge_env_runner_states is False  # no connector of the experiment's own: nothing to merge\n"
        "own = build_algorithm_config(resolve_experiment(None).config.model_copy(update={'rllib': {'env_runners': {'env_to_module_connector': print}}}))\n"
        "assert own.merge_env_runner_states == 'training_only'  # a connector of its own may hold state: RLlib merges\n"
        "appo = ['algorithm=APPO', 'training={lr: 0.0005}', 'scale.rollout_fragment_length=50']\n"
        "assert build_algorithm_config(resolve_experiment(None, appo + ['speedups=false']).config).timeout_s_sampler_manager == 0.0\n"
        "assert build_algorithm_config(resolve_experiment(None, appo).config).timeout_s_sampler_manager > 0  # waits, not polls\n"
        "given = resolve_experiment(None, appo + ['training.timeout_s_sampler_manager=0.5']).config\n"
        "assert build_algorithm_config(given).timeout_s_sampler_manager == 0.5  # the experiment's own value wins\n"
        "assert connector_v2.inspect is not inspect and deterministic.set_torch_seed is not torch_utils.set_torch_seed\n"
        "print('ok')\n"
    )
    result = _python(code)
    assert result.stdout.strip() == "ok", result.stderr


def test_the_local_node_patches_hold_only_while_a_lean_local_start_runs(monkeypatch):
    """The two patches of internals/local_node.py, on and off, without starting Ray: `ray.init` records them."""
    import ray
    import ray._private.node as node_module
    import ray._private.utils as ray_utils

    from rlplatform.config.sizing import Resources
    from rlplatform.infra import local_ray
    from rlplatform.internals import local_node

    rays_node, rays_check = node_module.Node, ray_utils.get_dashboard_dependency_error
    seen = []
    monkeypatch.setattr(ray, "init", lambda **kwargs: seen.append(
        (node_module.Node, ray_utils.get_dashboard_dependency_error, kwargs.get("_system_config"))))
    monkeypatch.setattr(local_ray, "cluster_resources", lambda: None)
    monkeypatch.setenv("RAY_DEDUP_LOGS", "1")  # connect sets it when unset
    for speedups in (True, False):
        local_ray.connect(None, Resources(2, 0, [{"CPU": 2, "GPU": 0}]), prestart_workers=False, speedups=speedups)
    (on_node, on_check, on_config), (off_node, off_check, off_config) = seen
    assert on_node.__name__ == "LeanLocalNode" and on_node.__mro__[1] is rays_node
    assert on_check is local_node.dashboard_dependency_error and on_config == local_node.system_config(False)
    assert off_node is rays_node and off_check is rays_check and off_config is None
    assert node_module.Node is rays_node and ray_utils.get_dashboard_dependency_error is rays_check  # put back


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

"""The experiment schema: ours, versioned, validated once.

An experiment file is YAML with the sections below. Profiles (``experiments/profiles``)
overlay ``scale`` and ``hardware``; ``--set a.b=c`` overrides any key last.
RLlib is not imported here: the adapter maps this schema onto ``AlgorithmConfig``.
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Any, Literal, Optional, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from rlplatform.errors import UserError

SCHEMA_VERSION = 1
ALGORITHMS = ("PPO", "APPO", "IMPALA", "DQN", "SAC")
ASYNCHRONOUS_ALGORITHMS = ("APPO", "IMPALA")  # they learn while their env runners sample
DEFAULT_PROFILE = "auto"


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelSection(Section):
    hidden: list[int] = Field(default_factory=lambda: [256, 256])
    activation: Literal["tanh", "relu", "swish", "silu", "elu", "linear"] = "tanh"
    vf_share_layers: bool = False
    # CNN: list of [out_channels, kernel, stride] (RLlib's conv_filters); null = RLlib's default for the image size.
    conv_filters: Optional[list[list[Union[int, list[int]]]]] = None
    conv_activation: Literal["relu", "tanh", "swish", "silu", "elu", "linear"] = "relu"
    use_lstm: bool = False
    lstm_cell_size: int = Field(256, gt=0)
    max_seq_len: int = Field(20, gt=0)
    head_hidden: list[int] = Field(default_factory=list)


class ScaleSection(Section):
    env_runners: int = Field(1, ge=0)
    envs_per_runner: int = Field(1, ge=1)
    vectorize: Literal["sync", "async"] = "sync"
    # lean: RLlib's env runner with its default per-step connectors done on the batch (rlplatform/lean_env_runner.py);
    # rllib: RLlib's own, unchanged. Both give the same episodes; lean falls back to rllib where it does not apply.
    sampler: Literal["lean", "rllib"] = "lean"
    # lean: the learner's gradient step with one finiteness check and fused Adam (rlplatform/lean_learner.py;
    # PPO, APPO, IMPALA); rllib: RLlib's own. Same maths; lean takes RLlib's path for non-finite gradients.
    update: Literal["lean", "rllib"] = "lean"
    rollout_fragment_length: Union[int, Literal["auto"]] = "auto"
    learners: int = Field(0, ge=0)
    placement: Literal["pack", "spread", "strict_pack", "strict_spread"] = "pack"

    @field_validator("rollout_fragment_length")
    @classmethod
    def _positive_fragment(cls, value: Union[int, str]) -> Union[int, str]:
        if isinstance(value, int) and value <= 0:
            raise ValueError("must be a positive integer or 'auto'")
        return value


class HardwareSection(Section):
    driver_cpus: float = Field(1, ge=0)
    cpus_per_env_runner: float = Field(1, ge=0)
    gpus_per_env_runner: float = Field(0, ge=0)
    cpus_per_learner: float = Field(1, ge=0)
    gpus_per_learner: float = Field(0, ge=0)


class StopSection(Section):
    return_mean: Optional[float] = None
    env_steps: Optional[int] = Field(None, gt=0)
    iterations: Optional[int] = Field(None, gt=0)
    wall_time_s: Optional[float] = Field(None, gt=0)


class CheckpointSection(Section):
    every: int = Field(10, ge=0)  # iterations; 0 = only at the end
    keep_last: int = Field(3, ge=1)
    keep_best: bool = True


class EvaluationSection(Section):
    interval: int = Field(0, ge=0)  # iterations; 0 = off
    episodes: int = Field(10, ge=1)


class PolicySection(Section):
    model: Optional[ModelSection] = None  # this policy's network; default: the experiment's `model`


class MultiAgentSection(Section):
    """Which policies exist, which agent each uses (first matching id pattern), which ones train.

    Several agents mapped to one policy share its weights; one policy per agent keeps them apart.
    """

    policies: dict[str, PolicySection]
    mapping: dict[str, str]  # agent-id glob pattern -> policy, e.g. {"pursuer_*": pursuer}
    train: Optional[list[str]] = None  # default: every policy

    @field_validator("policies", mode="before")
    @classmethod
    def _names_are_enough(cls, value: Any) -> Any:
        return {name: {} for name in value} if isinstance(value, list) else value

    @model_validator(mode="after")
    def _consistent(self) -> "MultiAgentSection":
        if not self.policies:
            raise ValueError("needs at least one policy")
        for pattern, policy in self.mapping.items():
            if policy not in self.policies:
                raise ValueError(f"mapping {pattern!r} -> {policy!r}: no such policy{_suggest(policy, self.policies)}")
        for policy in self.train or []:
            if policy not in self.policies:
                raise ValueError(f"train: no such policy {policy!r}{_suggest(policy, self.policies)}")
        return self


class ExperimentConfig(Section):
    version: Literal[1] = SCHEMA_VERSION
    name: str = Field("experiment", pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    algorithm: str = "PPO"
    env: str = "CartPole-v1"
    env_config: dict[str, Any] = Field(default_factory=dict)
    profile: str = DEFAULT_PROFILE
    seed: Optional[int] = 0
    training: dict[str, Any] = Field(default_factory=dict)
    model: ModelSection = Field(default_factory=ModelSection)
    scale: ScaleSection = Field(default_factory=ScaleSection)
    hardware: HardwareSection = Field(default_factory=HardwareSection)
    stop: StopSection = Field(default_factory=StopSection)
    checkpoint: CheckpointSection = Field(default_factory=CheckpointSection)
    evaluation: EvaluationSection = Field(default_factory=EvaluationSection)
    multi_agent: Optional[MultiAgentSection] = None
    rllib: dict[str, dict[str, Any]] = Field(default_factory=dict)

    @field_validator("algorithm")
    @classmethod
    def _known_algorithm(cls, value: str) -> str:
        upper = value.upper()
        if upper not in ALGORITHMS:
            raise ValueError(f"unknown algorithm {value!r}{_suggest(upper, ALGORITHMS)}; known: {', '.join(ALGORITHMS)}")
        return upper

    def has_stop_criterion(self) -> bool:
        return any(v is not None for v in self.stop.model_dump().values())


def _suggest(word: str, choices) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


# ----------------------------------------------------------------------------- loading


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


def validate(data: dict[str, Any], source: str = "config") -> ExperimentConfig:
    try:
        return ExperimentConfig.model_validate(data)
    except ValidationError as exc:
        raise UserError(describe_validation_error(exc, data, source)) from None


def describe_validation_error(exc: ValidationError, data: dict[str, Any], source: str) -> str:
    err = exc.errors()[0]
    loc = [str(p) for p in err["loc"]]
    key = ".".join(loc)
    if err["type"] == "extra_forbidden":
        section_model = _model_at(loc[:-1])
        known = list(section_model.model_fields) if section_model else []
        return f"{source}: unknown key {key!r}{_suggest(loc[-1], known)}"
    value = _value_at(data, loc)
    msg = err["msg"].removeprefix("Value error, ")
    shown = f" = {value!r}" if value is not _MISSING else ""
    return f"{source}: {key}{shown}: {msg}"


_MISSING = object()


def _value_at(data: Any, loc: list[str]) -> Any:
    node = data
    for part in loc:
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return _MISSING
    return node


def _model_at(loc: list[str]) -> Optional[type[BaseModel]]:
    """The section model at a location such as ["multi_agent", "policies", "p0", "model"]."""
    annotation: Any = ExperimentConfig
    for part in loc:
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            field = annotation.model_fields.get(part)
            annotation = field.annotation if field else None
        elif get_origin(annotation) is dict:
            annotation = get_args(annotation)[1]
        else:
            return None
        optional = [a for a in get_args(annotation) if a is not type(None)] if get_origin(annotation) is Union else None
        annotation = optional[0] if optional and len(optional) == 1 else annotation
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def to_yaml(config: ExperimentConfig) -> str:
    # Python mode keeps floats such as .inf (JSON mode would turn them into null).
    return yaml.safe_dump(config.model_dump(), sort_keys=False)

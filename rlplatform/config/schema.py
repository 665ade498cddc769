"""The experiment schema: ours, versioned, validated once.

An experiment file is YAML with the sections below. Profiles (``experiments/profiles``)
overlay ``scale`` and ``hardware``; ``--set a.b=c`` overrides any key last.
RLlib is not imported here: the adapter maps this schema onto ``AlgorithmConfig``.
"""

from __future__ import annotations

from typing import Any, Final, Literal, Optional, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from rlplatform.config.files import MAX_DEPTH
from rlplatform.config.search import SearchSection
from rlplatform.errors import UserError, did_you_mean

SCHEMA_VERSION: Final = 1
ALGORITHMS = ("PPO", "APPO", "IMPALA", "DQN", "SAC", "TQC", "DREAMERV3", "BC", "MARWIL", "CQL", "IQL")
MASKED_ALGORITHMS = ("PPO", "APPO", "IMPALA")  # model.action_mask: the algorithms whose module masks its logits
# They learn from recorded episodes (the `data` section), not from env runners; the env, where named, evaluates.
OFFLINE_ALGORITHMS = ("BC", "MARWIL", "CQL", "IQL")
BOX_ACTION_ALGORITHMS = ("CQL", "IQL")  # RLlib 2.60's CQL and IQL modules take a Box action only
ASYNCHRONOUS_ALGORITHMS = ("APPO", "IMPALA")  # they learn while their env runners sample
AGGREGATOR_ALGORITHMS = ("APPO", "IMPALA")  # RLlib's training steps that use aggregator actors (scale.aggregators_per_learner)
DEFAULT_PROFILE = "auto"
MAX_ACTORS = 100_000  # env runners or learners a run may ask for: more than any Ray cluster holds
MIN_RESOURCE = 0.0001  # Ray's smallest unit of a CPU or GPU


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelSection(Section):
    hidden: list[int] = Field(default_factory=lambda: [256, 256])
    activation: Literal["tanh", "relu", "swish", "silu", "elu", "linear"] = "tanh"
    vf_share_layers: bool = False
    # CNN: list of [out_channels, kernel, stride] or [out_channels, kernel, stride, "same" | "valid"] (RLlib's
    # conv_filters; without the padding RLlib pads "same"); null = RLlib's default for the image size.
    conv_filters: Optional[list[list[Union[int, list[int], str]]]] = None
    conv_activation: Literal["relu", "tanh", "swish", "silu", "elu", "linear"] = "relu"
    use_lstm: bool = False
    lstm_cell_size: int = Field(256, gt=0)
    max_seq_len: int = Field(20, gt=0)
    head_hidden: list[int] = Field(default_factory=list)
    # SAC's Q networks on a flat observation and a Box action: "joint", one MLP of `hidden` on [s, a] (SB3's and
    # CleanRL's); "streams", RLlib's own: an MLP of `hidden` for each of s and a, joined by the fusion layers.
    q_network: Literal["joint", "streams"] = "joint"
    # "streams" only: the layers after the observation and action encoders (RLlib's fusionnet_hiddens).
    fusion_hidden: list[int] = Field(default_factory=lambda: [256, 256])
    fusion_activation: Literal["tanh", "relu", "swish", "silu", "elu", "linear"] = "tanh"
    # Action masking for a Discrete action (PPO, APPO, IMPALA): the key of the env's Dict observation that holds the
    # mask (1 = legal); the policy reads the Dict's one other key. null: no masking.
    action_mask: Optional[str] = Field(None, min_length=1)

    @field_validator("conv_filters")
    @classmethod
    def _conv_layers(cls, layers: Optional[list[list[Any]]]) -> Optional[list[list[Any]]]:
        for i, layer in enumerate(layers or []):
            shape_ok = len(layer) in (3, 4) and all(not isinstance(v, str) for v in layer[:3])
            if not shape_ok or (len(layer) == 4 and layer[3] not in ("same", "valid")):
                raise ValueError(f"layer {i}: [out_channels, kernel, stride] or [out_channels, kernel, stride, "
                                 f"same|valid], not {layer}")
        return layers

    @model_validator(mode="after")
    def _fusion_needs_streams(self) -> "ModelSection":
        fields = type(self).model_fields
        given = [k for k in ("fusion_hidden", "fusion_activation")
                 if getattr(self, k) != fields[k].get_default(call_default_factory=True)]
        if given and self.q_network == "joint":
            raise ValueError(f"{given[0]} shapes SAC's two-stream Q network; set q_network: streams "
                             "to use it (the default, joint, is one MLP of `hidden` on [observation, action])")
        return self


class ScaleSection(Section):
    env_runners: int = Field(1, ge=0)
    envs_per_runner: int = Field(1, ge=1)
    vectorize: Literal["sync", "async"] = "sync"
    rollout_fragment_length: Union[int, Literal["auto"]] = "auto"
    learners: int = Field(0, ge=0)
    # APPO/IMPALA: actors (1 CPU each) that run the sampled episodes through the learner connector pipeline,
    # so the learners get ready train batches; max(learners, 1) x this many in all (RLlib's
    # num_aggregator_actors_per_learner). 0: the learners do it themselves.
    aggregators_per_learner: int = Field(0, ge=0)
    # PPO with more remote runners than this: the sample requests go through relay actors, one per group of at most
    # this many runners on a node, and the driver handles one request per relay (internals/sample_relay.py). 0: never.
    runners_per_relay: int = Field(32, ge=0)
    placement: Literal["pack", "spread", "strict_pack", "strict_spread"] = "pack"
    # Where the Algorithm (RLlib's training_step, and a local learner) runs: "actor", an actor in the run's placement
    # group; "driver", the `train` process itself (a private local instance only); "auto": the driver on a private
    # local instance without a GPU or aggregators in the main process, else an actor (run/plan.py).
    algorithm_in: Literal["auto", "driver", "actor"] = "auto"

    @field_validator("rollout_fragment_length")
    @classmethod
    def _positive_fragment(cls, value: Union[int, str]) -> Union[int, str]:
        if isinstance(value, int) and value <= 0:
            raise ValueError("must be a positive integer or 'auto'")
        return value


class HardwareSection(Section):
    driver_cpus: float = Field(1, ge=0, allow_inf_nan=False)
    cpus_per_env_runner: float = Field(1, ge=0, allow_inf_nan=False)
    gpus_per_env_runner: float = Field(0, ge=0, allow_inf_nan=False)
    cpus_per_learner: float = Field(1, ge=0, allow_inf_nan=False)
    gpus_per_learner: float = Field(0, ge=0, allow_inf_nan=False)

    @field_validator("*")
    @classmethod
    def _ray_can_count_it(cls, value: float) -> float:
        if 0 < value < MIN_RESOURCE:
            raise ValueError(f"must be 0 or at least {MIN_RESOURCE} (Ray counts CPUs and GPUs in steps of {MIN_RESOURCE})")
        return value


class StopSection(Section):
    return_mean: Optional[float] = Field(None, allow_inf_nan=False)
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


class MlflowSection(Section):
    uri: str = Field(min_length=1)  # the tracking server (http://host:5000) or a local store (file:/path, sqlite:///db)
    experiment: Optional[str] = Field(None, min_length=1)  # default: the experiment's `name`


class WandbSection(Section):
    project: str = Field(min_length=1)
    mode: Literal["online", "offline"] = "online"  # offline: run files under the run directory, `wandb sync` later
    entity: Optional[str] = Field(None, min_length=1)


class TrackingSection(Section):
    """Where the driver also sends the run's metrics, HParams and artefacts (besides TensorBoard)."""

    mlflow: Optional[MlflowSection] = None
    wandb: Optional[WandbSection] = None


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
        if isinstance(value, list) and all(isinstance(name, str) for name in value):
            return {name: {} for name in value}
        return value

    @model_validator(mode="after")
    def _consistent(self) -> "MultiAgentSection":
        if not self.policies:
            raise ValueError("needs at least one policy")
        for pattern, policy in self.mapping.items():
            if policy not in self.policies:
                raise ValueError(f"mapping {pattern!r} -> {policy!r}: no such policy{did_you_mean(policy, self.policies)}")
        for policy in self.train or []:
            if policy not in self.policies:
                raise ValueError(f"train: no such policy {policy!r}{did_you_mean(policy, self.policies)}")
        return self


EXTERNAL_ENV = "external"
EXTERNAL_ALGORITHMS = ("PPO", "APPO", "IMPALA")


class SpaceSpec(Section):
    """An observation or action space in export.json's form: {type: Box, shape, low, high[, dtype]} or {type: Discrete, n}."""

    type: Literal["Box", "Discrete"]
    shape: Optional[list[int]] = None
    low: Optional[Union[float, list[Any]]] = None
    high: Optional[Union[float, list[Any]]] = None
    dtype: Optional[Literal["float32", "float64"]] = None  # a Box's; float32 when not given
    n: Optional[int] = Field(None, ge=1)

    @model_validator(mode="after")
    def _complete(self) -> "SpaceSpec":
        if self.type == "Discrete" and self.n is None:
            raise ValueError("a Discrete space needs n")
        if self.type == "Box" and (not self.shape or any(d < 1 for d in self.shape) or self.low is None or self.high is None):
            raise ValueError("a Box space needs shape (positive sizes), low and high (a number or nested lists)")
        if self.type == "Box":
            for name in ("low", "high"):
                _check_bound(name, getattr(self, name), self.shape or [])
        return self


def _check_bound(name: str, value: Any, shape: list[int]) -> None:
    """A Box bound gymnasium can take: a number, or nested lists of numbers that broadcast to the shape."""
    import numpy as np

    try:
        np.broadcast_to(np.asarray(value, dtype=np.float64), shape)
    except (ValueError, TypeError, OverflowError):
        raise ValueError(f"a Box space's {name} must be a number or nested lists of numbers that fit its shape "
                         f"{shape}") from None


class ExternalSection(Section):
    """`env: external`: simulators outside Ray connect to the run's env runners over the client protocol (docs/external.md)."""

    observation_space: SpaceSpec
    action_space: SpaceSpec
    host: str = "127.0.0.1"
    # The first runner's port; runner i listens on port + i - 1. 0: free ports chosen when the run starts.
    port: int = Field(0, ge=0, le=65535)
    # A file holding the token clients must send; required when `host` is not a loopback address.
    token_file: Optional[str] = None
    # Set by the run when it starts (from `port`, or free ports where it is 0), kept by a resume: runner i's port.
    ports: Optional[list[int]] = None
    # Seconds PPO waits for the simulators' samples before it goes on with the ones that came (RLlib's sample_timeout_s).
    sample_timeout_s: float = Field(30.0, gt=0)


class DataSection(Section):
    """What an offline algorithm learns from: Parquet files or directories of them (read by Ray Data, recursively)."""

    # Episodes in RLlib's offline format (`rlplatform record`, RLlib's recording runner); with `columns`, a table
    # of transitions, one row per env step. Relative paths are taken from the directory `train` runs in. With
    # `minari`, set by the run: where it converted the dataset to.
    paths: Optional[list[str]] = Field(None, min_length=1)
    # A Minari dataset: the id of a local one ($MINARI_DATASETS_PATH, ~/.minari/datasets) or its directory.
    minari: Optional[str] = Field(None, min_length=1)
    # A table not written by RLlib: RLlib's column name -> the table's (RLlib's `input_read_schema`), e.g.
    # {obs: observation, actions: action, new_obs: next_observation}; the columns not named keep RLlib's names.
    columns: Optional[dict[str, str]] = None
    # Episodes per read batch of Ray Data (episode data only). RLlib's PreLearner turns each read batch into one train
    # batch, sampled from the episodes it has read so far. BC and CQL keep every train batch of a pass over the files
    # in memory and cycle through them; MARWIL and IQL start the pipeline again after each pass (6-12 s on 2 cores).
    # null: set by the run to about one train batch of env steps per read, so that a pass is one epoch of the data.
    read_batch_size: Optional[int] = Field(None, ge=1)
    # Train batches each learner updates on per iteration (RLlib's dataset_num_iters_per_learner): more makes the
    # evaluation, metrics and checkpoint of each iteration a smaller share of the run.
    updates_per_iteration: int = Field(1, ge=1)

    @model_validator(mode="after")
    def _a_source(self) -> "DataSection":
        if self.paths is None and self.minari is None:
            raise ValueError("give paths (Parquet files or directories) or minari (a Minari dataset)")
        if self.minari is not None and self.columns is not None:
            raise ValueError("columns maps a table's columns; a Minari dataset has its own")
        return self

    @field_validator("columns")
    @classmethod
    def _known_columns(cls, value: Optional[dict[str, str]]) -> Optional[dict[str, str]]:
        for name in value or {}:
            if name not in TRANSITION_COLUMNS:
                raise ValueError(f"{name!r} is not one of RLlib's columns{did_you_mean(name, TRANSITION_COLUMNS)}; "
                                 f"known: {', '.join(TRANSITION_COLUMNS)}")
        return value


class RecordSection(Section):
    """Every episode the run's env runners sample for training, written as it finishes (adapter/recording.py): Parquet
    in RLlib's offline format, which `data.paths` and RLlib's offline algorithms read. Evaluation is not recorded."""

    # A directory; relative paths are taken from the directory `train` runs in; null: `episodes/` in the run
    # directory. On a cluster, a directory every node mounts at the same path (each runner writes its own files).
    path: Optional[str] = Field(None, min_length=1)
    # A runner writes a file when it holds this many finished episodes, or flush_s after its last file, and when the
    # run saves a checkpoint or stops. What a runner holds is lost if its process dies.
    episodes_per_file: int = Field(100, ge=1, le=1_000_000)
    flush_s: float = Field(60.0, gt=0, le=86_400)


# RLlib's names for a table of transitions (`offline_prelearner.SCHEMA`): which of them a table must hold.
TRANSITION_COLUMNS = ("obs", "actions", "rewards", "new_obs", "terminateds", "truncateds", "eps_id", "t", "infos")
REQUIRED_TRANSITION_COLUMNS = ("obs", "actions", "rewards", "new_obs", "terminateds")


class ExperimentConfig(Section):
    version: Literal[1] = SCHEMA_VERSION
    name: str = Field("experiment", pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    algorithm: str = "PPO"
    env: str = "CartPole-v1"
    env_config: dict[str, Any] = Field(default_factory=dict)
    profile: str = DEFAULT_PROFILE
    seed: Optional[int] = Field(0, ge=0, lt=2**32)  # what numpy takes
    training: dict[str, Any] = Field(default_factory=dict)
    model: ModelSection = Field(default_factory=ModelSection)
    scale: ScaleSection = Field(default_factory=ScaleSection)
    hardware: HardwareSection = Field(default_factory=HardwareSection)
    stop: StopSection = Field(default_factory=StopSection)
    checkpoint: CheckpointSection = Field(default_factory=CheckpointSection)
    evaluation: EvaluationSection = Field(default_factory=EvaluationSection)
    tracking: TrackingSection = Field(default_factory=TrackingSection)
    multi_agent: Optional[MultiAgentSection] = None
    external: Optional[ExternalSection] = None
    data: Optional[DataSection] = None  # BC, MARWIL, CQL, IQL: the recorded episodes they learn from
    record: Optional[RecordSection] = None  # the episodes the run samples, written as an offline dataset
    # A run directory (its best checkpoint that verifies) or a checkpoint: the policy starts from its weights
    # (adapter/init_weights.py), e.g. PPO from a BC run. The run keeps the checkpoint it took, as a path.
    init_from: Optional[str] = Field(None, min_length=1)
    rllib: dict[str, dict[str, Any]] = Field(default_factory=dict)
    # The speed-ups that reach into Ray's and RLlib's internals (rlplatform/internals, docs/internals.md);
    # false: the run is plain RLlib. On a Ray release they were not verified on they switch themselves off.
    speedups: bool = True
    # A training step that fails (a learner or the algorithm's actor lost, the env runners exhausted) rebuilds
    # the algorithm from the newest checkpoint that verifies, up to this many times (`train --max-failures`).
    max_failures: int = Field(0, ge=0)
    # What `rlplatform tune` searches (config/search.py); `train` runs the experiment as it is and ignores it.
    search: Optional[SearchSection] = None

    @model_validator(mode="before")
    @classmethod
    def _legacy_speedup_keys(cls, data: Any) -> Any:
        """Run configs written before `speedups` had `scale.sampler` and `scale.update` (lean | rllib)."""
        scale = data.get("scale") if isinstance(data, dict) else None
        if not isinstance(scale, dict) or not {"sampler", "update"} & set(scale):
            return data
        legacy = {key: scale[key] for key in ("sampler", "update") if key in scale}
        plain = "rllib" in legacy.values()
        data = {**data, "scale": {k: v for k, v in scale.items() if k not in legacy}}
        data.setdefault("speedups", not plain)
        return data

    @field_validator("training")
    @classmethod
    def _keyword_names(cls, value: dict[str, Any]) -> dict[str, Any]:
        _check_names(value, "a hyper-parameter name")
        return value

    @field_validator("rllib")
    @classmethod
    def _method_and_keyword_names(cls, value: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        _check_names(value, "a method name")
        for kwargs in value.values():
            _check_names(kwargs, "a keyword-argument name")
        return value

    @field_validator("env")
    @classmethod
    def _module_name(cls, value: str) -> str:
        """`[module:]id`: the module (imported to register the id) must be one Python can import by name."""
        module = value.rpartition(":")[0]
        if module and not all(part.isidentifier() for part in module.split(".")):
            raise ValueError(f"{module!r} is not a Python module name (the env is [module:]id, e.g. 'ale_py:ALE/Pong-v5')")
        return value

    @field_validator("algorithm")
    @classmethod
    def _known_algorithm(cls, value: str) -> str:
        upper = value.upper()
        if upper not in ALGORITHMS:
            raise ValueError(f"unknown algorithm {value!r}{did_you_mean(upper, ALGORITHMS)}; known: {', '.join(ALGORITHMS)}")
        return upper


def _check_names(mapping: dict[str, Any], what: str) -> None:
    """RLlib takes these keys as Python names (keyword arguments, methods): anything else is a typo or worse."""
    for name in mapping:
        if not name.isidentifier():
            raise ValueError(f"{_show(name)} is not {what}")


def validate(data: dict[str, Any], source: str = "config") -> ExperimentConfig:
    too_deep = _deeper_than(data, MAX_DEPTH)
    if too_deep is not None:  # as deep input from a file is refused when read: this config's config.yaml reads back
        raise UserError(f"{source}: {too_deep}: nested deeper than {MAX_DEPTH} levels")
    try:
        config = ExperimentConfig.model_validate(data)
    except ValidationError as exc:
        raise UserError(describe_validation_error(exc, data, source)) from None
    # Checked here, on what the user gives, not in the schema: `--profile auto` may size a big cluster past it.
    for key in ("env_runners", "learners", "aggregators_per_learner"):
        if getattr(config.scale, key) > MAX_ACTORS:
            raise UserError(f"{source}: scale.{key} = {_show(getattr(config.scale, key))}: at most {MAX_ACTORS:,}")
    _check_external(config, source)
    _check_offline(config, source)
    _check_record(config, source)
    _check_action_mask(config, source)
    if config.init_from is not None and config.multi_agent is not None:
        raise UserError(f"{source}: init_from starts one policy from a checkpoint's; it does not go with multi_agent")
    if config.scale.aggregators_per_learner and config.algorithm not in AGGREGATOR_ALGORITHMS:
        raise UserError(f"{source}: scale.aggregators_per_learner = {config.scale.aggregators_per_learner}: only "
                        f"{' and '.join(AGGREGATOR_ALGORITHMS)} use aggregator actors, not {config.algorithm} "
                        "(set it to 0)")
    return config


def is_loopback(host: str) -> bool:
    """An address only this machine can reach (`localhost`, 127.0.0.0/8, ::1): listening there needs no token."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: reachable from elsewhere as far as we can tell
        return False


def _check_external(config: ExperimentConfig, source: str) -> None:
    """`env: external` and the `external` section go together, with what the external runners support."""
    if (config.env == EXTERNAL_ENV) != (config.external is not None):
        raise UserError(f"{source}: env: external needs the `external` section (the spaces), and the section needs env: external")
    if config.external is None:
        return
    problems = [
        f"algorithm {config.algorithm} (external simulators train {', '.join(EXTERNAL_ALGORITHMS)})"
        if config.algorithm not in EXTERNAL_ALGORITHMS else None,
        "multi_agent" if config.multi_agent is not None else None,
        "model.use_lstm" if config.model.use_lstm else None,
        "evaluation.interval (there is no env to evaluate in)" if config.evaluation.interval else None,
        "scale.env_runners = 0 (each simulator connects to a remote runner)" if not config.scale.env_runners else None,
        "external.action_space: a Discrete or 1-D Box" if config.external.action_space.type == "Box"
        and len(config.external.action_space.shape or []) != 1 else None,
        "external.observation_space: a 1-D Box (the simulators act with an MLP)"
        if config.external.observation_space.type != "Box" or len(config.external.observation_space.shape or []) != 1 else None,
    ]
    problem = next((p for p in problems if p), None)
    if problem:
        raise UserError(f"{source}: env: external does not go with {problem}")
    host = config.external.host
    if not is_loopback(host) and not config.external.token_file:
        raise UserError(f"{source}: external.host {host} is reachable from other machines: give external.token_file")


def _check_offline(config: ExperimentConfig, source: str) -> None:
    """An offline algorithm learns from the `data` section, and only an offline algorithm has one."""
    offline = config.algorithm in OFFLINE_ALGORITHMS
    if offline != (config.data is not None):
        raise UserError(f"{source}: algorithm {config.algorithm} " + (
            "learns from recorded data: give the `data` section (data.paths: the Parquet files or directories)"
            if offline else f"learns from its env runners, not from a `data` section (offline: {', '.join(OFFLINE_ALGORITHMS)})"))
    if not offline:
        return
    problem = ("multi_agent" if config.multi_agent is not None else
               "env: external" if config.external is not None else
               "model.use_lstm" if config.model.use_lstm else
               "stop.return_mean without evaluation.interval (an offline run's return is its evaluation's)"
               if config.stop.return_mean is not None and not config.evaluation.interval else None)
    if problem:
        raise UserError(f"{source}: algorithm {config.algorithm} (offline) does not go with {problem}")
    if config.algorithm == "CQL" and config.data is not None and config.data.updates_per_iteration == 1 and not config.scale.learners:
        # RLlib 2.60's CQL training step hands a local learner one batch where the learner takes iterators (KeyError: 0).
        raise UserError(f"{source}: CQL with the learner in the main process needs data.updates_per_iteration of 2 or "
                        "more (RLlib 2.60's CQL fails on 1)")


def _check_record(config: ExperimentConfig, source: str) -> None:
    """Recording keeps a single-agent Gymnasium run's sampled episodes: RLlib's offline format has no other kind."""
    if config.record is None:
        return
    problem = ("an offline algorithm (it samples nothing)" if config.algorithm in OFFLINE_ALGORITHMS else
               "multi_agent (RLlib's offline format holds single-agent episodes)" if config.multi_agent is not None else
               "env: external" if config.external is not None else None)
    if problem:
        raise UserError(f"{source}: record does not go with {problem}")
    if config.record.path is not None and "://" in config.record.path:
        raise UserError(f"{source}: record.path {config.record.path[:200]}: a directory, not a URI (on a cluster, one "
                        "that every node mounts)")


def _check_action_mask(config: ExperimentConfig, source: str) -> None:
    """Masking is built into PPO's module (APPO's and IMPALA's too) for one feed-forward policy so far."""
    if config.model.action_mask is None:
        return
    problem = (f"{config.algorithm} (masking is built for {', '.join(MASKED_ALGORITHMS)})"
               if config.algorithm not in MASKED_ALGORITHMS else
               "model.use_lstm (not yet)" if config.model.use_lstm else
               "multi_agent (not yet)" if config.multi_agent is not None else
               "env: external" if config.external is not None else None)
    if problem:
        raise UserError(f"{source}: model.action_mask does not go with {problem}")


def _deeper_than(data: Any, limit: int) -> Optional[str]:
    """The top-level key under which `data` nests deeper than `limit` (counted as YAML nodes), or None."""
    stack = [(value, 2, str(key)) for key, value in data.items()] if isinstance(data, dict) else []
    while stack:
        node, depth, key = stack.pop()
        if depth > limit:
            return _show(key) if not key.isidentifier() else key
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
        stack.extend((child, depth + 1, key) for child in children)
    return None


def describe_validation_error(exc: ValidationError, data: dict[str, Any], source: str) -> str:
    err = exc.errors()[0]
    loc = [str(p) for p in err["loc"]]
    key = ".".join(loc)
    shown_key = ".".join(p if p and p.isprintable() and p.strip() == p else repr(p) for p in loc)  # one line
    if err["type"] == "extra_forbidden":
        section_model = _model_at(loc[:-1])
        known = list(section_model.model_fields) if section_model else []
        return f"{source}: unknown key {key!r}{did_you_mean(loc[-1], known)}"
    value = _value_at(data, loc)
    msg = err["msg"].removeprefix("Value error, ")
    shown = f" = {_show(value)}" if value is not _MISSING else ""
    return f"{source}: {shown_key}{shown}: {msg}"


def _show(value: Any, limit: int = 200) -> str:
    """repr, cut to one readable piece of a line."""
    try:
        text = repr(value)
    except ValueError:  # an integer too long for Python to print
        text = f"<an integer of {value.bit_length()} bits>"
    return text if len(text) <= limit else text[:limit] + "..."


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

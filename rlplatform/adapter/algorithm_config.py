"""Our ExperimentConfig -> RLlib's AlgorithmConfig: the only place that builds one.

Any RLlib option still passes through the experiment's `rllib:` section (method -> keyword
arguments), checked against the setters' signatures. The speed-ups (`rlplatform.internals`) are
plugged in here, by `internals.enabled(config.speedups)`, and nowhere else.
"""

from __future__ import annotations

import fnmatch
import functools
import importlib
import inspect
import logging
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

from rlplatform import internals
from rlplatform.config.env_ids import runner_env_id
from rlplatform.config.schema import ASYNCHRONOUS_ALGORITHMS, MAX_ACTORS, ExperimentConfig, ModelSection
from rlplatform.errors import UserError, did_you_mean

if TYPE_CHECKING:
    from ray.rllib.algorithms.algorithm_config import AlgorithmConfig
    from ray.rllib.core.rl_module.default_model_config import DefaultModelConfig

_CONFIG_CLASSES = {
    "PPO": ("ray.rllib.algorithms.ppo", "PPOConfig"),
    "APPO": ("ray.rllib.algorithms.appo", "APPOConfig"),
    "IMPALA": ("ray.rllib.algorithms.impala", "IMPALAConfig"),
    "DQN": ("ray.rllib.algorithms.dqn", "DQNConfig"),
    "SAC": ("ray.rllib.algorithms.sac", "SACConfig"),
    "TQC": ("ray.rllib.algorithms.tqc", "TQCConfig"),
    "DREAMERV3": ("ray.rllib.algorithms.dreamerv3", "DreamerV3Config"),
    "BC": ("ray.rllib.algorithms.bc", "BCConfig"),
    "MARWIL": ("ray.rllib.algorithms.marwil", "MARWILConfig"),
    "CQL": ("ray.rllib.algorithms.cql", "CQLConfig"),
    "IQL": ("ray.rllib.algorithms.iql", "IQLConfig"),
}
# Friendly spellings of RLlib's training kwargs.
_TRAINING_ALIASES = {"lambda": "lambda_", "batch_size": "train_batch_size_per_learner"}
# Training keys of ours, not RLlib's: the algorithms that take each and its values (the first is the default). They
# reach the learner through RLlib's `learner_config_dict`.
# critic_loss: SAC's critic loss on the TD error; RLlib's SAC learner hard-codes a Huber loss (delta 1), SB3 and the
# SAC paper use 0.5 x squared error, whose gradient is not capped at 1 while the Q values are still far off.
OWN_TRAINING_KEYS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {"critic_loss": (("SAC",), ("huber", "mse"))}
_PLACEMENT = {"pack": "PACK", "spread": "SPREAD", "strict_pack": "STRICT_PACK", "strict_spread": "STRICT_SPREAD"}
EPISODE_RETURNS = "rlp_episode_returns"
EPISODE_LENGTHS = "rlp_episode_lengths"
ILLEGAL_ACTIONS = "rlp_illegal_actions"  # model.action_mask: actions the mask forbade, summed per iteration


def config_class(algorithm: str) -> type[AlgorithmConfig]:
    module_name, class_name = _CONFIG_CLASSES[algorithm]
    cls = getattr(importlib.import_module(module_name), class_name)
    quiet_rllib_logs()  # after the import: RLlib sets its loggers' levels when it loads
    return cls


def _method_parameters(cls: type, method: str) -> set[str]:
    """Keyword names a config setter takes, following `**kwargs` up the class hierarchy."""
    names: set[str] = set()
    for klass in cls.__mro__:
        fn = klass.__dict__.get(method)
        if fn is None:
            continue
        params = inspect.signature(fn).parameters.values()
        names.update(p.name for p in params if p.kind is p.KEYWORD_ONLY)
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            break
    return names


def training_parameters(algorithm: str) -> set[str]:
    return _method_parameters(config_class(algorithm), "training")


_TYPE_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


@functools.lru_cache(maxsize=None)
def _training_defaults(algorithm: str) -> dict[str, tuple[Optional[type], bool]]:
    """RLlib training key -> (the type its default value has on the algorithm's config class, whether it also takes
    a list: a schedule, e.g. `lr`, `entropy_coeff`). Only int, float, bool and str defaults are typed;
    lists, mappings, None and keys without a declared type (deprecated ones) are left to RLlib."""
    cls = config_class(algorithm)
    defaults = cls()
    annotations: dict[str, Any] = {}
    for klass in cls.__mro__:
        fn = klass.__dict__.get("training")
        if fn is not None:
            for p in inspect.signature(fn).parameters.values():
                if p.kind is p.KEYWORD_ONLY:
                    annotations.setdefault(p.name, p.annotation)
    typed: dict[str, tuple[Optional[type], bool]] = {}
    for name, annotation in annotations.items():
        try:
            default = getattr(defaults, name, None)
        except Exception:  # a property that refuses to be read unset (DreamerV3's train_batch_size_per_learner)
            continue
        if annotation is inspect.Parameter.empty or type(default) not in _TYPE_NAMES:
            continue
        text = str(annotation)
        kind = float if type(default) is int and "float" in text and "List" not in text else type(default)
        # a schedule ([[step, value], ...]) where the annotation says so or RLlib has a `<key>_schedule` sibling
        # (PPO's entropy_coeff is annotated float, yet its learner takes a schedule)
        typed[name] = (kind, "List" in text or f"{name}_schedule" in annotations)
    return typed


def training_type_problem(algorithm: str, key: str, value: Any) -> Optional[str]:
    """What is wrong with `value`'s type for RLlib training key `key`, or None. int where RLlib's default is an int,
    a number (int or float) where it is a float, true/false where it is a bool; None is RLlib's own to judge."""
    kind, takes_list = _training_defaults(algorithm).get(key, (None, False))
    if kind is None or value is None or (takes_list and isinstance(value, list)):
        return None
    if kind is bool:
        ok = isinstance(value, bool)
    elif kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    else:
        ok = isinstance(value, kind)
    if ok:
        return None
    default = getattr(config_class(algorithm)(), key)
    also = " (or a schedule: a list of [step, value] pairs)" if takes_list else ""
    return (f"{algorithm} takes {_TYPE_NAMES[kind]}{also} here, not {type(value).__name__} "
            f"(RLlib's default: {default!r})")


def _short_repr(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


_CONNECTOR_KEYS = ("env_to_module_connector", "module_to_env_connector")


# How long APPO/IMPALA's `training_step` waits for a runner's sample before it goes round again. RLlib's
# default, 0, makes the algorithm's process poll `ray.wait` in a loop between samples: `bench ingest` measured
# it at 8-49 us per env step, most of it that loop, and on 2 cores it took the runner's and learner's CPU
# (APPO, episodes of 10, local learner: 13.6k env steps/s at 0, 23.8k at 0.01 s, 24.2k at 0.05 s). A sample
# that arrives wakes the wait at once when it is the only one in flight; else it waits at most this long.
SAMPLER_WAIT_S = 0.02


def _custom_connectors(config: ExperimentConfig) -> bool:
    """The experiment adds env-runner connectors of its own (through `rllib.env_runners`), which may hold state.

    Without them every env-runner connector is RLlib's default or our frame stacking, none of which has
    state to merge: RLlib's merge of the runners' connector states after every iteration (one blocking
    request to every runner) is then skipped (`merge_env_runner_states=False`), which took 40 ms of a
    2.3 s iteration with 32 runners (docs/scale.md). The broadcast of the lifetime step count stays.
    """
    return any(config.rllib.get("env_runners", {}).get(key) is not None for key in _CONNECTOR_KEYS)


def _training_kwargs(config: ExperimentConfig) -> dict[str, Any]:
    """The training section as RLlib's `training()` keyword arguments (our own keys left out)."""
    return {_TRAINING_ALIASES.get(k, k): v for k, v in config.training.items() if k not in OWN_TRAINING_KEYS}


def without_own_training_keys(config: ExperimentConfig) -> ExperimentConfig:
    """The experiment with RLlib's defaults for our own training keys (what RLlib's own learner can run)."""
    return config.model_copy(update={"training": {k: v for k, v in config.training.items() if k not in OWN_TRAINING_KEYS}})


def _own_training_settings(config: ExperimentConfig) -> dict[str, Any]:
    """Our own training keys that the experiment gives, for the learner (RLlib's `learner_config_dict`)."""
    return {k: v for k, v in config.training.items() if k in OWN_TRAINING_KEYS}


def _check_own_training_keys(config: ExperimentConfig) -> None:
    for key, value in _own_training_settings(config).items():
        algorithms, values = OWN_TRAINING_KEYS[key]
        if config.algorithm not in algorithms:
            raise UserError(f"training.{key}: not a {config.algorithm} hyper-parameter (only {', '.join(algorithms)})")
        if value not in values:
            raise UserError(f"training.{key} = {_short_repr(value)}: one of {', '.join(values)}")
        if value != values[0] and not internals.own_losses_apply(config):
            raise UserError(f"training.{key} = {value}: RLlib's own {config.algorithm} learner has only "
                            f"{values[0]}; {value} needs the speed-ups' learner (speedups: true, one policy, "
                            f"no LSTM, a whole n_step, a Box action); or set training.{key}={values[0]}")


def total_train_batch(config: ExperimentConfig) -> Optional[int]:
    """RLlib's total train batch (all learners) for this experiment; None when RLlib refuses the training section."""
    try:
        algo = config_class(config.algorithm)().training(**_training_kwargs(config)).learners(
            num_learners=config.scale.learners)
        return int(algo.total_train_batch_size)
    except Exception:  # the plan's check reports the refusal itself
        return None


def check(config: ExperimentConfig) -> Optional[str]:
    """Validate what only RLlib can tell (hyper-parameter names, pass-through options, env id).

    Returns the env id to hand to env runners (None for `env: external`). Raises UserError; starts no Ray.
    """
    cls = config_class(config.algorithm)
    known = training_parameters(config.algorithm)
    if (config.algorithm in ASYNCHRONOUS_ALGORITHMS and config.scale.rollout_fragment_length == "auto"
            and config.training.get("minibatch_size") is not None):
        # RLlib's check (minibatch_size % rollout_fragment_length) fails on "auto" with a TypeError.
        raise UserError(f"training.minibatch_size: {config.algorithm} cuts minibatches from whole fragments; give "
                        "scale.rollout_fragment_length a number that divides it (RLlib's default for "
                        f"{config.algorithm} is 50), not auto")
    _check_own_training_keys(config)
    for key, value in _training_kwargs(config).items():
        if key not in known:
            raise UserError(f"training.{key}: not a {config.algorithm} hyper-parameter{did_you_mean(key, known)}")
        problem = training_type_problem(config.algorithm, key, value)
        if problem:
            name = next((k for k, v in _TRAINING_ALIASES.items() if v == key), key)
            raise UserError(f"training.{name} = {_short_repr(value)}: {problem}")
    for method, kwargs in config.rllib.items():
        if method.startswith("_") or not callable(getattr(cls, method, None)):
            setters = [m for m in dir(cls) if not m.startswith("_")]
            raise UserError(f"rllib.{method}: AlgorithmConfig has no method {method!r}{did_you_mean(method, setters)}")
        if not isinstance(kwargs, dict):
            raise UserError(f"rllib.{method}: must be a mapping of keyword arguments, not {type(kwargs).__name__}")
        accepted = _method_parameters(cls, method)
        for key in kwargs:
            if key not in accepted:
                raise UserError(f"rllib.{method}.{key}: not an argument of {method}(){did_you_mean(key, accepted)}")
    _check_samples_per_learner(config)
    _check_learner_bundles(config)
    if config.external is not None:
        return None
    env_id = runner_env_id(config.env)
    if is_multi_agent_env(config.env) and config.multi_agent is None:
        raise UserError(f"env {config.env!r} is multi-agent: add a multi_agent section (policies, mapping)")
    if config.model.action_mask is not None:
        from rlplatform.adapter.action_mask import check_spaces

        check_spaces(*env_spaces(config), config.model.action_mask)
    return env_id


def check_data(config: ExperimentConfig) -> None:
    """An offline run's data, against its env's spaces (before a run starts; `evaluate` or `export` of the run's
    checkpoints need no data). Raises UserError."""
    from rlplatform.adapter.offline_data import check_dataset

    if config.data is not None and config.data.paths is not None:  # (a Minari dataset's: once the plan converted it)
        check_dataset(config.data.paths, config.data.columns, env_spaces(config), config.algorithm)


def env_spaces(config: ExperimentConfig) -> tuple[Any, Any]:
    """The experiment's env's (observation space, action space), from one env built here."""
    from rlplatform.config.env_ids import make_env

    try:
        env = make_env(config.env, **dict(config.env_config))
    except Exception as exc:  # an env_config its constructor refuses, a missing dependency, ...
        raise UserError(f"env {config.env!r} could not be built here to read its spaces: {type(exc).__name__}: "
                        f"{_first_line(exc)}") from None
    try:
        return env.observation_space, env.action_space
    finally:
        env.close()


def _check_samples_per_learner(config: ExperimentConfig) -> None:
    """APPO/IMPALA without aggregators hand each learner whole runner samples (RLlib shards the list of sample
    references): an update with fewer samples than learners leaves a learner none, and RLlib fails with an
    IndexError mid-run. Refused here, with the sizes, before Ray starts."""
    learners = config.scale.learners
    if config.algorithm not in ASYNCHRONOUS_ALGORITHMS or learners < 2 or config.scale.aggregators_per_learner:
        return
    try:
        algo = (config_class(config.algorithm)().training(**_training_kwargs(config)).learners(num_learners=learners)
                .env_runners(num_envs_per_env_runner=config.scale.envs_per_runner,
                             rollout_fragment_length=config.scale.rollout_fragment_length))
        total, sample = int(algo.total_train_batch_size), config.scale.envs_per_runner * int(algo.get_rollout_fragment_length())
    except Exception:  # RLlib's own refusal is reported by the full build
        return
    if total > 0 and sample > 0 and -(-total // sample) < learners:  # (a batch of 0: RLlib's own check refuses it)
        raise UserError(
            f"{config.algorithm} with {learners} learners and no aggregators gives each learner whole runner samples of "
            f"{sample:,} env steps ({config.scale.envs_per_runner} envs x {sample // config.scale.envs_per_runner} steps): "
            f"a train batch of {total:,} takes {-(-total // sample)} sample(s); raise training.train_batch_size_per_learner to at "
            f"least {sample:,}, shorten scale.rollout_fragment_length, or set scale.aggregators_per_learner")


def _check_learner_bundles(config: ExperimentConfig) -> None:
    """RLlib asks for one bundle per learner, of the learner's CPUs plus 1 per aggregator, and Ray places learners, then
    aggregators, in any bundle with room. Where a bundle has room for two CPU learners (cpus_per_learner <= aggregators
    per learner) and a learner's share is fractional, two learners in one bundle leave fractions that no aggregator
    (1 CPU) fits: the run hangs in its start-up (seen with 2 learners of 0.25 CPU and 1 aggregator each)."""
    scale, hardware = config.scale, config.hardware
    cpus = hardware.cpus_per_learner
    if (scale.learners >= 2 and scale.aggregators_per_learner and not hardware.gpus_per_learner
            and cpus <= scale.aggregators_per_learner and not float(cpus).is_integer()):
        raise UserError(
            f"hardware.cpus_per_learner = {cpus:g} with {scale.learners} CPU learners and "
            f"{scale.aggregators_per_learner} aggregator(s) per learner: a learner's bundle ({cpus:g} + "
            f"{scale.aggregators_per_learner} CPUs) has room for two learners, and the fractions they leave fit no "
            f"aggregator (RLlib places neither by bundle, the run would hang); give each learner a whole number of CPUs "
            f"or more than {scale.aggregators_per_learner}")


def is_multi_agent_env(env: str) -> bool:
    from rlplatform_envs import MULTI_AGENT

    return env.rpartition(":")[2] in MULTI_AGENT


class PolicyMapping:
    """RLlib's policy_mapping_fn from our `multi_agent.mapping`: the first matching agent-id pattern wins."""

    def __init__(self, mapping: dict[str, str]):
        self.mapping = dict(mapping)

    def __call__(self, agent_id: Any, episode: Any = None, **_: Any) -> str:
        for pattern, policy in self.mapping.items():
            if fnmatch.fnmatchcase(str(agent_id), pattern):
                return policy
        raise ValueError(f"agent {agent_id!r} matches no pattern of multi_agent.mapping {list(self.mapping)}")


def _multi_agent(algo_config, config: ExperimentConfig) -> None:
    from ray.rllib.core.rl_module.multi_rl_module import MultiRLModuleSpec
    from ray.rllib.core.rl_module.rl_module import RLModuleSpec

    ma = config.multi_agent
    assert ma is not None  # the caller checks
    algo_config.multi_agent(
        policies=set(ma.policies),
        policy_mapping_fn=PolicyMapping(ma.mapping),
        policies_to_train=list(ma.train) if ma.train is not None else None,
    )
    specs = {name: RLModuleSpec(model_config=model_config(config, policy.model),
                                catalog_class=_sac_catalog(config.algorithm, policy.model or config.model))
             for name, policy in ma.policies.items()}
    algo_config.rl_module(rl_module_spec=MultiRLModuleSpec(rl_module_specs=specs))


def _external(algo_config: AlgorithmConfig, config: ExperimentConfig) -> None:
    """Env runners that listen for simulators outside Ray (adapter/external_runner.py, docs/external.md)."""
    import secrets

    from rlplatform.adapter.external_runner import SETTINGS_KEY, ExternalEnvRunner, space_from_spec

    ext = config.external
    assert ext is not None
    obs_space, act_space = space_from_spec(ext.observation_space.model_dump()), space_from_spec(ext.action_space.model_dump())
    algo_config.environment(env=None, observation_space=obs_space, action_space=act_space)
    algo_config.env_runners(env_runner_cls=ExternalEnvRunner, num_envs_per_env_runner=1, sample_timeout_s=ext.sample_timeout_s,
                            use_env_runner_state_server=False)  # weights pushed to the runners, which pass them on
    model = algo_config.model_config
    discrete = ext.action_space.type == "Discrete"
    client_config = {
        "algorithm": config.algorithm, "observation_space": ext.observation_space.model_dump(exclude_none=True),
        "action_space": ext.action_space.model_dump(exclude_none=True),
        "policy": {"action_kind": "categorical" if discrete else "gaussian",
                   "action_dim": ext.action_space.n if discrete else (ext.action_space.shape or [1])[0],
                   "activation": model.get("fcnet_activation"), "head_activation": model.get("head_fcnet_activation")},
        "fragment": int(algo_config.get_rollout_fragment_length()),
    }
    algo_config.environment(env_config={SETTINGS_KEY: {
        "host": ext.host, "ports": list(ext.ports or []), "token_file": ext.token_file,
        "on_policy": config.algorithm == "PPO", "client_config": client_config, "stop_key": secrets.token_hex(16)}})


def _offline(algo_config: AlgorithmConfig, config: ExperimentConfig) -> None:
    """An offline algorithm reads `data` through RLlib's OfflineData (Ray Data): episodes in RLlib's format, or a
    table of transitions through RLlib's `input_read_schema`. Its env only evaluates, in the main process."""
    from rlplatform.adapter.offline_data import resolved_paths

    data = config.data
    assert data is not None
    observation_space, action_space = env_spaces(config)
    algo_config.environment(observation_space=observation_space, action_space=action_space)
    algo_config.env_runners(num_env_runners=0, env_runner_cls=None)
    algo_config.offline_data(
        input_=resolved_paths(data.paths or []),
        input_read_episodes=data.columns is None,
        input_read_schema=dict(data.columns or {}),
        # Counted in episodes; a table is read row by row in train batches (RLlib refuses a read batch size there).
        **({"input_read_batch_size": data.read_batch_size or 1} if data.columns is None else {}),
        input_read_method_kwargs={"num_cpus": 0},  # Ray Data's read tasks, outside the placement group too
        # Ray Data's PreLearner actors turn episodes into train batches outside the run's placement group, and
        # RLlib asks 2 of a CPU each: on a small machine whose CPUs the run holds they would never start.
        map_batches_kwargs={"concurrency": max(1, config.scale.learners), "num_cpus": 0},
        dataset_num_iters_per_learner=data.updates_per_iteration,
    )
    algo_config.evaluation(evaluation_num_env_runners=0)
    # One training step per iteration, so an iteration is `updates_per_iteration` updates (CQL, from SAC, would
    # repeat its step for at least a second).
    algo_config.reporting(min_time_s_per_iteration=None, min_sample_timesteps_per_iteration=0,
                          min_train_timesteps_per_iteration=0)
    if config.algorithm == "CQL" and "lr" not in config.training:
        # RLlib 2.60's CQLConfig sets lr (3e-4) and its SAC checks refuse any: the actor, critic and alpha have their own.
        algo_config.training(lr=None)


def _record(algo_config: AlgorithmConfig, config: ExperimentConfig) -> None:
    """The training runners write every episode they sample (adapter/recording.py)."""
    from rlplatform.adapter import recording

    record = config.record
    assert record is not None and record.path is not None  # made absolute by the run's plan
    _add_sample_end_callback(algo_config, recording.callback(
        recording.RecordSettings(record.path, record.episodes_per_file, record.flush_s)))


def _add_sample_end_callback(algo_config: AlgorithmConfig, function: Callable[..., None]) -> None:
    existing = algo_config.callbacks_on_sample_end
    earlier = list(existing) if isinstance(existing, (list, tuple)) else [existing] if existing else []
    algo_config.callbacks(on_sample_end=[*earlier, function])


def record_episode(*, episode: Any, metrics_logger: Any, prev_episode_chunks: Sequence[Any] = (),
                   chunk_return: Optional[Callable[[Any], float]] = None, **_: Any) -> None:
    """Every finished episode's return and length, so the driver can keep an exact 100-episode window.

    An episode longer than a rollout fragment arrives in chunks; the earlier ones come separately.
    `chunk_return` (bound by `episode_recorder`): a chunk's return, RLlib's `get_return` by default.
    """
    chunks = [*prev_episode_chunks, episode]
    returns = (chunk_return(c) if chunk_return else c.get_return() for c in chunks)
    metrics_logger.log_value(EPISODE_RETURNS, float(sum(returns)), reduce="item_series")
    metrics_logger.log_value(EPISODE_LENGTHS, int(sum(len(c) for c in chunks)), reduce="item_series")


def _sac_catalog(algorithm: str, model: ModelSection) -> Optional[type]:
    """SAC's catalog (adapter/sac_q_network.py): Q networks on [s, a] with `model.q_network: joint`, RLlib's two
    streams with `streams`, and tanh(mean) as the greedy action either way; None (RLlib's catalog) for the others."""
    if algorithm != "SAC":
        return None
    from rlplatform.adapter.sac_q_network import JointQSACCatalog, TanhGreedySACCatalog

    return JointQSACCatalog if model.q_network == "joint" else TanhGreedySACCatalog


def _module_catalog(config: ExperimentConfig) -> dict[str, Any]:
    from ray.rllib.core.rl_module.rl_module import RLModuleSpec

    if config.model.action_mask is not None:  # merged by RLlib into the experiment's model_config
        from rlplatform.adapter.action_mask import MASK_KEY, MASKED_MODULES

        return {"rl_module_spec": RLModuleSpec(module_class=MASKED_MODULES[config.algorithm],
                                               model_config={MASK_KEY: config.model.action_mask})}
    catalog = _sac_catalog(config.algorithm, config.model)
    return {"rl_module_spec": RLModuleSpec(catalog_class=catalog)} if catalog and config.multi_agent is None else {}


def model_config(config: ExperimentConfig, model: Optional[ModelSection] = None) -> DefaultModelConfig:
    from ray.rllib.core.rl_module.default_model_config import DefaultModelConfig

    m = model or config.model
    return DefaultModelConfig(
        fcnet_hiddens=list(m.hidden),
        fcnet_activation=m.activation,
        vf_share_layers=m.vf_share_layers,
        conv_filters=m.conv_filters,
        conv_activation=m.conv_activation,
        use_lstm=m.use_lstm,
        lstm_cell_size=m.lstm_cell_size,
        max_seq_len=m.max_seq_len,
        head_fcnet_hiddens=list(m.head_hidden),
        fusionnet_hiddens=list(m.fusion_hidden),
        fusionnet_activation=m.fusion_activation,
    )


def episode_recorder(speedups: bool) -> Callable[..., None]:
    """The `on_episode_end` callback; with the speed-ups, returns summed from the reward buffers' data."""
    if not speedups:
        return record_episode
    from rlplatform.internals.columnar_fragment import runs_at_fragment_end
    from rlplatform.internals.episode_stats import chunk_return

    # It only logs the return and length: the columnar env runner may call it when the fragment ends.
    return runs_at_fragment_end(functools.partial(record_episode, chunk_return=chunk_return))


def build_algorithm_config(config: ExperimentConfig, main_process_resources: Optional[dict[str, float]] = None,
                           recording: bool = False) -> AlgorithmConfig:
    """Map our schema onto RLlib's AlgorithmConfig (the only place that does). `recording`: the training run itself
    (not an evaluation or a measurement built from its config) writes the `record` section's episodes."""
    env_id = check(config)
    speedups = internals.enabled(config.speedups)
    if speedups:
        internals.install_in_process()  # before the algorithm that this config builds seeds torch and builds connectors
    scale, hw = config.scale, config.hardware
    algo_config = (
        config_class(config.algorithm)()
        .environment(env_id, env_config=dict(config.env_config))
        .env_runners(
            num_env_runners=scale.env_runners,
            num_envs_per_env_runner=scale.envs_per_runner,
            gym_env_vectorize_mode=scale.vectorize,
            rollout_fragment_length=_fragment_length(config),
            num_cpus_per_env_runner=hw.cpus_per_env_runner,
            num_gpus_per_env_runner=hw.gpus_per_env_runner,
            env_runner_cls=internals.env_runner_class(config) if speedups else None,
        )
        .learners(
            num_learners=scale.learners,
            num_cpus_per_learner=hw.cpus_per_learner,
            num_gpus_per_learner=hw.gpus_per_learner,
            **_aggregators(config),
            **_learner_class(config, speedups),
            learner_config_dict=_own_training_settings(config),
        )
        .resources(
            num_cpus_for_main_process=hw.driver_cpus,
            placement_strategy=_PLACEMENT[scale.placement],
            custom_resources_for_main_process=dict(main_process_resources or {}),
        )
        .rl_module(model_config=model_config(config), **_module_catalog(config))
        .callbacks(on_episode_end=episode_recorder(speedups))
        .debugging(seed=config.seed, log_level="ERROR")
        # A crashed runner is restarted at once instead of after RLlib's default 60 s pause.
        .fault_tolerance(restart_failed_env_runners=True, delay_between_env_runner_restarts_s=1.0)
    )
    try:  # RLlib's setter checks some values itself (training.grad_clip_by=null raises a ValueError)
        algo_config.training(**_training_kwargs(config))
    except Exception as exc:
        raise UserError(f"RLlib rejected the configuration: {_first_line(exc)}") from None
    if config.multi_agent is not None:
        _multi_agent(algo_config, config)
    if config.external is not None:
        _external(algo_config, config)
    if config.data is not None:
        _offline(algo_config, config)
    if config.model.action_mask is not None:
        from rlplatform.adapter.action_mask import count_illegal

        _add_sample_end_callback(algo_config, count_illegal(config.model.action_mask))
    if recording and config.record is not None:
        _record(algo_config, config)
    if config.evaluation.interval:
        algo_config.evaluation(
            evaluation_interval=config.evaluation.interval,
            evaluation_duration=config.evaluation.episodes,
            evaluation_duration_unit="episodes",
            evaluation_config=config_class(config.algorithm).overrides(explore=False),
        )
    if speedups and not _custom_connectors(config):
        algo_config.env_runners(merge_env_runner_states=False)
    if speedups:  # Tune's utilization thread in the algorithm's process: the run's system panel reads the machine
        algo_config.debugging(log_sys_usage=False)
    if speedups and config.algorithm in ASYNCHRONOUS_ALGORITHMS and "timeout_s_sampler_manager" not in config.training:
        algo_config.training(timeout_s_sampler_manager=SAMPLER_WAIT_S)
    try:
        for method, kwargs in config.rllib.items():
            getattr(algo_config, method)(**kwargs)
        if speedups and internals.lean_off_policy_applies(config):
            internals.use_lean_off_policy(algo_config)
        if speedups:
            internals.use_lean_ppo_where_it_applies(config, algo_config)
        algo_config.validate()
    except Exception as exc:  # RLlib's setters and checks raise anything on a value of the wrong shape
        raise UserError(f"RLlib rejected the configuration: {_first_line(exc)}") from None
    for name, count in (("env_runners.num_env_runners", algo_config.num_env_runners),
                        ("learners.num_learners", algo_config.num_learners),
                        ("learners.num_aggregator_actors_per_learner", algo_config.num_aggregator_actors_per_learner)):
        if not isinstance(count, int) or count > MAX_ACTORS:  # the pass-through bypasses the schema's limit
            raise UserError(f"RLlib rejected the configuration: {name} = {str(count)[:40]}: at most {MAX_ACTORS:,}")
    return algo_config


def _fragment_length(config: ExperimentConfig) -> Any:
    """`scale.rollout_fragment_length`; "auto" is RLlib's batch / (runners x envs), except for DreamerV3, whose
    training step takes no "auto" (RLlib's default for it, 1: the world model learns from its replay buffer)."""
    length = config.scale.rollout_fragment_length
    return 1 if length == "auto" and config.algorithm == "DREAMERV3" else length


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return (text.splitlines()[0] if text else type(exc).__name__)[:300]


def _aggregators(config: ExperimentConfig) -> dict[str, Any]:
    """`scale.aggregators_per_learner` (APPO/IMPALA, the schema refuses it elsewhere); 0 leaves RLlib's default alone."""
    count = config.scale.aggregators_per_learner
    return {"num_aggregator_actors_per_learner": count} if count else {}


def _learner_class(config: ExperimentConfig, speedups: bool) -> dict[str, Any]:
    learner_class = internals.learner_class(config) if speedups else None
    return {"learner_class": learner_class} if learner_class else {}  # else RLlib's default learner


def resource_bundles(algo_config: AlgorithmConfig) -> list[dict[str, float]]:
    """The placement-group bundles RLlib asks for: [main process] + env runners + eval runners + learners.

    APPO/IMPALA's aggregator actors (1 CPU each, started by `Algorithm.setup` inside the group: the
    algorithm host captures its child actors) are in them already (ray 2.60, `algorithms/utils.py`
    `_get_learner_bundles`): one bundle of {CPU: 1} each when the learner is in the main process,
    else +1 CPU per aggregator in each learner's bundle. Nothing is added here: that would count them twice.
    """
    try:
        factory = algo_config.algo_class.default_resource_request(algo_config)
        return [{k: float(v) for k, v in bundle.items() if v} for bundle in factory.bundles]
    except Exception as exc:  # resources given through the `rllib:` pass-through, of a shape RLlib cannot use
        raise UserError(f"RLlib rejected the configuration's resources: {_first_line(exc)}") from None


# RLlib deprecation messages (logged by `ray._common.deprecation`) that were read and judged: RLlib's own
# code triggers them and nothing of ours can act on them. Every other deprecation still shows.
JUDGED_DEPRECATIONS = (
    # RLModule.__init__ itself builds an RLModuleConfig for old custom models (ray 2.60.0, rl_module.py).
    "`RLModule(config=[RLModuleConfig object])` has been deprecated",
)


class _JudgedDeprecations(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not any(text in record.getMessage() for text in JUDGED_DEPRECATIONS)


def quiet_rllib_logs() -> None:
    for name in ("ray.rllib", "ray.tune", "ray.train", "ray.util", "ray.data"):
        logging.getLogger(name).setLevel(logging.ERROR)
    deprecations = logging.getLogger("ray._common.deprecation")
    if not any(isinstance(f, _JudgedDeprecations) for f in deprecations.filters):
        deprecations.addFilter(_JudgedDeprecations())


def epochs_per_batch(config: ExperimentConfig) -> int:
    """How often a learner passes over each sampled batch (PPO's num_epochs; 1 for the others)."""
    return int(_training_kwargs(config).get("num_epochs", getattr(config_class(config.algorithm)(), "num_epochs", 1) or 1))



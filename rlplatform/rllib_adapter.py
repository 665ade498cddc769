"""The one place that knows RLlib: our ExperimentConfig -> RLlib's AlgorithmConfig, and back.

Everything else in the package talks to this module, so a Ray upgrade touches this file
(and the metric-name map in `metrics.py`) only.
"""

from __future__ import annotations

import fnmatch
import importlib
import inspect
import logging
from pathlib import Path
from typing import Any, Optional

from rlplatform.config import ExperimentConfig, ModelSection, _suggest
from rlplatform.env_ids import runner_env_id
from rlplatform.errors import UserError

_CONFIG_CLASSES = {
    "PPO": ("ray.rllib.algorithms.ppo", "PPOConfig"),
    "APPO": ("ray.rllib.algorithms.appo", "APPOConfig"),
    "IMPALA": ("ray.rllib.algorithms.impala", "IMPALAConfig"),
    "DQN": ("ray.rllib.algorithms.dqn", "DQNConfig"),
    "SAC": ("ray.rllib.algorithms.sac", "SACConfig"),
}
# Friendly spellings of RLlib's training kwargs.
_TRAINING_ALIASES = {"lambda": "lambda_", "batch_size": "train_batch_size_per_learner"}
_PLACEMENT = {"pack": "PACK", "spread": "SPREAD", "strict_pack": "STRICT_PACK", "strict_spread": "STRICT_SPREAD"}
EPISODE_RETURNS = "rlp_episode_returns"
EPISODE_LENGTHS = "rlp_episode_lengths"
LEAN_UPDATE_ALGORITHMS = ("PPO", "APPO", "IMPALA")
RL_MODULE_SUBDIR = Path("learner_group") / "learner" / "rl_module"


def config_class(algorithm: str):
    module_name, class_name = _CONFIG_CLASSES[algorithm]
    cls = getattr(importlib.import_module(module_name), class_name)
    quiet_rllib_logs()  # after the import: RLlib sets its loggers' levels when it loads
    return cls


def _method_parameters(cls, method: str) -> set[str]:
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


def _training_kwargs(config: ExperimentConfig) -> dict[str, Any]:
    return {_TRAINING_ALIASES.get(k, k): v for k, v in config.training.items()}


def check(config: ExperimentConfig) -> str:
    """Validate what only RLlib can tell (hyper-parameter names, pass-through options, env id).

    Returns the env id to hand to env runners. Raises UserError; starts no Ray.
    """
    cls = config_class(config.algorithm)
    known = training_parameters(config.algorithm)
    for key in _training_kwargs(config):
        if key not in known:
            raise UserError(f"training.{key}: not a {config.algorithm} hyper-parameter{_suggest(key, known)}")
    for method, kwargs in config.rllib.items():
        if method.startswith("_") or not callable(getattr(cls, method, None)):
            setters = [m for m in dir(cls) if not m.startswith("_")]
            raise UserError(f"rllib.{method}: AlgorithmConfig has no method {method!r}{_suggest(method, setters)}")
        if not isinstance(kwargs, dict):
            raise UserError(f"rllib.{method}: must be a mapping of keyword arguments, not {type(kwargs).__name__}")
        accepted = _method_parameters(cls, method)
        for key in kwargs:
            if key not in accepted:
                raise UserError(f"rllib.{method}.{key}: not an argument of {method}(){_suggest(key, accepted)}")
    env_id = runner_env_id(config.env)
    if is_multi_agent_env(config.env) and config.multi_agent is None:
        raise UserError(f"env {config.env!r} is multi-agent: add a multi_agent section (policies, mapping)")
    return env_id


def is_multi_agent_env(env: str) -> bool:
    from envs import MULTI_AGENT

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
    algo_config.multi_agent(
        policies=set(ma.policies),
        policy_mapping_fn=PolicyMapping(ma.mapping),
        policies_to_train=list(ma.train) if ma.train is not None else None,
    )
    specs = {name: RLModuleSpec(model_config=model_config(config, policy.model)) for name, policy in ma.policies.items()}
    algo_config.rl_module(rl_module_spec=MultiRLModuleSpec(rl_module_specs=specs))


def _record_episode(*, episode, metrics_logger, prev_episode_chunks=(), **_: Any) -> None:
    """Every finished episode's return and length, so the driver can keep an exact 100-episode window.

    An episode longer than a rollout fragment arrives in chunks; the earlier ones come separately.
    """
    chunks = [*prev_episode_chunks, episode]
    metrics_logger.log_value(EPISODE_RETURNS, float(sum(chunk_return(c) for c in chunks)), reduce="item_series")
    metrics_logger.log_value(EPISODE_LENGTHS, int(sum(len(c) for c in chunks)), reduce="item_series")


def chunk_return(chunk: Any) -> float:
    """`get_return()` of an episode chunk. For a SingleAgentEpisode that is the sum of the rewards after
    the lookback, taken here from the buffer's data: `get_rewards()` would index it through
    InfiniteLookbackBuffer's general slicing, 6 % of a 64-env runner's time on CartPole."""
    from ray.rllib.env.utils.infinite_lookback_buffer import InfiniteLookbackBuffer

    rewards = getattr(chunk, "rewards", None)
    if type(rewards) is not InfiniteLookbackBuffer:  # a multi-agent episode: its agents' returns
        return chunk.get_return()
    return sum(rewards.data[rewards.lookback:])


def model_config(config: ExperimentConfig, model: Optional[ModelSection] = None):
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
    )


def build_algorithm_config(config: ExperimentConfig, main_process_resources: Optional[dict[str, float]] = None):
    """Map our schema onto RLlib's AlgorithmConfig (the only place that does)."""
    from rlplatform import connector_frames, torch_seed

    env_id = check(config)
    torch_seed.install()  # before the algorithm that this config builds seeds torch
    connector_frames.install()  # before it builds its connector pipelines
    scale, hw = config.scale, config.hardware
    algo_config = (
        config_class(config.algorithm)()
        .environment(env_id, env_config=dict(config.env_config))
        .env_runners(
            num_env_runners=scale.env_runners,
            num_envs_per_env_runner=scale.envs_per_runner,
            gym_env_vectorize_mode=scale.vectorize,
            rollout_fragment_length=scale.rollout_fragment_length,
            num_cpus_per_env_runner=hw.cpus_per_env_runner,
            num_gpus_per_env_runner=hw.gpus_per_env_runner,
            env_runner_cls=_env_runner_class(config),
        )
        .learners(
            num_learners=scale.learners,
            num_cpus_per_learner=hw.cpus_per_learner,
            num_gpus_per_learner=hw.gpus_per_learner,
        )
        .resources(
            num_cpus_for_main_process=hw.driver_cpus,
            placement_strategy=_PLACEMENT[scale.placement],
            custom_resources_for_main_process=dict(main_process_resources or {}),
        )
        .training(**{**_learner_class(config), **_training_kwargs(config)})
        .rl_module(model_config=model_config(config))
        .callbacks(on_episode_end=_record_episode)
        .debugging(seed=config.seed, log_level="ERROR")
        # A crashed runner is restarted at once instead of after RLlib's default 60 s pause.
        .fault_tolerance(restart_failed_env_runners=True, delay_between_env_runner_restarts_s=1.0)
    )
    if config.multi_agent is not None:
        _multi_agent(algo_config, config)
    if config.evaluation.interval:
        algo_config.evaluation(
            evaluation_interval=config.evaluation.interval,
            evaluation_duration=config.evaluation.episodes,
            evaluation_duration_unit="episodes",
            evaluation_config=config_class(config.algorithm).overrides(explore=False),
        )
    for method, kwargs in config.rllib.items():
        getattr(algo_config, method)(**kwargs)
    try:
        algo_config.validate()
    except (ValueError, TypeError) as exc:
        raise UserError(f"RLlib rejected the configuration: {str(exc).strip().splitlines()[0]}") from None
    return algo_config


def _env_runner_class(config: ExperimentConfig):
    if config.multi_agent is not None or config.scale.sampler == "rllib":
        return None  # RLlib's default for the env
    from rlplatform.lean_env_runner import LeanEnvRunner

    return LeanEnvRunner


def _learner_class(config: ExperimentConfig) -> dict[str, Any]:
    if config.scale.update == "rllib" or config.algorithm not in LEAN_UPDATE_ALGORITHMS:
        return {}  # RLlib's default learner for the algorithm
    from rlplatform.lean_learner import LEAN_LEARNERS

    return {"learner_class": LEAN_LEARNERS[config.algorithm]}


def resource_bundles(algo_config) -> list[dict[str, float]]:
    """The placement-group bundles RLlib asks for: [main process] + env runners + eval runners + learners."""
    factory = algo_config.algo_class.default_resource_request(algo_config)
    return [{k: float(v) for k, v in bundle.items() if v} for bundle in factory.bundles]


def quiet_rllib_logs() -> None:
    for name in ("ray.rllib", "ray.tune", "ray.train", "ray.util", "ray.data", "ray._common.deprecation"):
        logging.getLogger(name).setLevel(logging.ERROR)


def epochs_per_batch(config: ExperimentConfig) -> int:
    """How often a learner passes over each sampled batch (PPO's num_epochs; 1 for the others)."""
    return int(_training_kwargs(config).get("num_epochs", getattr(config_class(config.algorithm)(), "num_epochs", 1) or 1))


def env_runner_node_ids(algo) -> list[str]:
    import ray

    group = algo.env_runner_group
    if group is None or group.num_remote_env_runners() == 0:
        return [ray.get_runtime_context().get_node_id()]
    return group.foreach_env_runner(_node_id, local_env_runner=False)


def _node_id(_runner) -> str:
    import ray

    return ray.get_runtime_context().get_node_id()


def remote_env_runners(config: ExperimentConfig, count: int, num_cpus: Optional[float] = None) -> list:
    """`count` real remote EnvRunner actors built from the experiment, as training builds them (no learner)."""
    import ray
    from ray.rllib.env.multi_agent_env_runner import MultiAgentEnvRunner
    from ray.rllib.env.single_agent_env_runner import SingleAgentEnvRunner

    algo_config = build_algorithm_config(config)
    runner_cls = algo_config.env_runner_cls or (MultiAgentEnvRunner if config.multi_agent is not None else SingleAgentEnvRunner)
    actor = ray.remote(num_cpus=config.hardware.cpus_per_env_runner if num_cpus is None else num_cpus)(runner_cls)
    return [actor.remote(config=algo_config, worker_index=i + 1, num_workers=count) for i in range(count)]


def sample_in_remote_env_runner(config: ExperimentConfig, num_timesteps: int = 50) -> dict[str, Any]:
    """Build the env inside a real remote EnvRunner actor (as training does) and sample random actions."""
    import ray

    (runner,) = remote_env_runners(config, 1, num_cpus=0)
    try:
        episodes = ray.get(runner.sample.remote(num_timesteps=num_timesteps, random_actions=True), timeout=120)
        node = ray.get(runner.apply.remote(_node_id), timeout=30)
    finally:
        ray.kill(runner)
    return {"episodes": len(episodes), "env_steps": sum(e.env_steps() for e in episodes), "node_id": node}


# ----------------------------------------------------------------------------- checkpoints & inference


def is_rllib_checkpoint(path: Path) -> bool:
    return (path / "rllib_checkpoint.json").is_file() and (path / RL_MODULE_SUBDIR).is_dir()


def module_ids(checkpoint: Path) -> list[str]:
    return sorted(p.name for p in (checkpoint / RL_MODULE_SUBDIR).iterdir() if p.is_dir())


def load_inference_module(checkpoint: Path, module_id: Optional[str] = None):
    """Load only the policy network from a checkpoint: no Ray, no env runners, no learners."""
    from ray.rllib.core import DEFAULT_MODULE_ID
    from ray.rllib.core.rl_module.rl_module import RLModule

    quiet_rllib_logs()
    module_id = module_id or DEFAULT_MODULE_ID
    module_dir = (checkpoint / RL_MODULE_SUBDIR / module_id).resolve()  # pyarrow rejects relative paths
    if not module_dir.is_dir():
        raise UserError(f"checkpoint {checkpoint} has no policy {module_id!r}; it has: {', '.join(module_ids(checkpoint))}")
    try:
        return RLModule.from_checkpoint(module_dir)
    except Exception as exc:  # a torn or foreign checkpoint: any error means it cannot be used
        raise UserError(f"checkpoint {checkpoint} cannot be loaded: {type(exc).__name__}: {exc}") from None


def greedy_actions(module, observations, state=None):
    """Deterministic actions for a batch of observations (and the next RNN state, if any)."""
    import numpy as np
    import torch
    from ray.rllib.core.columns import Columns

    batch: dict[str, Any] = {Columns.OBS: torch.as_tensor(np.asarray(observations))}
    if state is not None:
        batch[Columns.STATE_IN] = state
        batch[Columns.OBS] = batch[Columns.OBS].unsqueeze(1)  # [B, T=1, ...]
    with torch.no_grad():
        out = module.forward_inference(batch)
    if Columns.ACTIONS in out:  # DQN/SAC modules pick their greedy action themselves
        actions = out[Columns.ACTIONS]
    else:
        dist_cls = module.get_inference_action_dist_cls()
        actions = dist_cls.from_logits(out[Columns.ACTION_DIST_INPUTS]).to_deterministic().sample()
    if state is not None:
        actions = actions.squeeze(1) if actions.dim() > 1 else actions
    return actions.cpu().numpy(), out.get(Columns.STATE_OUT)


def initial_state(module):
    """The RNN state of a stateful module for a batch of one episode (None for stateless ones)."""
    import torch
    import tree  # dm-tree, an RLlib dependency: states are nested dicts

    if not module.is_stateful():
        return None
    return tree.map_structure(lambda s: torch.as_tensor(s).unsqueeze(0), module.get_initial_state())


def to_env_action(action, action_space, config: ExperimentConfig):
    """What RLlib's module-to-env connector does to an action: unsquash from [-1, 1], then clip."""
    from ray.rllib.utils.spaces.space_utils import clip_action, unsquash_action

    env_runner_options = config.rllib.get("environment", {})
    if env_runner_options.get("normalize_actions", True):
        action = unsquash_action(action, action_space)
    if env_runner_options.get("clip_actions", False):
        action = clip_action(action, action_space)
    return action

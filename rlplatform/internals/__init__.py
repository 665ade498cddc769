"""The speed-ups' package: every private Ray, RLlib or torch use; one home, one switch, one version gate.

The speed-ups here (what makes the default run fast; docs/performance.md) replace or reach into
parts of RLlib, Ray and torch that promise nothing across releases. Each is listed in
docs/internals.md with the test that guards it. They are used when the experiment's `speedups`
key is true (the default) and the installed Ray is the release they were verified on; on any other
release they switch themselves off with one warning line and the run is plain RLlib.

Nothing is patched on import: `install_in_process()` patches this process, and is called where an
algorithm, an env runner or a learner is built.
"""

from __future__ import annotations

import functools
import sys
from typing import Any, Optional

VERIFIED_RAY_VERSION = "2.60.0"
LEAN_LEARNER_ALGORITHMS = ("PPO", "APPO", "IMPALA")
LEAN_OFF_POLICY_ALGORITHMS = ("DQN", "SAC")
_warned_versions: set[str] = set()
# The env runners' metric (reduce max) of how long applying synced weights took, fetch included.
WEIGHTS_APPLY_S = "rlp_weights_apply_s"
# The lean learners' CPU seconds in gradient steps, summed over the run (under ALL_MODULES in the learner results).
GRADIENT_CPU_S = "rlp_gradient_cpu_s"


def ray_version() -> str:
    import ray

    return ray.__version__


def enabled(requested: bool) -> bool:
    """The switch behind the version gate; the first time the gate closes it, one warning line on stderr."""
    if not requested:
        return False
    version = ray_version()
    if version == VERIFIED_RAY_VERSION:
        return True
    if version not in _warned_versions:
        _warned_versions.add(version)
        print(f"warning: speed-ups off: they were verified on ray {VERIFIED_RAY_VERSION}, this is ray {version}; "
              "the run goes on as plain RLlib (`--set speedups=false` says so without this warning)", file=sys.stderr)
    return False


def gated(config: Any) -> Any:
    """The experiment as it will run: `speedups` false where the version gate closes them."""
    if config.speedups and not enabled(True):
        return config.model_copy(update={"speedups": False})
    return config


def active(config: Any, local_instance: bool) -> list[str]:
    """The speed-ups a run of this (gated) experiment uses, for its manifest."""
    if not config.speedups:
        return []
    names = ["torch_seed", "connector_frames", "episode_return"]
    if local_instance:
        names.insert(0, "local_node")
    # An external run's runners are its own; an offline run (`data`) evaluates with RLlib's.
    if config.multi_agent is None and config.env != "external" and config.data is None:
        names += ["lean_env_runner", "packed_episodes", "columnar_fragments"]
    if numpy_policy_applies(config):
        names.append("slim_env_runner")
    if config.algorithm in LEAN_LEARNER_ALGORITHMS:
        names.append("lean_learner")
    if _lean_ppo_expected(config):
        names.append("lean_ppo_sampling")
        if 0 < config.scale.runners_per_relay < config.scale.env_runners:
            names.append("sample_relays")
    if lean_off_policy_applies(config):
        names += ["lean_off_policy", "flat_replay_buffer"]
    return names


def install_in_process() -> None:
    """Patch this process (idempotent): RLlib's torch seeding and connector construction."""
    from rlplatform.internals import connector_frames, torch_seed

    torch_seed.install()
    connector_frames.install()


def env_runner_class(config: Any) -> Optional[type]:
    """The lean env runner for single-agent experiments (it falls back to RLlib's path where it does not apply);
    the torch-free env runner (`SlimEnvRunner`: remote runners act with a numpy policy) where `numpy_policy_applies`."""
    if config.multi_agent is not None or config.data is not None:  # offline: its runner only evaluates
        return None
    if numpy_policy_applies(config):
        from rlplatform.internals.slim_env_runner import SlimEnvRunner

        return SlimEnvRunner
    from rlplatform.internals.lean_env_runner import LeanEnvRunner

    return LeanEnvRunner


NUMPY_POLICY_ALGORITHMS = ("PPO", "APPO", "IMPALA")
# Pass-through settings that could change the module, the connector pipelines, the callbacks' view of the
# module or the sampling mode: with any of them, remote runners keep torch.
_RLLIB_METHODS_AGAINST_NUMPY_POLICY = {"rl_module", "callbacks", "framework", "api_stack", "evaluation", "multi_agent"}
_ENV_RUNNER_KEYS_AGAINST_NUMPY_POLICY = {
    "env_to_module_connector", "module_to_env_connector", "add_default_connectors_to_env_to_module_pipeline",
    "add_default_connectors_to_module_to_env_pipeline", "env_runner_cls", "num_gpus_per_env_runner", "batch_mode",
    "explore",
}


def numpy_policy_applies(config: Any) -> bool:
    """Remote env runners may act with a numpy policy (client/numpy_policy.py) and load no torch.

    Decided here, on the driver, because a runner process that starts without torch cannot load it
    later: PPO, APPO or IMPALA with RLlib's default MLP module (no LSTM), remote CPU runners, no
    pass-through setting that changes the module, the pipelines or the sampling mode, and an env
    (built once here to read its spaces) with a 1-D Box observation and a Discrete or 1-D Box action.
    """
    rllib = config.rllib
    if (config.algorithm not in NUMPY_POLICY_ALGORITHMS or config.multi_agent is not None or not config.scale.env_runners
            or config.model.use_lstm or not config.model.hidden or config.hardware.gpus_per_env_runner
            or set(rllib) & _RLLIB_METHODS_AGAINST_NUMPY_POLICY
            or set(rllib.get("env_runners") or {}) & _ENV_RUNNER_KEYS_AGAINST_NUMPY_POLICY):
        return False
    import gymnasium as gym

    spaces = _env_spaces_of(config)
    if spaces is None:
        return False
    obs, act = spaces
    return (isinstance(obs, gym.spaces.Box) and len(obs.shape) == 1
            and ((isinstance(act, gym.spaces.Discrete) and int(act.start) == 0)
                 or (isinstance(act, gym.spaces.Box) and len(act.shape) == 1)))


def _env_spaces_of(config: Any) -> Optional[tuple[Any, Any]]:
    """The experiment's env's (observation space, action space), built once here; None where the driver cannot."""
    import json

    try:
        env_config_json = json.dumps(dict(config.env_config), sort_keys=True, default=repr)
    except (TypeError, ValueError):  # keys of mixed types cannot be sorted
        return None
    return _env_spaces(config.env, env_config_json)


@functools.lru_cache(maxsize=64)
def _env_spaces(env: str, env_config_json: str) -> Optional[tuple[Any, Any]]:
    import json

    from rlplatform.config.env_ids import make_env

    try:
        instance = make_env(env, **json.loads(env_config_json))
    except Exception:  # an env the driver cannot build
        return None
    try:
        return instance.observation_space, instance.action_space
    finally:
        try:
            instance.close()
        except Exception:
            pass


def own_losses_apply(config: Any) -> bool:
    """The lean off-policy learner computes the loss (and so takes our loss settings, e.g. `training.critic_loss`):
    the speed-ups on, the lean off-policy path, and for SAC a 1-D Box action (discrete SAC keeps RLlib's loss)."""
    import gymnasium as gym

    if not (enabled(config.speedups) and lean_off_policy_applies(config)):
        return False
    spaces = _env_spaces_of(config) if config.algorithm == "SAC" else None
    return config.algorithm != "SAC" or (spaces is not None and isinstance(spaces[1], gym.spaces.Box))


def learner_class(config: Any) -> Optional[type]:
    if lean_off_policy_applies(config):
        from rlplatform.internals.lean_off_policy import LEAN_OFF_POLICY_LEARNERS

        return LEAN_OFF_POLICY_LEARNERS[config.algorithm]
    if config.algorithm not in LEAN_LEARNER_ALGORITHMS:
        return None
    from rlplatform.internals.lean_learner import LEAN_LEARNERS

    return LEAN_LEARNERS[config.algorithm]


def lean_off_policy_applies(config: Any) -> bool:
    """DQN and SAC take the lean off-policy path (the flat replay buffer and its training step): single-agent,
    feed-forward, whole n_step."""
    n_step = config.training.get("n_step", 1)
    return (config.algorithm in LEAN_OFF_POLICY_ALGORITHMS and config.multi_agent is None
            and not config.model.use_lstm and isinstance(n_step, int) and not isinstance(n_step, bool))


# Pass-through settings under which the runners' state needs RLlib's own broadcasts (lean_ppo.lean_sampling_applies).
_ENV_RUNNER_KEYS_AGAINST_LEAN_PPO = {"env_to_module_connector", "module_to_env_connector", "merge_env_runner_states",
                                     "broadcast_env_runner_states"}


def _lean_ppo_expected(config: Any) -> bool:
    """What `lean_ppo.lean_sampling_applies` will say of the built RLlib config, read from the experiment."""
    return (config.algorithm == "PPO" and bool(config.scale.env_runners)
            and not set(config.rllib.get("env_runners") or {}) & _ENV_RUNNER_KEYS_AGAINST_LEAN_PPO
            and "count_steps_by" not in (config.rllib.get("multi_agent") or {}))


def use_lean_ppo_where_it_applies(config: Any, algo_config: Any) -> None:
    """RLlib's PPO config pointed at `LeanPPO` (one request per runner per iteration) where it applies: an experiment
    that passes any of the keys above through to RLlib keeps RLlib's iteration (`--set
    rllib.env_runners.broadcast_env_runner_states=true` is the way to measure one against the other)."""
    from rlplatform.internals.lean_ppo import lean_sampling_applies, use_lean_ppo

    if _lean_ppo_expected(config) and lean_sampling_applies(algo_config):
        use_lean_ppo(algo_config, config.scale.runners_per_relay)


def use_lean_off_policy(algo_config: Any) -> None:
    """Point an RLlib DQN or SAC config at the lean off-policy path's algorithm class and the flat replay buffer.

    The buffer's contents go into checkpoints (a few MB for the classic-control presets), so a
    resumed run continues with the experience it had.
    """
    from rlplatform.internals.lean_off_policy import LEAN_ALGORITHMS

    algo_config.algo_class = LEAN_ALGORITHMS[algo_config.algo_class.__name__]
    algo_config.store_buffer_in_checkpoints = True

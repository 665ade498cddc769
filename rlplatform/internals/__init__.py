"""Every use of a private Ray, RLlib or torch symbol in the project: one home, one switch, one version gate.

The speed-ups here (what makes the default run fast; docs/performance.md) replace or reach into
parts of RLlib, Ray and torch that promise nothing across releases. Each is listed in
docs/internals.md with the test that guards it. They are used when the experiment's `speedups`
key is true (the default) and the installed Ray is the release they were verified on; on any other
release they switch themselves off with one warning line and the run is plain RLlib.

Nothing is patched on import: `install_in_process()` patches this process, and is called where an
algorithm, an env runner or a learner is built.
"""

from __future__ import annotations

import sys
from typing import Any, Optional

VERIFIED_RAY_VERSION = "2.60.0"
LEAN_LEARNER_ALGORITHMS = ("PPO", "APPO", "IMPALA")
LEAN_OFF_POLICY_ALGORITHMS = ("DQN", "SAC")
_warned_versions: set[str] = set()


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
    if config.multi_agent is None:
        names += ["lean_env_runner", "packed_episodes"]
    if config.algorithm in LEAN_LEARNER_ALGORITHMS:
        names.append("lean_learner")
    if lean_off_policy_applies(config):
        names += ["lean_off_policy", "flat_replay_buffer"]
    return names


def install_in_process() -> None:
    """Patch this process (idempotent): RLlib's torch seeding and connector construction."""
    from rlplatform.internals import connector_frames, torch_seed

    torch_seed.install()
    connector_frames.install()


def env_runner_class(config: Any) -> Optional[type]:
    """The lean env runner for single-agent experiments (it falls back to RLlib's path where it does not apply)."""
    if config.multi_agent is not None:
        return None
    from rlplatform.internals.lean_env_runner import LeanEnvRunner

    return LeanEnvRunner


def learner_class(config: Any) -> Optional[type]:
    if lean_off_policy_applies(config):
        from rlplatform.internals.lean_off_policy import LEAN_OFF_POLICY_LEARNERS

        return LEAN_OFF_POLICY_LEARNERS[config.algorithm]
    if config.algorithm not in LEAN_LEARNER_ALGORITHMS:
        return None
    from rlplatform.internals.lean_learner import LEAN_LEARNERS

    return LEAN_LEARNERS[config.algorithm]


def lean_off_policy_applies(config: Any) -> bool:
    """DQN and SAC take the flat replay buffer and lean training step: single-agent, feed-forward, whole n_step."""
    n_step = config.training.get("n_step", 1)
    return (config.algorithm in LEAN_OFF_POLICY_ALGORITHMS and config.multi_agent is None
            and not config.model.use_lstm and isinstance(n_step, int) and not isinstance(n_step, bool))


def use_lean_off_policy(algo_config: Any) -> None:
    """Point an RLlib DQN or SAC config at the lean algorithm class and the flat replay buffer.

    The buffer's contents go into checkpoints (a few MB for the classic-control presets), so a
    resumed run continues with the experience it had.
    """
    from rlplatform.internals.lean_off_policy import LEAN_ALGORITHMS

    algo_config.algo_class = LEAN_ALGORITHMS[algo_config.algo_class.__name__]
    algo_config.store_buffer_in_checkpoints = True

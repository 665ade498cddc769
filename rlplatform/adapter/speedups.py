"""The one door to the speed-ups (`rlplatform/internals/`, docs/internals.md) for every layer above the adapter.

Commands, runs, sweeps, infrastructure and benchmarks ask here: the version gate, what a run's
manifest records, a private local Ray start, the object stores' bytes, and the flat replay buffer
that `bench learner` times. Nothing here patches anything; each call decides on the switch.
"""

from __future__ import annotations

from typing import Any, Optional

from rlplatform import internals
from rlplatform.config.schema import ExperimentConfig


def gated(config: ExperimentConfig) -> ExperimentConfig:
    """The experiment as it will run: `speedups` false where the installed Ray is not the verified one."""
    return internals.gated(config)


def manifest_record(requested: bool, config: ExperimentConfig, local_instance: bool) -> dict[str, Any]:
    """What a run's `manifest.json` says of the speed-ups: asked for, in use, and the Ray they were verified on."""
    return {"requested": requested, "active": internals.active(config, local_instance),
            "ray": internals.ray_version(), "verified_on_ray": internals.VERIFIED_RAY_VERSION}


def init_local_ray(init_kwargs: dict[str, Any], speedups: bool, prestart_workers: bool) -> None:
    """`ray.init(**init_kwargs)` for a private local instance: the lean local node start where the switch and the
    version gate allow it, plain `ray.init` otherwise."""
    import ray

    if internals.enabled(speedups):
        from rlplatform.internals import local_node

        local_node.init(init_kwargs, prestart_workers)
    else:
        ray.init(**init_kwargs)


def object_store_bytes(nodes: list[dict[str, Any]]) -> Optional[tuple[float, float]]:
    """(used, cumulative created) bytes of the alive nodes' object stores; None where Ray's reading fails."""
    from rlplatform.internals.ray_stats import object_store_bytes as read

    return read(nodes)


def flat_replay_buffer(capacity: int, gamma: float, n_step: int, seed: int) -> Any:
    """The replay buffer of the lean off-policy path for DQN/SAC (n-step rows in ring arrays)."""
    from rlplatform.internals.flat_replay_buffer import FlatReplayBuffer

    return FlatReplayBuffer(capacity, gamma=gamma, n_step=n_step, seed=seed)


def flat_rows_to_batch(rows: dict[str, Any], count: int) -> Any:
    """Rows sampled from the flat buffer as the `MultiAgentBatch` a lean off-policy learner updates on."""
    from rlplatform.internals.lean_off_policy import rows_to_batch

    return rows_to_batch(rows, count)

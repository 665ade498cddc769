"""Where the Algorithm lives: an actor in the run's placement group, or the driver itself.

Running the Algorithm inside an actor of the placement group (as Ray Tune does) is what
makes RLlib honour `placement` (pack/spread) for env runners and learners on a cluster: every
actor the Algorithm starts lands in the group's bundles. On a private local instance (one node)
there is nothing to place, and that actor's start (a fresh process importing RLlib and torch,
seconds on a small machine) was the largest part of a run's start-up: there the Algorithm is built
in the driver, as plain RLlib scripts do (`scale.algorithm_in`, decided in `run.plan`). Either way the driver keeps the
loop, the logs and the signals and calls the same `AlgorithmHost` methods through `call`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional, Union

import ray

from rlplatform.config.schema import ExperimentConfig

ALGORITHM_HOST_ENV = "RLPLATFORM_ALGORITHM_HOST"  # set in the process that holds the Algorithm

PLACEMENT_TIMEOUT_S = 60.0


class HostFailed(Exception):
    """The Algorithm raised (in its actor or in this process); the message is the error's last line."""


class AlgorithmHost:
    def __init__(self, config: ExperimentConfig, main_process_resources: Optional[dict[str, float]] = None):
        import torch

        from rlplatform.adapter import algorithm_config

        algorithm_config.quiet_rllib_logs()
        # As many torch threads as CPUs this process reserved: no oversubscription.
        torch.set_num_threads(max(1, int(config.hardware.driver_cpus)))
        # Envs built in this process (sampling in the main process) are not in a remote env runner:
        # rlplatform/Faulty-v0 injects no faults here (envs/faults.py).
        os.environ[ALGORITHM_HOST_ENV] = "1"
        self._epochs = algorithm_config.epochs_per_batch(config)
        self._offline = config.data is not None
        self._recording = config.record is not None
        self.algo = algorithm_config.build_algorithm_config(config, main_process_resources, recording=True).build_algo()
        self.initialized: list[str] = []
        if config.init_from:
            from rlplatform.adapter.init_weights import start_from

            self.initialized = start_from(self.algo, Path(config.init_from))

    def initialized_from(self) -> list[str]:
        """The module's tensors that `init_from` gave their starting values."""
        return self.initialized

    def train(self) -> dict[str, Any]:
        from rlplatform.adapter.results import from_rllib_result, start_timers_afresh

        result = from_rllib_result(self.algo.train(), self._epochs, offline=self._offline)
        start_timers_afresh(self.algo)
        return result

    def save(self, path: str) -> None:
        self.flush_recording()  # the episodes sampled up to a checkpoint are on disk when it is
        self.algo.save_to_path(path)

    def flush_recording(self) -> int:
        """Write the finished episodes the env runners hold (`record`); how many."""
        from rlplatform.adapter import recording

        return recording.flush(self.algo) if self._recording else 0

    def restore(self, path: str) -> dict[str, Any]:
        self.algo.restore_from_path(path)
        return {"iteration": self.algo.iteration, "replay_buffer": self._replay_buffer_state()}

    def _replay_buffer_state(self) -> Optional[dict[str, Any]]:
        """An off-policy algorithm's buffer after a restore: what it holds and whether checkpoints carry it."""
        buffer = getattr(self.algo, "local_replay_buffer", None)
        if buffer is None:
            return None
        size = len(buffer) if hasattr(buffer, "__len__") else buffer.get_num_timesteps()
        return {"transitions": int(size), "saved": bool(getattr(self.algo, "saves_replay_buffer", False))}

    def env_runner_nodes(self) -> list[str]:
        from rlplatform.adapter.env_runners import env_runner_node_ids

        return env_runner_node_ids(self.algo)

    def learner_nodes(self) -> list[str]:
        from rlplatform.adapter.learners import learner_node_ids

        return learner_node_ids(self.algo)

    def learner_weights(self) -> list[str]:
        from rlplatform.adapter.learners import weight_digests

        return weight_digests(self.algo)

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def stop(self) -> None:
        from rlplatform.adapter.external_runner import release_waiting_runners

        release_waiting_runners(self.algo.config)  # an `env: external` run's runners may wait for a simulator
        try:
            self.flush_recording()
        except ray.exceptions.RayError:  # a runner that died took what it held (docs/offline.md); the rest is written
            pass
        self.algo.stop()


class ActorHost:
    """An AlgorithmHost actor in bundle 0 of the run's placement group."""

    where = "actor"

    def __init__(self, config: ExperimentConfig, bundles: list[dict[str, float]], main_process_resources: dict[str, float],
                 cluster: str):
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from rlplatform.errors import UserError

        main_bundle = {**bundles[0], **main_process_resources}
        self._pg = placement_group([main_bundle, *bundles[1:]], strategy=config.scale.placement.upper())
        try:
            ray.get(self._pg.ready(), timeout=PLACEMENT_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            self._remove_placement_group()
            raise UserError(
                f"Ray could not place the run's actors within {PLACEMENT_TIMEOUT_S:.0f} s "
                f"(bundles {bundles}, cluster {cluster}, placement {config.scale.placement})"
            ) from None
        self._actor = ray.remote(AlgorithmHost).options(
            num_cpus=main_bundle.get("CPU", 0),
            num_gpus=main_bundle.get("GPU", 0),
            scheduling_strategy=PlacementGroupSchedulingStrategy(self._pg, placement_group_bundle_index=0,
                                                                 placement_group_capture_child_tasks=True),
        ).remote(config, main_process_resources)

    def call(self, method: str, *args: Any) -> Any:
        try:
            return ray.get(getattr(self._actor, method).remote(*args))
        except ray.exceptions.RayError as exc:
            raise HostFailed(last_line(exc)) from None

    def close(self) -> None:
        try:
            ray.get(self._actor.stop.remote(), timeout=30)
        except Exception:  # the run is over either way; never hide the real result behind a stop error
            pass
        ray.kill(self._actor)
        self._remove_placement_group()

    def _remove_placement_group(self) -> None:
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(self._pg)


class InProcessHost:
    """An AlgorithmHost in the driver (a run on a private local instance)."""

    where = "driver"

    def __init__(self, config: ExperimentConfig):
        try:
            self._host = AlgorithmHost(config)
        except Exception as exc:  # what an actor would have wrapped in a RayActorError
            raise HostFailed(last_line(exc)) from None

    def call(self, method: str, *args: Any) -> Any:
        try:
            return getattr(self._host, method)(*args)
        except Exception as exc:
            raise HostFailed(last_line(exc)) from None

    def close(self) -> None:
        try:
            self._host.stop()
        except Exception:  # as in ActorHost.close
            pass


Host = Union[ActorHost, InProcessHost]


def start(config: ExperimentConfig, bundles: list[dict[str, float]], main_process_resources: dict[str, float],
          cluster: str, in_driver: bool) -> Host:
    return InProcessHost(config) if in_driver else ActorHost(config, bundles, main_process_resources, cluster)


def last_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[-1] if lines else type(exc).__name__

"""The Ray actor that holds the Algorithm, placed in the run's placement group.

Running the Algorithm inside an actor of the placement group (as Ray Tune does) is what
makes RLlib honour `placement` (pack/spread) for env runners and learners: every actor the
Algorithm starts lands in the group's bundles. The driver keeps the loop, the logs and the
signals; this actor only trains, saves and restores.
"""

from __future__ import annotations

from typing import Any, Optional

import ray

from rlplatform.config import ExperimentConfig


class AlgorithmHost:
    def __init__(self, config: ExperimentConfig, main_process_resources: Optional[dict[str, float]] = None):
        import torch

        from rlplatform import rllib_adapter

        rllib_adapter.quiet_rllib_logs()
        # As many torch threads as CPUs this process reserved: no oversubscription.
        torch.set_num_threads(max(1, int(config.hardware.driver_cpus)))
        self._adapter = rllib_adapter
        self._epochs = rllib_adapter.epochs_per_batch(config)
        self.algo = rllib_adapter.build_algorithm_config(config, main_process_resources).build_algo()

    def train(self) -> dict[str, Any]:
        from rlplatform.metrics import from_rllib_result

        return from_rllib_result(self.algo.train(), self._epochs)

    def save(self, path: str) -> None:
        self.algo.save_to_path(path)

    def restore(self, path: str) -> dict[str, Any]:
        self.algo.restore_from_path(path)
        return {"iteration": self.algo.iteration}

    def env_runner_nodes(self) -> list[str]:
        return self._adapter.env_runner_node_ids(self.algo)

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def stop(self) -> None:
        self.algo.stop()

"""The torch-free env runner: a lean env runner whose remote runner process acts with a numpy policy and never loads torch.

A remote env runner imported torch (~126 MB of private memory: its op registrations) and RLlib's
torch modules only to run an MLP's forward pass and sample an action (docs/performance.md, memory
per runner). RLlib has a test hook for that: with `RLLIB_TEST_NO_TORCH_IMPORT` in the environment,
`ray.rllib.utils.framework.try_import_torch` returns stubs, and RLlib loads without torch.

`install_in_torch_free_worker()` sets that variable in a fresh Ray worker process (RLlib and torch
not loaded yet) whose task is creating a SlimEnvRunner actor, and nowhere else. It has to run before
RLlib's first import in that process, because RLlib's modules call `try_import_torch` as they are
imported; and the first import of RLlib there is this module's own (Ray imports this module to
unpickle the actor class, before the AlgorithmConfig or anything else that would load RLlib). So it
is called from the top of this module, before its imports: the one call in internals/ made while a
module is imported (docs/internals.md). In any other process it changes nothing: the driver and the
algorithm host have loaded RLlib (and torch) before they import this module, and other actors
(learners, aggregators) are not creating a SlimEnvRunner. Whether an experiment may use it is decided
on the driver (`internals.numpy_policy_applies`): only then is this class the env runner class.

In such a process (`TORCH_FREE`) the runner's module is a `NumpyPolicy` (client/numpy_policy.py)
that takes the inference-only weights RLlib syncs, and the lean env runner's array path computes actions with it.
RLlib's device lookup (`get_device`, which needs torch) answers "cpu" here, the env-to-module
pipeline is not run at env resets (the array path never reads its output) and torch is not seeded.
Anywhere else (the local runner, a worker that loaded RLlib already) this is the LeanEnvRunner.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, Optional

NO_TORCH_FLAG = "RLLIB_TEST_NO_TORCH_IMPORT"


def _starting_a_slim_runner() -> bool:
    """This process is a Ray worker, with neither RLlib nor torch loaded, that is creating a SlimEnvRunner actor.

    Other actors (a remote learner, an aggregator) load this module too, when they unpickle an
    AlgorithmConfig that names this class as its env runner class: they must keep torch.
    """
    if "ray.rllib" in sys.modules or "torch" in sys.modules:
        return False
    import ray
    import ray._private.worker as ray_worker

    if ray_worker.global_worker.mode != ray_worker.WORKER_MODE:
        return False
    try:
        task = ray.get_runtime_context().get_task_function_name() or ""
    except Exception:  # no task context: not an actor being created
        return False
    return f"{__name__}.SlimEnvRunner." in task


def install_in_torch_free_worker() -> bool:
    """In a fresh Ray worker creating a SlimEnvRunner, set RLlib's no-torch hook (before RLlib loads); elsewhere
    nothing. Whether this process runs torch-free: the hook is set and torch is not loaded."""
    if NO_TORCH_FLAG not in os.environ and _starting_a_slim_runner():
        os.environ[NO_TORCH_FLAG] = "1"
        # try_import_torch logs "Not importing PyTorch for test purposes." at every call while the flag is set.
        logging.getLogger("ray.rllib.utils.framework").setLevel(logging.ERROR)
    return NO_TORCH_FLAG in os.environ and "torch" not in sys.modules


TORCH_FREE = install_in_torch_free_worker()  # before the imports below: the first of RLlib in a torch-free env runner's process

import gymnasium as gym  # noqa: E402  (after the hook: everything below may load RLlib)
from ray.rllib.env import single_agent_env_runner  # noqa: E402

from rlplatform.client.numpy_policy import NumpyPolicy  # noqa: E402
from rlplatform.internals.lean_env_runner import LeanEnvRunner  # noqa: E402


def _cpu_device(config: Any, num_gpus_requested: Any = 0) -> str:
    return "cpu"


class SlimEnvRunner(LeanEnvRunner):
    module: Any  # RLlib's RLModule, or in a torch-free process the numpy policy (None while RLlib's own path runs)

    def __init__(self, *args: Any, **kwargs: Any):
        if TORCH_FREE:
            single_agent_env_runner.get_device = _cpu_device  # RLlib's needs torch; a CPU runner is all this process runs
        super().__init__(*args, **kwargs)
        if TORCH_FREE and not self.lean:
            raise RuntimeError("a torch-free env runner needs the lean path (default connectors, Box observations); "
                               "internals.numpy_policy_applies should have said no to this experiment")

    def _torch_free(self) -> bool:
        return TORCH_FREE

    def make_module(self) -> None:
        if not TORCH_FREE:
            super().make_module()
            return
        model = self.config.model_config
        obs_space, act_space = self.env.single_observation_space, self.env.single_action_space
        self.module = numpy_policy_for(obs_space, act_space, model, seed=self._seed)

    def _reset_envs(self, episodes: list, shared_data: dict, explore: bool) -> None:
        if not TORCH_FREE:
            super()._reset_envs(episodes, shared_data, explore)
            return
        module, self.module = self.module, None  # RLlib's pipeline would make tensors; the array path reads none
        try:
            super()._reset_envs(episodes, shared_data, explore)
        finally:
            self.module = module

    def _sample(self, *, num_timesteps: Optional[int] = None, num_episodes: Optional[int] = None, explore: bool,
                random_actions: bool = False, force_reset: bool = False) -> list:
        if TORCH_FREE and num_timesteps is None and not random_actions:
            raise NotImplementedError("a torch-free env runner samples timesteps (batch_mode truncate_episodes), "
                                      "not whole episodes")
        if TORCH_FREE and random_actions:
            module, self.module = self.module, None
            try:
                return super()._sample(num_timesteps=num_timesteps, num_episodes=num_episodes, explore=explore,
                                       random_actions=True, force_reset=force_reset)
            finally:
                self.module = module
        return super()._sample(num_timesteps=num_timesteps, num_episodes=num_episodes, explore=explore,
                               random_actions=random_actions, force_reset=force_reset)

    def _compute_actions(self, observations: Any, explore: bool, t: int) -> dict:
        if TORCH_FREE:
            return self.module.compute_actions(observations, explore)
        return super()._compute_actions(observations, explore, t)


def numpy_policy_for(obs_space: gym.Space, act_space: gym.Space, model: dict, seed: Optional[int] = None) -> NumpyPolicy:
    """A NumpyPolicy for RLlib's default PPO-family module on these spaces, with freshly initialised weights."""
    if isinstance(act_space, gym.spaces.Discrete):
        kind, out_dim = "categorical", int(act_space.n)
    else:
        kind, out_dim = "gaussian", int(act_space.shape[0])
    policy = NumpyPolicy(action_kind=kind, action_dim=out_dim, activation=model.get("fcnet_activation"),
                         head_activation=model.get("head_fcnet_activation"), seed=seed)
    policy.set_state(policy.initial_state(
        obs_dim=int(obs_space.shape[0]), hidden=list(model["fcnet_hiddens"]), head_hidden=list(model.get("head_fcnet_hiddens") or []),
        shared=bool(model.get("vf_share_layers", True)), free_log_std=bool(model.get("free_log_std")),
        log_std_clip=float(model.get("log_std_clip_param", 20.0)),
    ))
    return policy

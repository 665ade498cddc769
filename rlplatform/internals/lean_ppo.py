"""PPO's synchronous iteration with one Ray call per env runner instead of three.

RLlib's PPO iteration sends every remote runner three requests: `sample` (with `get_metrics`), after
the update `set_state` with the new weights, and after the iteration `set_state` with the run's
env-step count (`Algorithm.step`'s `sync_env_runner_states`). Each costs the driver 0.35-0.5 ms of CPU on
this machine (Ray's submission and reply, whatever the payload), which is most of the per-runner cost
of `docs/scale.md`'s model. `LeanPPO` sends the weights and the step count with the next sample request
instead, in one object put once per iteration: a runner starts every sample with exactly the state
RLlib's two broadcasts would have given it, so sampling and learning are RLlib's.

A round of requests that brings no env steps ends the sampling (the iteration learns on what came): RLlib's
loop would ask again at once, which only happens with runners that wait on simulators outside Ray
(`env: external`), whose next steps need the next update's weights.

It applies (`lean_sampling_applies`) where the broadcasts carry nothing else: remote runners, no
connector state merged from the runners (`merge_env_runner_states=False`, which the adapter sets
unless the experiment adds connectors), steps counted as env steps, RLlib's broadcast of runner states on.
"""

from __future__ import annotations

from typing import Any, Optional

import ray
from ray.rllib.algorithms.ppo.ppo import PPO
from ray.rllib.core import ALL_MODULES, COMPONENT_LEARNER, COMPONENT_RL_MODULE
from ray.rllib.utils.metrics import (
    ENV_RUNNER_RESULTS,
    ENV_RUNNER_SAMPLING_TIMER,
    LEARNER_RESULTS,
    LEARNER_UPDATE_TIMER,
    NUM_ENV_STEPS_SAMPLED,
    NUM_ENV_STEPS_SAMPLED_LIFETIME,
    NUM_MODULE_STEPS_TRAINED_LIFETIME,
    SYNCH_WORKER_WEIGHTS_TIMER,
    TIMERS,
    WEIGHTS_SEQ_NO,
)
from ray.rllib.utils.typing import EpisodeType


def sample_with_state(runner: Any, state: Optional[dict] = None) -> tuple[list[EpisodeType], dict]:
    """On a runner: take the driver's state (new weights, the run's env-step count), then sample as RLlib's PPO asks.

    A module-level function, so that Ray pickles it by name: a lambda is pickled by value on every call.
    """
    if state is not None:
        runner.set_state(state)
    return runner.sample(), runner.get_metrics()


def lean_sampling_applies(algo_config: Any) -> bool:
    """One request per runner carries everything RLlib's iteration would have sent it (see the module's text)."""
    return (algo_config.algo_class is PPO and algo_config.num_env_runners > 0
            and algo_config.enable_env_runner_and_connector_v2
            and algo_config.merge_env_runner_states is False and algo_config.broadcast_env_runner_states
            and algo_config.count_steps_by == "env_steps" and not algo_config._dont_auto_sync_env_runner_states)


def use_lean_ppo(algo_config: Any) -> None:
    """Point an RLlib PPO config at `LeanPPO`; `Algorithm.step` then leaves the step count to the sample requests."""
    algo_config.algo_class = LeanPPO
    algo_config._dont_auto_sync_env_runner_states = True


class LeanPPO(PPO):
    """RLlib's PPO; the runners' state travels with the next sample request."""

    # The synced module state (RL module and weights' sequence number) of the last update, not yet sent.
    _state_for_runners: Optional[dict] = None

    def training_step(self) -> None:
        if self.env_runner_group.num_remote_workers() <= 0:
            super().training_step()
            self._count_on_local_runner()
            return
        with self.metrics.log_time((TIMERS, ENV_RUNNER_SAMPLING_TIMER)):
            episodes, runner_metrics = self._sample()
            if not episodes:
                return
            self.metrics.aggregate(runner_metrics, key=ENV_RUNNER_RESULTS)
        with self.metrics.log_time((TIMERS, LEARNER_UPDATE_TIMER)):
            learner_results = self.learner_group.update(
                episodes=episodes,
                timesteps={
                    NUM_ENV_STEPS_SAMPLED_LIFETIME: self.metrics.peek((ENV_RUNNER_RESULTS, NUM_ENV_STEPS_SAMPLED_LIFETIME)),
                    NUM_MODULE_STEPS_TRAINED_LIFETIME: self.metrics.peek(
                        (LEARNER_RESULTS, ALL_MODULES, NUM_MODULE_STEPS_TRAINED_LIFETIME), default=0),
                },
                num_epochs=self.config.num_epochs,
                minibatch_size=self.config.minibatch_size,
                shuffle_batch_per_epoch=self.config.shuffle_batch_per_epoch,
            )
            self.metrics.aggregate(learner_results, key=LEARNER_RESULTS)
        with self.metrics.log_time((TIMERS, SYNCH_WORKER_WEIGHTS_TIMER)):
            self._state_for_runners = self._module_state(set(learner_results[0]) - {ALL_MODULES})
        self._count_on_local_runner()

    def _sample(self) -> tuple[list[EpisodeType], list[dict]]:
        """RLlib's `synchronous_parallel_sample` for PPO, the pending state riding on the first round's requests."""
        state: Optional[Any] = ray.put({**(self._state_for_runners or {}),
                                        NUM_ENV_STEPS_SAMPLED_LIFETIME: self._env_steps_lifetime()})
        self._state_for_runners = None
        episodes: list[EpisodeType] = []
        runner_metrics: list[dict] = []
        steps = 0
        while steps < self.config.total_train_batch_size:
            results = self.env_runner_group.foreach_env_runner(
                sample_with_state, kwargs={"state": state}, local_env_runner=False,
                timeout_seconds=self.config.sample_timeout_s)
            state = None  # a second round (a runner failed or timed out) samples on the state already sent
            if not results or self.env_runner_group.num_healthy_remote_workers() <= 0:
                break
            round_steps = 0
            for fragment, metrics in results:
                episodes.extend(fragment)
                runner_metrics.append(metrics)
                round_steps += int(metrics.get(NUM_ENV_STEPS_SAMPLED, 0))
            steps += round_steps
            if not round_steps:  # runners with nothing to give before the next update (simulators outside Ray)
                break
        return episodes, runner_metrics

    def _module_state(self, modules: set) -> dict:
        """What RLlib's `sync_weights` sends the runners (inference-only module state and its sequence number);
        the local runner takes it now, as there."""
        state = self.learner_group.get_state(
            components=[f"{COMPONENT_LEARNER}/{COMPONENT_RL_MODULE}/{m}" for m in modules],
            inference_only=True)[COMPONENT_LEARNER]
        state = {k: v for k, v in state.items() if k in (COMPONENT_RL_MODULE, WEIGHTS_SEQ_NO)}
        local = self.env_runner_group.local_env_runner
        if local is not None:
            local.set_state(state)
        return state

    def _env_steps_lifetime(self) -> int:
        return int(self.metrics.peek((ENV_RUNNER_RESULTS, NUM_ENV_STEPS_SAMPLED_LIFETIME), default=0))

    def _count_on_local_runner(self) -> None:
        """The step count `Algorithm.step` would have set on the local runner (remote ones get it with the next sample)."""
        local = self.env_runner_group.local_env_runner
        if local is not None:
            local.set_state({NUM_ENV_STEPS_SAMPLED_LIFETIME: self._env_steps_lifetime()})

"""PPO's synchronous iteration with one Ray call per env runner instead of three.

RLlib's PPO iteration sends every remote runner three requests: `sample` (with `get_metrics`), after
the update `set_state` with the new weights, and after the iteration `set_state` with the run's
env-step count (`Algorithm.step`'s `sync_env_runner_states`). Each costs the driver 0.35-0.5 ms of CPU on
this machine (Ray's submission and reply, whatever the payload), which is most of the per-runner cost
of `docs/scale.md`'s model. `LeanPPO` sends the weights and the step count with the next sample request
instead, in one object put once per iteration: a runner starts every sample with exactly the state
RLlib's two broadcasts would have given it, so sampling and learning are RLlib's.

With more remote runners than `runners_per_relay` (the experiment's `scale.runners_per_relay`), the requests go
through relay actors, one per group of at most that many runners on a node (`sample_relay.py`): the driver sends
one request per relay and, with one learner, hands the learner a reference to each relay's episodes instead of the
episodes. On one node the episodes come in runner order, as RLlib's; over several nodes, node by node.

A round of requests that brings no env steps ends the sampling (the iteration learns on what came): RLlib's
loop would ask again at once, which only happens with runners that wait on simulators outside Ray
(`env: external`), whose next steps need the next update's weights.

It applies (`lean_sampling_applies`) where the broadcasts carry nothing else: remote runners, no
connector state merged from the runners (`merge_env_runner_states=False`, which the adapter sets
unless the experiment adds connectors), steps counted as env steps, RLlib's broadcast of runner states on.
"""

from __future__ import annotations

import math
from collections import defaultdict
from itertools import chain
from typing import Any, Optional

import ray
from ray.exceptions import RayActorError, RayError
from ray.rllib.algorithms.ppo.ppo import PPO
from ray.rllib.core import ALL_MODULES, COMPONENT_LEARNER, COMPONENT_RL_MODULE
from ray.rllib.env.env_runner_group import EnvRunnerGroup
from ray.rllib.utils.actor_manager import FaultTolerantActorManager
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
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from rlplatform.internals.sample_relay import RunnerReply, SampleRelay, node_of_runner, sample_with_state

RELAY_MARGIN_S = 30.0  # how much longer than the runners' timeout the driver waits for the relays' replies
NODE_LOOKUP_S = 10.0  # how long a runner may take to say which node it is on (a busy one may be still sampling)


def lean_sampling_applies(algo_config: Any) -> bool:
    """One request per runner carries everything RLlib's iteration would have sent it (see the module's text)."""
    return (algo_config.algo_class is PPO and algo_config.num_env_runners > 0
            and algo_config.enable_env_runner_and_connector_v2
            and algo_config.merge_env_runner_states is False and algo_config.broadcast_env_runner_states
            and algo_config.count_steps_by == "env_steps" and not algo_config._dont_auto_sync_env_runner_states)


def use_lean_ppo(algo_config: Any, runners_per_relay: int = 0) -> None:
    """Point an RLlib PPO config at `LeanPPO`; `Algorithm.step` then leaves the step count to the sample requests.

    runners_per_relay: with more remote runners than this, relays make the sample requests (0: never)."""
    algo_config.algo_class = LeanPPO
    algo_config._dont_auto_sync_env_runner_states = True
    algo_config.lean_ppo_runners_per_relay = runners_per_relay


class LeanPPO(PPO):
    """RLlib's PPO; the runners' state travels with the next sample request."""

    # The synced module state (RL module and weights' sequence number) of the last update, not yet sent.
    _state_for_runners: Optional[dict] = None
    # The relays and the runner ids each serves, for the runner handles they were built with; relays replaced during
    # an iteration, stopped after its update (they own episodes of its earlier sampling rounds).
    _relays: list[tuple[Any, list[int]]] = []
    _relays_for: Optional[dict[int, Any]] = None
    _retired_relays: list[Any] = []

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
                **_training_data(episodes, self.config.num_learners),
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
        self._stop_retired_relays()
        with self.metrics.log_time((TIMERS, SYNCH_WORKER_WEIGHTS_TIMER)):
            self._state_for_runners = self._module_state(set(learner_results[0]) - {ALL_MODULES})
        self._count_on_local_runner()

    def _sample(self) -> tuple[list, list[dict]]:
        """RLlib's `synchronous_parallel_sample` for PPO, the pending state riding on the first round's requests.

        Returns the episodes, or through relays a reference to each relay's episodes, and the runners' metrics."""
        state: Optional[Any] = ray.put({**(self._state_for_runners or {}),
                                        NUM_ENV_STEPS_SAMPLED_LIFETIME: self._env_steps_lifetime()})
        self._state_for_runners = None
        relay_size = getattr(self.config, "lean_ppo_runners_per_relay", 0)
        through_relays = 0 < relay_size < self.env_runner_group.num_remote_env_runners()
        episodes: list = []
        runner_metrics: list[dict] = []
        steps = 0
        while steps < self.config.total_train_batch_size:
            if through_relays:
                round_episodes, round_metrics = self._sample_through_relays(state, relay_size)
            else:
                results = self.env_runner_group.foreach_env_runner(
                    sample_with_state, kwargs={"state": state}, local_env_runner=False,
                    timeout_seconds=self.config.sample_timeout_s)
                round_episodes = list(chain.from_iterable(fragment for fragment, _ in results))
                round_metrics = [metrics for _, metrics in results]
            state = None  # a second round (a runner failed or timed out) samples on the state already sent
            if not round_metrics or self.env_runner_group.num_healthy_remote_workers() <= 0:
                break
            episodes += round_episodes
            runner_metrics += round_metrics
            round_steps = sum(int(metrics.get(NUM_ENV_STEPS_SAMPLED, 0)) for metrics in round_metrics)
            steps += round_steps
            if not round_steps:  # runners with nothing to give before the next update (simulators outside Ray)
                break
        return episodes, runner_metrics

    def _sample_through_relays(self, state: Optional[Any], relay_size: int) -> tuple[list[ray.ObjectRef], list[dict]]:
        """One round of sample requests through the relays: a reference to each relay's episodes, and the metrics of
        every runner that answered in runner order, as RLlib's `foreach_env_runner` gives them. A runner whose
        request failed, or whose relay died, is taken out of service as there (RLlib's probe restores it); one
        that did not answer in time counts as dropped."""
        group = self.env_runner_group
        healthy = set(group.healthy_env_runner_ids())
        timeout = self.config.sample_timeout_s
        asked = [(relay, [i for i in ids if i in healthy]) for relay, ids in self._relays_for_runners(relay_size)]
        calls = {relay.sample.remote([state], ids, timeout): (relay, ids) for relay, ids in asked if ids}
        if not calls:  # no healthy runner: nothing this round, as RLlib's `foreach_env_runner` gives nothing
            return [], []
        ready = set(ray.wait(list(calls), num_returns=len(calls), fetch_local=True,
                             timeout=None if timeout is None else timeout + RELAY_MARGIN_S)[0])
        episodes: list[ray.ObjectRef] = []
        replies: list[RunnerReply] = []
        for call, (_, ids) in calls.items():
            if call not in ready:  # stuck: its runners count as timed out, and it is replaced
                self._retire_relays()
                continue
            try:
                relay_episodes, relay_replies = ray.get(call)
            except RayActorError as exc:  # the relay is gone (its node, most likely), and maybe its runners
                self._retire_relays()
                replies += [(i, None, f"the relay of runners {ids} died: {exc}") for i in ids]
                continue
            episodes += [relay_episodes] if relay_episodes is not None else []
            replies += relay_replies
        _count_dropped(group, sum(len(ids) for ids in calls.values()) - len(replies))
        metrics: list[dict] = []
        manager = _runner_manager(group)
        for runner_id, runner_metrics, error in sorted(replies, key=lambda reply: reply[0]):
            if error is None and runner_metrics is not None:
                metrics.append(runner_metrics)
                continue
            manager.set_actor_state(runner_id, healthy=False)
            if not (self.config.ignore_env_runner_failures or self.config.restart_failed_env_runners):
                raise RuntimeError(f"env runner {runner_id} failed: {error}")
        return episodes, metrics

    def _relays_for_runners(self, relay_size: int) -> list[tuple[Any, list[int]]]:
        """The relays for the current runner handles: one per group of at most `relay_size` runners on a node,
        asked to run on that node; built again when RLlib replaces a runner."""
        actors = dict(_runner_handles(_runner_manager(self.env_runner_group)))
        built_for = self._relays_for or {}
        if actors.keys() == built_for.keys() and all(actors[i] is built_for[i] for i in actors):
            return self._relays
        self._retire_relays()
        relays = []
        for node, ids in sorted(_ids_by_node(_nodes_of(actors)).items()):
            for group in _split(ids, relay_size):
                relay = SampleRelay.options(  # type: ignore[attr-defined]
                    scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=True) if node else "DEFAULT",
                ).remote({i: actors[i] for i in group})
                relays.append((relay, group))
        relays.sort(key=lambda relay: relay[1][0])  # the episodes in runner order, where each node's runners are a run
        self._relays, self._relays_for = relays, actors
        return relays

    def _retire_relays(self) -> None:
        """Replace the relays at the next round; the old ones are stopped after the update (their episodes)."""
        self._retired_relays = self._retired_relays + [relay for relay, _ in self._relays]
        self._relays, self._relays_for = [], None

    def _stop_retired_relays(self) -> None:
        for relay in self._retired_relays:
            ray.kill(relay)
        self._retired_relays = []

    def cleanup(self) -> None:
        self._retire_relays()
        self._stop_retired_relays()
        super().cleanup()

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


def _training_data(episodes: list, num_learners: int) -> dict[str, list]:
    """The update's data: references go to one learner as they are (it fetches the episodes), and are fetched here
    for several, which RLlib shards by env steps (sharded by reference, their minibatch counts could differ)."""
    if not episodes or not isinstance(episodes[0], ray.ObjectRef):
        return {"episodes": episodes}
    if num_learners <= 1:
        return {"episodes_refs": episodes}
    return {"episodes": list(chain.from_iterable(ray.get(episodes)))}


def _runner_manager(group: EnvRunnerGroup) -> FaultTolerantActorManager:
    """RLlib's manager of the remote runners: `set_actor_state` takes a runner out of service (a DeveloperAPI)."""
    return group._worker_manager


def _runner_handles(manager: FaultTolerantActorManager) -> dict[int, Any]:
    """The remote runners' handles by id, the ones RLlib's own requests go to."""
    return manager._actors


def _count_dropped(group: EnvRunnerGroup, dropped: int) -> None:
    """RLlib's count of runners that did not answer a sample request in time (`num_env_runners_dropped_lifetime`)."""
    if dropped > 0:
        group._num_env_runners_dropped_lifetime += dropped


def _nodes_of(actors: dict[int, Any]) -> dict[int, Optional[str]]:
    """Each runner's node id; None for a runner that did not answer within NODE_LOOKUP_S (its relay goes where Ray
    puts it)."""
    calls = {handle.apply.remote(node_of_runner): runner_id for runner_id, handle in actors.items()}
    ready, _ = ray.wait(list(calls), num_returns=len(calls), timeout=NODE_LOOKUP_S)
    nodes: dict[int, Optional[str]] = dict.fromkeys(calls.values())
    for call in ready:
        try:
            nodes[calls[call]] = ray.get(call)
        except RayError:
            pass
    return nodes


def _ids_by_node(nodes: dict[int, Optional[str]]) -> dict[str, list[int]]:
    by_node: dict[str, list[int]] = defaultdict(list)
    for runner_id, node in sorted(nodes.items()):
        by_node[node or ""].append(runner_id)
    return by_node


def _split(ids: list[int], size: int) -> list[list[int]]:
    """`ids` (sorted) in as few runs of at most `size` as there can be, their sizes within one of each other."""
    groups = math.ceil(len(ids) / size)
    bounds = [len(ids) * i // groups for i in range(groups + 1)]
    return [ids[start:end] for start, end in zip(bounds, bounds[1:])]

"""RLlib's SingleAgentEnvRunner with its per-step connector pipelines done as a few array operations.

RLlib runs two connector pipelines per vector-env step (env-to-module: 5 connectors, module-to-env:
6), toggles the module between train and eval mode around every forward pass, and calls the
per-episode callbacks for every sub-env on every step. On a cheap env that costs far more than the
env itself (profiled on CartPole, 8 envs: 4.9 of 8.2 s in connectors, 0.8 s in mode toggles, 0.9 s
in the env). When the pipelines are RLlib's defaults, what they compute for a stateless module on a
Box observation space is: observations -> tensor, forward pass, sample from the action distribution
(+ log-prob), tensors -> numpy, unsquash/clip Box actions. This runner does exactly that on the
batch, and keeps everything else RLlib's own: the episodes, their cutting into chunks, the callbacks
(`on_episode_step` only when one is configured), metrics, weights and state.

Anything else (custom connectors, stateful modules, nested spaces, GPU runners, random actions,
sampling whole episodes for evaluation) takes RLlib's path unchanged.

On every path, episode callbacks run only for events something listens to, and a remote runner
returns its episodes as `PackedEpisodes` (internals/episode_transport.py), which Ray pickles column by column.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

import gymnasium as gym
import numpy as np
import ray
from ray.rllib.callbacks.callbacks import RLlibCallback
from ray.rllib.core import COMPONENT_RL_MODULE
from ray.rllib.core.columns import Columns
from ray.rllib.env.env_errors import StepFailedRecreateEnvError
from ray.rllib.env.env_runner import ENV_STEP_FAILURE, NUM_ENV_STEP_FAILURES_LIFETIME
from ray.rllib.env.single_agent_env_runner import SingleAgentEnvRunner
from ray.rllib.utils.metrics import ENV_STEP_TIMER, WEIGHTS_SEQ_NO
from ray.rllib.utils.spaces.space_utils import clip_action, unsquash_action

from rlplatform.internals import WEIGHTS_APPLY_S, install_in_process
from rlplatform.internals.columnar_fragment import AT_FRAGMENT_END, ColumnarFragments, FragmentEpisodes, metrics_shell
from rlplatform.internals.episode_transport import PackedEpisodes

if TYPE_CHECKING:
    import torch

RLLIB_LOGGER = logging.getLogger("ray.rllib.env.env_runner")  # where RLlib's `_try_env_step` logs a failed step
DEFAULT_ENV_TO_MODULE = ("AddObservationsFromEpisodesToBatch", "AddTimeDimToBatchAndZeroPad",
                         "AddStatesFromEpisodesToBatch", "BatchIndividualItems", "NumpyToTensor")
DEFAULT_MODULE_TO_ENV = ("GetActions", "TensorToNumpy", "UnBatchToIndividualItems", "RemoveSingleTsTimeRankFromBatch",
                         "NormalizeAndClipActions", "ListifyDataForVectorEnv")
EPISODE_EVENTS = ("on_episode_created", "on_episode_start", "on_episode_step", "on_episode_end")
LEAN_ACTION_SPACES = (gym.spaces.Discrete, gym.spaces.Box, gym.spaces.MultiDiscrete)


class LeanEnvRunner(SingleAgentEnvRunner):
    _ongoing_episodes: list[Any]  # SingleAgentEnvRunner's (an annotation only: no class attribute)

    def __init__(self, *args: Any, **kwargs: Any):
        install_in_process()  # before EnvRunner.__init__ seeds torch and builds the connector pipelines
        super().__init__(*args, **kwargs)
        if self.worker_index > 0 and not self._torch_free():  # the local runner lives in the main process
            import torch

            # As many torch threads as CPUs this actor reserved: no oversubscription (torch takes every core).
            torch.set_num_threads(max(1, int(self.config.num_cpus_per_env_runner)))
        self.lean = self.env is not None and lean_path_applies(self)
        self._heard_episode_events = {event for event in EPISODE_EVENTS if self._someone_listens(event)}
        self._next_obs: Optional[np.ndarray] = None  # the batch the next actions are computed from
        self._fragments = (ColumnarFragments(self.env.single_observation_space, self.env.single_action_space)
                           if self.lean and columnar_applies(self) else None)

    def _torch_free(self) -> bool:
        """Whether this runner computes actions without torch (SlimEnvRunner's numpy policy)."""
        return False

    def set_state(self, state: dict) -> None:
        """RLlib's, timing the weights' arrival (the object-store fetch included) into the metrics."""
        if COMPONENT_RL_MODULE not in state:
            super().set_state(state)
            return
        start = time.perf_counter()
        if isinstance(state[COMPONENT_RL_MODULE], ray.ObjectRef):
            state = {**state, COMPONENT_RL_MODULE: ray.get(state[COMPONENT_RL_MODULE])}
        super().set_state(state)
        self.metrics.log_value(WEIGHTS_APPLY_S, time.perf_counter() - start, reduce="max")

    def _someone_listens(self, event: str) -> bool:
        """A callback function is configured for the event, or a callback object overrides RLlib's no-op method."""
        return getattr(self.config, f"callbacks_{event}") is not None or any(
            getattr(type(c), event) is not getattr(RLlibCallback, event) for c in self._callbacks
        )

    def _make_on_episode_callback(self, which: str, idx: int, episodes: list) -> None:
        # RLlib builds the arguments and walks the callback lists three times per episode even when nothing
        # listens: 5 % of a 64-env runner's time on CartPole.
        heard = getattr(self, "_heard_episode_events", None)  # None while RLlib's __init__ runs
        if heard is None or which in heard:
            super()._make_on_episode_callback(which, idx, episodes)

    def sample(self, **kwargs: Any) -> list:
        episodes = super().sample(**kwargs)
        # A remote runner's episodes are pickled on their way out; packed, that costs a fifth as much.
        # A columnar fragment's episodes pickle as the fragment's columns already.
        if self.worker_index == 0:
            return episodes
        if isinstance(episodes, FragmentEpisodes) and not self._someone_listens("on_sample_end"):
            return episodes
        return PackedEpisodes(episodes)

    def _sample(self, *, num_timesteps: Optional[int] = None, num_episodes: Optional[int] = None, explore: bool,
                random_actions: bool = False, force_reset: bool = False) -> list:
        if not self.lean or random_actions or num_timesteps is None:
            # RLlib's path needs its cached connector output, which this runner's array path does not keep.
            stale = self._next_obs is not None
            self._next_obs = None
            return super()._sample(num_timesteps=num_timesteps, num_episodes=num_episodes, explore=explore,
                                   random_actions=random_actions, force_reset=force_reset or stale)
        if self._fragments is not None:
            return self._sample_columnar(self._fragments, num_timesteps, explore, force_reset)
        return self._sample_lean(num_timesteps, explore, force_reset)

    def _sample_columnar(self, fragments: ColumnarFragments, num_timesteps: int, explore: bool, force_reset: bool) -> list:
        """The array path, with the fragment's steps kept as arrays and cut into episodes at its end
        (internals/columnar_fragment.py) instead of added to episode objects step by step."""
        if force_reset or self._needs_initial_reset or self._next_obs is None:
            self._reset_lean(explore)
            fragments.start(self._ongoing_episodes)
        assert self._next_obs is not None  # set by _reset_lean
        fragments.begin()
        self.module.eval()
        before_failure: list[tuple[int, Any]] = []  # episodes that ended before an env step failed
        step_times = StepTimes()  # for RLlib's env-step timer and counter, logged even if a step raises
        ts, runners = 0, self.config.num_env_runners or 1
        try:
            while ts < num_timesteps:
                t = (self.num_env_steps_sampled_lifetime // runners + ts) * runners
                to_env = self._compute_actions(self._next_obs, explore, t)
                actions = to_env.pop(Columns.ACTIONS)
                results = _timed_env_step(self, self._actions_for_env(actions), step_times)
                if results == ENV_STEP_FAILURE:  # as RLlib does: keep the finished episodes, reset everything, go on
                    finished_before = fragments.finish({WEIGHTS_SEQ_NO: self._weights_seq_no})[0]
                    self._episodes_ended(finished_before)  # before the reset forgets their earlier chunks
                    before_failure += finished_before
                    ts = 0
                    self._reset_lean(explore)
                    fragments.start(self._ongoing_episodes)
                    fragments.begin()
                    continue
                observations, rewards, terminateds, truncateds, infos = results
                ts += fragments.add(actions, to_env, observations, rewards, terminateds, truncateds, infos)
                self._next_obs = observations
        finally:
            _log_env_step_times(self, step_times)
        finished, fragment_episodes = fragments.finish({WEIGHTS_SEQ_NO: self._weights_seq_no})
        self._episodes_ended(finished)
        chunks = fragment_episodes[len(finished):]
        episodes: list = fragment_episodes
        if before_failure:
            finished = before_failure + finished
            episodes = [episode for _, episode in finished] + chunks
        # What RLlib's metrics keep of each episode until `get_metrics`, without the fragment's arrays.
        self._done_episodes_for_metrics.extend(metrics_shell(episode) for _, episode in finished)
        for chunk in chunks:
            self._ongoing_episodes_for_metrics[chunk.id_].append(metrics_shell(chunk))
        self._log_env_steps(metric=self._metrics_num_env_steps_sampled, num_steps=ts)
        self._increase_sampled_metrics(ts, len(finished))
        return episodes

    def _episodes_ended(self, finished: list[tuple[int, Any]]) -> None:
        """on_episode_end for each finished episode (sub-env index, episode), where something listens."""
        if "on_episode_end" in self._heard_episode_events:
            for i, episode in finished:
                self._make_on_episode_callback("on_episode_end", i, {i: episode})  # type: ignore[arg-type]  # indexed only

    def _sample_lean(self, num_timesteps: int, explore: bool, force_reset: bool) -> list:
        if force_reset or self._needs_initial_reset or self._next_obs is None:
            self._reset_lean(explore)
        assert self._next_obs is not None  # set by _reset_lean
        self.module.eval()  # once per fragment, not around every forward pass as RLlib does
        episodes, done_episodes, ts = self._ongoing_episodes, [], 0
        runners = self.config.num_env_runners or 1
        while ts < num_timesteps:
            t = (self.num_env_steps_sampled_lifetime // runners + ts) * runners
            to_env = self._compute_actions(self._next_obs, explore, t)
            actions = to_env.pop(Columns.ACTIONS)
            results = self._try_env_step(self._actions_for_env(actions))
            if results == ENV_STEP_FAILURE:  # as RLlib does: reset everything and go on
                ts = 0
                self._reset_lean(explore)
                episodes = self._ongoing_episodes  # the reset made new ones
                continue
            observations, rewards, terminateds, truncateds, infos = results
            for i, episode in enumerate(episodes):
                if not episode.is_reset:  # the vector env reset this sub-env on this step
                    episode.add_env_reset(observation=observations[i], infos=infos[i])
                    self._make_on_episode_callback("on_episode_start", i, episodes)
                    continue
                ts += 1
                extra = {k: v[i] for k, v in to_env.items()}
                extra[WEIGHTS_SEQ_NO] = self._weights_seq_no
                episode.add_env_step(observation=observations[i], action=actions[i], reward=rewards[i], infos=infos[i],
                                     terminated=terminateds[i], truncated=truncateds[i], extra_model_outputs=extra)
                if "on_episode_step" in self._heard_episode_events:  # checked here: saves a call per env step
                    self._make_on_episode_callback("on_episode_step", i, episodes)
                if episode.is_done:
                    self._make_on_episode_callback("on_episode_end", i, episodes)
                    done_episodes.append(episode.to_numpy() if self.episodes_to_numpy else episode)
                    self._new_episode(i, episodes)
            self._next_obs = observations
        return self._finish_fragment(done_episodes, ts)

    def _reset_lean(self, explore: bool) -> None:
        self._reset_envs_and_episodes(explore)
        self._cached_to_module = None
        self._next_obs = np.stack([e.get_observations(-1) for e in self._ongoing_episodes])

    def _compute_actions(self, observations: np.ndarray, explore: bool, t: int) -> dict[str, np.ndarray]:
        """What RLlib's default env-to-module pipeline, forward pass and GetActions/TensorToNumpy produce."""
        import torch
        from ray.rllib.core.distribution.torch.torch_distribution import TorchCategorical

        module = self.module
        obs = torch.from_numpy(np.asarray(observations))
        if obs.is_floating_point() and obs.dtype != torch.float16:  # as RLlib's NumpyToTensor does
            obs = obs.float()
        batch = {Columns.OBS: obs}
        with torch.no_grad():
            out = module._forward_exploration(batch, t=t) if explore else module._forward_inference(batch)
            if Columns.ACTIONS not in out:
                dist_cls = module.get_exploration_action_dist_cls() if explore else module.get_inference_action_dist_cls()
                if dist_cls is TorchCategorical:
                    out.update(_categorical_actions(out[Columns.ACTION_DIST_INPUTS], explore))
                else:
                    dist = dist_cls.from_logits(out[Columns.ACTION_DIST_INPUTS])
                    if not explore:
                        dist = dist.to_deterministic()
                    out[Columns.ACTIONS] = dist.sample()
                    out.setdefault(Columns.ACTION_LOGP, dist.logp(out[Columns.ACTIONS]))
        return {k: v.numpy() if isinstance(v, torch.Tensor) else v for k, v in out.items()}

    def _actions_for_env(self, actions: np.ndarray) -> np.ndarray:
        """RLlib's NormalizeAndClipActions: Box actions unsquashed from [-1, 1] (which clips), or clipped."""
        space = self.env.single_action_space
        if not isinstance(space, gym.spaces.Box):
            return actions
        if self.config.normalize_actions:
            return unsquash_action(actions, space)
        if self.config.clip_actions:
            return clip_action(actions, space)
        return actions

    def _finish_fragment(self, done_episodes: list, ts: int) -> list:
        """RLlib's end of `_sample(num_timesteps=...)`: cut the ongoing episodes, return done + chunks, count."""
        self._done_episodes_for_metrics.extend(done_episodes)
        chunks = []
        continuations = [e.cut(len_lookback_buffer=self.config.episode_lookback_horizon) for e in self._ongoing_episodes]
        for episode in self._ongoing_episodes:
            if episode.t == 0:
                continue
            episode.validate()
            self._ongoing_episodes_for_metrics[episode.id_].append(episode)
            chunks.append(episode.to_numpy() if self.episodes_to_numpy else episode)
        self._ongoing_episodes = continuations
        self._log_env_steps(metric=self._metrics_num_env_steps_sampled, num_steps=ts)
        self._increase_sampled_metrics(ts, len(done_episodes))
        return done_episodes + chunks


@dataclass
class StepTimes:
    """A fragment's vector steps as RLlib's `_try_env_step` logs them: every step's time, a failed one's too, for the
    env-step timer (its `log_time` block pushes on the way out either way), and how many succeeded, for the
    Prometheus counter of env steps tried."""

    seconds: list[float] = field(default_factory=list)
    succeeded: int = 0


def _timed_env_step(runner: SingleAgentEnvRunner, actions: Any, times: StepTimes) -> Any:
    """RLlib's `_try_env_step`, with its timer and step counter left to the fragment's end (`_log_env_step_times`):
    per vector step they cost a context manager, a metrics-logger lookup and a Prometheus counter call (~3 % of a
    CartPole runner). A function, not a method: Ray wraps an actor's methods for tracing."""
    start = time.perf_counter()
    try:
        results = runner.env.step(actions)
    except Exception as error:
        times.seconds.append(time.perf_counter() - start)
        return _env_step_failed(runner, error)
    times.seconds.append(time.perf_counter() - start)
    times.succeeded += 1
    return results


def _log_env_step_times(runner: SingleAgentEnvRunner, times: StepTimes) -> None:
    """What RLlib's `_try_env_step` logs per vector step, for a fragment's steps: each step's time pushed, in
    order, into the same EMA timer, and the Prometheus count of env steps tried raised by the ones that succeeded."""
    if times.seconds:
        timer = runner.metrics.log_time(ENV_STEP_TIMER)  # the timer's stats object, created as RLlib's with-block does
        for seconds in times.seconds:
            timer.push(seconds)
    if times.succeeded:
        runner._log_env_steps(metric=runner._metrics_num_try_env_step, num_steps=times.succeeded)


def _env_step_failed(runner: SingleAgentEnvRunner, error: Exception) -> Any:
    """RLlib's `_try_env_step` when the step raised (env_runner.py), called while the error is handled: counted,
    logged, then the env recreated (the caller resets and starts over) or the error raised, as
    `restart_failed_sub_environments` says."""
    runner.metrics.log_value(NUM_ENV_STEP_FAILURES_LIFETIME, 1, reduce="lifetime_sum")
    name = type(runner).__name__
    if not runner.config.restart_failed_sub_environments:
        RLLIB_LOGGER.exception(
            f"RLlib {name}: Environment step failed and 'config.restart_failed_sub_environments' is False. This env "
            "will not be recreated. Consider setting 'fault_tolerance(restart_failed_sub_environments=True)' in your "
            f"AlgorithmConfig in order to automatically re-create and force-reset an env.The original error type: "
            f"{type(error)}. {error}")
        raise RuntimeError from error
    if not isinstance(error, StepFailedRecreateEnvError):
        RLLIB_LOGGER.exception(f"RLlib {name}: Environment step failed. Will force reset env(s) in this EnvRunner. "
                               f"The original error is: {error}")
    runner.make_env()
    return ENV_STEP_FAILURE


def _categorical_actions(logits: "torch.Tensor", explore: bool) -> dict[str, "torch.Tensor"]:
    """TorchCategorical's sample (or its deterministic argmax) and log-prob, without building a
    torch.distributions object per step (a third of the array path's time on CartPole)."""
    import torch

    if not explore:  # TorchDeterministic: argmax, and a log-prob of zeros
        actions = logits.argmax(dim=-1)
        return {Columns.ACTIONS: actions, Columns.ACTION_LOGP: torch.zeros_like(actions)}
    logp_all = torch.log_softmax(logits, dim=-1)
    actions = torch.multinomial(logp_all.exp(), 1).squeeze(-1)
    return {Columns.ACTIONS: actions, Columns.ACTION_LOGP: logp_all.gather(-1, actions.unsqueeze(-1)).squeeze(-1)}


def columnar_applies(runner: LeanEnvRunner) -> bool:
    """Episodes built at the fragment's end come out as the per-step path's would (columnar_fragment.py's assumptions)."""
    return (
        runner.episodes_to_numpy
        and runner.config.episode_lookback_horizon == 1
        and runner.env.metadata.get("autoreset_mode") == gym.vector.AutoresetMode.NEXT_STEP
        and runner._heard_episode_events <= {"on_episode_end"}
        and _end_callbacks_run_at_fragment_end(runner)
    )


def _end_callbacks_run_at_fragment_end(runner: LeanEnvRunner) -> bool:
    if any(type(c).on_episode_end is not RLlibCallback.on_episode_end for c in runner._callbacks):
        return False
    functions = runner.config.callbacks_on_episode_end
    functions = functions if isinstance(functions, (list, tuple)) else [functions] if functions else []
    return all(getattr(f, AT_FRAGMENT_END, False) for f in functions)


def lean_path_applies(runner: SingleAgentEnvRunner) -> bool:
    """The array path (`self.lean`) computes exactly what RLlib's default pipelines would, and only then is used."""
    module = runner.module
    return (
        module is not None
        and not module.is_stateful()
        and not runner.config.num_gpus_per_env_runner
        and isinstance(runner.env.single_observation_space, gym.spaces.Box)
        and isinstance(runner.env.single_action_space, LEAN_ACTION_SPACES)
        and tuple(type(c).__name__ for c in runner._env_to_module.connectors) == DEFAULT_ENV_TO_MODULE
        and tuple(type(c).__name__ for c in runner._module_to_env.connectors) == DEFAULT_MODULE_TO_ENV
    )

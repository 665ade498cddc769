"""DQN and SAC at the speed of their update: the flat replay buffer, one learner call per training step, lean losses.

RLlib's off-policy training step samples, adds episodes to an `EpisodeReplayBuffer`, and then for
each of its k updates draws a list of one-step episodes, hands them to `LearnerGroup.update`, whose
learner connector pipeline turns them back into a batch, and the learner logs a dozen metrics through
tree walks, takes one backward pass per optimizer (SAC: four, with `retain_graph`), toggles
`requires_grad` on every critic parameter and rebuilds the target networks' state dicts. On a CPU that
is 40-130 ms per update where the update's own arithmetic is a few ms.

`LeanDQN` and `LeanSAC` (RLlib's algorithms, subclassed through `training_step`) sample the same way,
add the fragments to the `FlatReplayBuffer` (n-step targets computed once, on insertion), draw the k
minibatches of the step in one go as flat arrays and pass them to the learners in ONE
`LearnerGroup.update(batch=...)` (no connector: a batch is already a batch), which runs the k
gradient steps on slices of it. Same sampling, same training intensity, same target-network schedule
(RLlib updates targets at most once per training step; so does this), same priorities for
prioritized replay (updated after the step's k updates, from their TD errors, where RLlib updates
after each; the k minibatches of a step are drawn with the priorities of its start).

The learners' losses are RLlib's (DQN with `num_atoms == 1`; SAC with a Box action space), computed
by the same module calls in the same order, so that on the same batch, weights and random seed the
losses and gradients are RLlib's (tests/test_lean_off_policy.py). What changes is around them: one
backward pass for the critics and temperature and one for the actor (gradients w.r.t. the actor's
parameters only, which is what RLlib's `requires_grad` toggling achieves), fused Adam, statistics
computed once per update from the last minibatch (RLlib logs them with `window=1`, which keeps only
the last anyway), and targets updated in place with `torch._foreach_lerp_`.

Anything else (distributional DQN, discrete SAC, stateful models, several learners, multi-agent)
takes RLlib's own path, unchanged.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import gymnasium as gym
import numpy as np
import torch
from ray.rllib.algorithms.dqn.dqn import DQN, calculate_rr_weights
from ray.rllib.algorithms.dqn.dqn_learner import (
    LAST_TARGET_UPDATE_TS,
    NUM_TARGET_UPDATES,
    QF_LOSS_KEY,
    QF_MAX_KEY,
    QF_MEAN_KEY,
    QF_MIN_KEY,
    QF_PREDS,
    TD_ERROR_MEAN_KEY,
)
from ray.rllib.algorithms.dqn.torch.dqn_torch_learner import DQNTorchLearner
from ray.rllib.algorithms.sac.sac import SAC
from ray.rllib.algorithms.sac.sac_learner import LOGPS_KEY, QF_TWIN_LOSS_KEY
from ray.rllib.algorithms.sac.torch.sac_torch_learner import SACTorchLearner
from ray.rllib.core import DEFAULT_MODULE_ID
from ray.rllib.core.columns import Columns
from ray.rllib.core.learner.learner import POLICY_LOSS_KEY, Learner
from ray.rllib.core.models.base import ENCODER_OUT
from ray.rllib.core.rl_module.apis import TargetNetworkAPI
from ray.rllib.execution.rollout_ops import synchronous_parallel_sample
from ray.rllib.policy.sample_batch import MultiAgentBatch, SampleBatch
from ray.rllib.utils.metrics import (
    ALL_MODULES,
    ENV_RUNNER_RESULTS,
    ENV_RUNNER_SAMPLING_TIMER,
    LEARNER_RESULTS,
    LEARNER_UPDATE_TIMER,
    NUM_AGENT_STEPS_SAMPLED_LIFETIME,
    NUM_ENV_STEPS_SAMPLED_LIFETIME,
    REPLAY_BUFFER_ADD_DATA_TIMER,
    REPLAY_BUFFER_RESULTS,
    REPLAY_BUFFER_SAMPLE_TIMER,
    REPLAY_BUFFER_UPDATE_PRIOS_TIMER,
    SYNCH_WORKER_WEIGHTS_TIMER,
    TD_ERROR_KEY,
    TIMERS,
)
from ray.rllib.utils.numpy import convert_to_numpy

from rlplatform.internals.flat_replay_buffer import FlatReplayBuffer
from rlplatform.internals.lean_learner import (
    EagerAdam,
    LeanUpdate,
    _fused_adam_supported,
    clip_per_optimizer,
    foreach_clip_applies,
)

FLAT_BUFFER_FOR = {"EpisodeReplayBuffer": False, "PrioritizedEpisodeReplayBuffer": True}  # RLlib type -> prioritized
_COLUMNS = {"obs": Columns.OBS, "new_obs": Columns.NEXT_OBS, "actions": Columns.ACTIONS, "rewards": Columns.REWARDS,
            "terminateds": Columns.TERMINATEDS, "n_step": "n_step", "weights": "weights"}


def rows_to_batch(rows: dict[str, Any], env_steps: int) -> MultiAgentBatch:
    """Rows sampled from the flat buffer as the one-module `MultiAgentBatch` a learner updates on."""
    return MultiAgentBatch({DEFAULT_MODULE_ID: SampleBatch({_COLUMNS[k]: v for k, v in rows.items()})}, env_steps=env_steps)


# ---- the training step ------------------------------------------------------------------------------
class LeanOffPolicyTraining:
    """Mixin for DQN and SAC (first in the bases): RLlib's training step with the flat buffer.

    RLlib's new API stack leaves replay buffers out of checkpoints (`store_buffer_in_checkpoints`
    is read by the old stack only); the flat buffer goes into the algorithm's state, so a resumed
    run continues with the experience it had.
    """

    BUFFER_STATE_KEY = "flat_replay_buffer"

    # What this mixin reads of the RLlib algorithm it is mixed into (annotations only: no class attributes).
    config: Any
    metrics: Any
    env_runner_group: Any
    learner_group: Any
    local_replay_buffer: Any
    _module_is_stateful: bool

    @property
    def saves_replay_buffer(self) -> bool:
        return isinstance(self.local_replay_buffer, FlatReplayBuffer) and bool(self.config.store_buffer_in_checkpoints)

    def get_state(self, *args, **kwargs) -> dict:
        state = super().get_state(*args, **kwargs)  # type: ignore[misc]  # mixin: on the RLlib class in the MRO
        if self.saves_replay_buffer and not kwargs.get("components"):
            state[self.BUFFER_STATE_KEY] = self.local_replay_buffer.get_state()
        return state

    def set_state(self, state: dict) -> None:
        super().set_state(state)  # type: ignore[misc]  # mixin: on the RLlib class in the MRO
        if self.BUFFER_STATE_KEY in state and isinstance(self.local_replay_buffer, FlatReplayBuffer):
            self.local_replay_buffer.set_state(state[self.BUFFER_STATE_KEY])

    def _create_local_replay_buffer_if_necessary(self, config: Any) -> Any:
        """The flat buffer in place of RLlib's single-agent episode buffers, with their capacity and priorities."""
        settings = dict(config.get("replay_buffer_config") or {})
        kind = settings.get("type")
        if not isinstance(kind, str) or kind not in FLAT_BUFFER_FOR or not isinstance(config.n_step, int):
            return super()._create_local_replay_buffer_if_necessary(  # type: ignore[misc]  # mixin: on the RLlib class in the MRO
                config)
        return FlatReplayBuffer(
            capacity=int(settings.get("capacity", 100_000)),
            gamma=config.gamma,
            n_step=config.n_step,
            prioritized=FLAT_BUFFER_FOR[kind],
            alpha=settings.get("alpha", 0.6),
            beta=settings.get("beta", 0.4),
            seed=config.seed,
        )

    def training_step(self) -> None:
        if not isinstance(self.local_replay_buffer, FlatReplayBuffer) or self._module_is_stateful:
            return super().training_step()  # type: ignore[misc]  # mixin: on the RLlib class in the MRO
        store_weight, train_weight = calculate_rr_weights(self.config)
        for _ in range(store_weight):
            self._sample_into_buffer()
        env_steps = self.metrics.peek((ENV_RUNNER_RESULTS, NUM_ENV_STEPS_SAMPLED_LIFETIME), default=0)
        if self.config.count_steps_by == "agent_steps":
            current_ts = sum(self.metrics.peek((ENV_RUNNER_RESULTS, NUM_AGENT_STEPS_SAMPLED_LIFETIME),
                                               default={}).values())
        else:
            current_ts = env_steps
        if current_ts < self.config.num_steps_sampled_before_learning_starts or not len(self.local_replay_buffer):
            return
        learner_results = self._update_from_buffer(train_weight, env_steps)
        with self.metrics.log_time((TIMERS, SYNCH_WORKER_WEIGHTS_TIMER)):
            self.env_runner_group.sync_weights(
                from_worker_or_learner_group=self.learner_group,
                policies=set(learner_results[0].keys()) - {ALL_MODULES},
                global_vars=None,
                inference_only=True,
            )

    def _sample_into_buffer(self) -> None:
        with self.metrics.log_time((TIMERS, ENV_RUNNER_SAMPLING_TIMER)):
            episodes, env_runner_results = synchronous_parallel_sample(
                worker_set=self.env_runner_group,
                concat=True,
                sample_timeout_s=self.config.sample_timeout_s,
                _uses_new_env_runners=True,
                _return_metrics=True,
            )
        self.metrics.aggregate(env_runner_results, key=ENV_RUNNER_RESULTS)
        with self.metrics.log_time((TIMERS, REPLAY_BUFFER_ADD_DATA_TIMER)):
            self.local_replay_buffer.add(episodes)

    def _update_from_buffer(self, updates: int, env_steps: int) -> list:
        buffer: FlatReplayBuffer = self.local_replay_buffer
        size = self.config.total_train_batch_size
        timesteps = {
            NUM_ENV_STEPS_SAMPLED_LIFETIME: env_steps,
            NUM_AGENT_STEPS_SAMPLED_LIFETIME: self.metrics.peek(
                (ENV_RUNNER_RESULTS, NUM_AGENT_STEPS_SAMPLED_LIFETIME), default={}),
        }
        # One learner call for the step's k updates where one learner holds the whole batch; with
        # several learners each update is its own call, as each must be split across them.
        calls, per_call = (1, updates) if self.config.num_learners <= 1 else (updates, 1)
        results = []
        for _ in range(calls):
            with self.metrics.log_time((TIMERS, REPLAY_BUFFER_SAMPLE_TIMER)):
                rows = buffer.sample(size * per_call, beta=self.config.replay_buffer_config.get("beta"))
                batch = rows_to_batch(rows, size * per_call)
            with self.metrics.log_time((TIMERS, LEARNER_UPDATE_TIMER)):
                results = self.learner_group.update(
                    batch=batch, minibatch_size=self.config.train_batch_size_per_learner, timesteps=timesteps)
                td_errors = _pop_td_errors(results)
                self.metrics.aggregate(results, key=LEARNER_RESULTS)
            if buffer.prioritized and td_errors is not None:
                with self.metrics.log_time((TIMERS, REPLAY_BUFFER_UPDATE_PRIOS_TIMER)):
                    buffer.update_priorities(td_errors)
        for name, value in buffer.get_metrics().items():
            self.metrics.log_value((REPLAY_BUFFER_RESULTS, name), value, window=1)
        return results


def _pop_td_errors(learner_results: list) -> Optional[np.ndarray]:
    """What RLlib's step does with them: TD errors leave the results (too large to log)."""
    parts = []
    for result in learner_results:
        for module_results in result.values():
            if TD_ERROR_KEY in module_results:
                parts.append(np.asarray(convert_to_numpy(module_results.pop(TD_ERROR_KEY).peek())).reshape(-1))
    return np.concatenate(parts) if parts else None


class LeanDQN(LeanOffPolicyTraining, DQN):
    pass


class LeanSAC(LeanOffPolicyTraining, SAC):
    pass


LEAN_ALGORITHMS = {"DQN": LeanDQN, "SAC": LeanSAC}


# ---- the learners -----------------------------------------------------------------------------------
class LeanOffPolicyUpdate(LeanUpdate):
    """Mixin for the DQN and SAC torch learners: `update(batch=...)` of k stacked minibatches in one call."""

    # What this mixin reads of the RLlib learner it is mixed into, beyond LeanUpdate's (annotations only).
    device: Any
    last_update_ts_by_mid: Any
    TOTAL_LOSS_KEY: str
    _check_is_built: Any
    before_gradient_based_update: Any
    _log_steps_trained_metrics: Any
    postprocess_gradients: Any
    # ... and of the concrete learners below.
    lean_loss_and_gradients: Any
    _lean_loss_applies: Any

    def update(self, *args, **kwargs):
        batch, minibatch_size = _flat_batch(args, kwargs), kwargs.get("minibatch_size")
        module_id = self._flat_module_id(batch, minibatch_size)
        if module_id is None:
            if self.config.learner_config_dict.get("critic_loss", "huber") != "huber":
                # RLlib's own loss would train with its Huber loss without a word
                raise ValueError("training.critic_loss: this update goes to RLlib's own learner, which has only huber")
            return super().update(*args, **kwargs)
        return self._flat_update(module_id, batch, minibatch_size or len(batch), kwargs.get("timesteps") or {})

    def _flat_update(self, module_id: str, batch: MultiAgentBatch, minibatch_size: int, timesteps: dict):
        """k minibatches, each exactly as one RLlib `update` call of its own: before-update hooks, the
        gradient step, after-update hooks (where the target networks' schedule is checked)."""
        self._check_is_built()
        module_batch = batch.policy_batches[module_id]
        columns = {k: torch.as_tensor(np.asarray(v), device=self.device) for k, v in module_batch.items()}
        module = self.module[module_id].unwrapped()
        module.train()
        config = self.config.get_config_for_module(module_id)
        td_errors, stats, loss, norms = [], {}, None, {}
        last = len(module_batch) - minibatch_size
        for start in range(0, len(module_batch), minibatch_size):
            self.before_gradient_based_update(timesteps=timesteps)
            self._weights_seq_no += 1
            minibatch = {k: v[start: start + minibatch_size] for k, v in columns.items()}
            # RLlib logs each minibatch's statistics with a window of 1: only the last one's are reported.
            loss, stats, td_error, grads = self.lean_loss_and_gradients(module_id, module, config, minibatch,
                                                                        stats=start >= last)
            norms = self._gradient_step(module_id, config, grads)
            td_errors.append(td_error)
            self.after_gradient_based_update(timesteps=timesteps)
        with torch.no_grad():
            self.metrics.log_value((module_id, TD_ERROR_KEY), torch.cat(td_errors), reduce="item_series")
            for name, value in stats.items():
                self.metrics.log_value((module_id, name), value, window=1)
            for name, norm in norms.items():  # as RLlib's postprocess_gradients_for_module logs it, window 1
                self.metrics.log_value((module_id, f"gradients_{name}_global_norm"), norm, window=1)
            assert loss is not None  # at least one minibatch: torch.cat above refuses an empty list
            self.metrics.log_value((module_id, self.TOTAL_LOSS_KEY), loss.detach(), window=1)
        self._log_steps_trained_metrics(batch)
        return self.metrics.reduce()

    def _flat_module_id(self, batch: Optional[MultiAgentBatch], minibatch_size: Optional[int]) -> Optional[str]:
        """The module a flat replay batch is for, where the lean update applies; else None."""
        if batch is None or len(batch.policy_batches) != 1:
            return None
        (module_id, module_batch), = batch.policy_batches.items()
        if "weights" not in module_batch or module_id not in self.module:
            return None
        if minibatch_size and len(module_batch) % minibatch_size:
            return None
        if self._grad_scalers is not None or self._lr_scheduler_classes is not None:
            return None
        module = self.module[module_id].unwrapped()
        return module_id if self._lean_loss_applies(module, self.config.get_config_for_module(module_id)) else None

    def configure_optimizers(self) -> None:
        self.__dict__.pop("_lean_param_groups", None)
        super().configure_optimizers()  # type: ignore[misc]  # mixin: on the RLlib class in the MRO

    def _optimizer_params(self, module_id: str) -> dict[str, list]:
        """Each optimizer's parameters, in its registration order (cached: they are asked for every minibatch)."""
        cache = self.__dict__.setdefault("_lean_param_groups", {})
        if module_id not in cache:
            cache[module_id] = {name: list(self.filter_param_dict_for_optimizer(self._params, optimizer).values())
                                for name, optimizer in self.get_optimizers_for_module(module_id)}
        return cache[module_id]

    def _gradient_step(self, module_id: str, config: Any, grads: dict) -> dict[str, torch.Tensor]:
        """RLlib's `postprocess_gradients` and `apply_gradients`, with two changes that give the same numbers.

        Clipping by norm or global norm (DQN's default) takes a few foreach kernels per optimizer instead of
        several ops per gradient tensor (`clip_per_optimizer`), and returns each optimizer's global norm for the
        caller to log once per update (RLlib logs it with a window of 1 after every minibatch). Non-finite
        gradients are zeroed (RLlib's check, then `nan_to_num`): on a CPU learner only where the clipping's
        norms found one; elsewhere `nan_to_num` on every gradient (finite ones are unchanged), so that a GPU
        learner does not wait on the host for the check.
        """
        global_norms: dict[str, torch.Tensor] = {}
        finite = False
        if foreach_clip_applies(config):
            groups = {name: [grads[p] for p in params if p in grads] for name, params in self._optimizer_params(module_id).items()}
            global_norms, tensor_norms = clip_per_optimizer(config, groups)
            finite = self.device.type == "cpu" and (not tensor_norms or bool(torch.cat(tensor_norms).isfinite().all()))
        else:
            grads = self.postprocess_gradients(grads)
        zero_non_finite = not (self.config.torch_skip_nan_gradients or finite)
        for param, grad in grads.items():
            param.grad = torch.nan_to_num_(grad) if zero_non_finite else grad
        for optimizer_module, optimizer_names in self._module_optimizers.items():
            for name in optimizer_names:
                self.get_optimizer(optimizer_module, name).step()
        return global_norms

    def after_gradient_based_update(self, *, timesteps: dict) -> None:
        """DQNLearner's target-network schedule, the Polyak update done in place on the parameters."""
        Learner.after_gradient_based_update(self, timesteps=timesteps)
        timestep = timesteps.get(NUM_ENV_STEPS_SAMPLED_LIFETIME, 0)
        for module_id, module in self.module._rl_modules.items():
            config = self.config.get_config_for_module(module_id)
            unwrapped = module.unwrapped()
            if (timestep - self.last_update_ts_by_mid[module_id] < config.target_network_update_freq
                    or not isinstance(unwrapped, TargetNetworkAPI)):
                continue
            for main_net, target_net in unwrapped.get_target_network_pairs():
                _polyak(main_net, target_net, config.tau)
            self.metrics.log_value((module_id, NUM_TARGET_UPDATES), 1, reduce="lifetime_sum")
            self.last_update_ts_by_mid[module_id] = timestep
            self.metrics.log_value((module_id, LAST_TARGET_UPDATE_TS), timestep, reduce="max")


_DATA_FIELDS = ("batches", "batch_refs", "episodes", "episodes_refs", "data_iterators")


def _flat_batch(args: tuple, kwargs: dict) -> Optional[MultiAgentBatch]:
    """The MultiAgentBatch of an `update` call given only a batch (as such or in its TrainingData); else None."""
    if args or kwargs.get("num_epochs", 1) != 1 or kwargs.get("num_total_minibatches", 0):
        return None
    source = kwargs.get("training_data") or kwargs
    get = (lambda k: getattr(source, k, None)) if not isinstance(source, dict) else source.get
    if any(get(k) is not None for k in _DATA_FIELDS):
        return None
    batch = get("batch")
    return batch if isinstance(batch, MultiAgentBatch) else None


def _polyak(main_net: torch.nn.Module, target_net: torch.nn.Module, tau: float) -> None:
    """target <- tau * main + (1 - tau) * target, as RLlib's `update_target_network`, without state dicts."""
    if any(True for _ in target_net.buffers()):
        from ray.rllib.utils.torch_utils import update_target_network

        return update_target_network(main_net=main_net, target_net=target_net, tau=tau)
    with torch.no_grad():
        targets, mains = list(target_net.parameters()), list(main_net.parameters())
        if tau == 1.0:
            torch._foreach_copy_(targets, mains)
        else:
            torch._foreach_lerp_(targets, mains, tau)


class LeanDQNTorchLearner(LeanOffPolicyUpdate, DQNTorchLearner):
    @staticmethod
    def _lean_loss_applies(module: Any, config: Any) -> bool:
        return config.num_atoms == 1 and not module.is_stateful()

    def lean_loss_and_gradients(self, module_id: str, module: Any, config: Any, batch: dict, stats: bool = True):
        # RLlib's _forward_train runs the online network on [obs, next_obs] with gradients and the target
        # network with a graph nobody uses: 2B rows through the online network's backward pass. The same
        # values, with the next observations' passes out of autograd.
        actions, next_obs = batch[Columns.ACTIONS], {Columns.OBS: batch[Columns.NEXT_OBS]}
        q_selected = torch.nan_to_num(
            torch.gather(module.compute_q_values({Columns.OBS: batch[Columns.OBS]})[QF_PREDS], dim=-1,
                         index=actions.view(*actions.shape, 1).long()), neginf=0.0,
        ).squeeze(dim=-1)
        with torch.no_grad():
            q_target_next = module.forward_target(next_obs)[QF_PREDS]
            chooser = module.compute_q_values(next_obs)[QF_PREDS] if config.double_q else q_target_next
        q_next_best_idx = torch.argmax(chooser, dim=-1).unsqueeze(dim=-1).long()
        q_next_best = torch.nan_to_num(torch.gather(q_target_next, dim=-1, index=q_next_best_idx), neginf=0.0).squeeze()
        q_next_best_masked = (1.0 - batch[Columns.TERMINATEDS].float()) * q_next_best
        q_selected_target = (batch[Columns.REWARDS] + (config.gamma ** batch["n_step"]) * q_next_best_masked).detach()
        loss_fn = torch.nn.HuberLoss if config.td_error_loss_fn == "huber" else torch.nn.MSELoss
        td_error = torch.abs(q_selected - q_selected_target)
        total_loss = torch.mean(batch["weights"] * loss_fn(reduction="none")(q_selected, q_selected_target))
        params = [p for group in self._optimizer_params(module_id).values() for p in group]
        grads = torch.autograd.grad(total_loss, params, allow_unused=True)
        grads = {p: g for p, g in zip(params, grads) if g is not None}
        if not stats:
            return total_loss, {}, td_error.detach(), grads
        return total_loss, {QF_LOSS_KEY: total_loss.detach(), QF_MEAN_KEY: torch.mean(q_selected).detach(),
                            QF_MAX_KEY: torch.max(q_selected).detach(), QF_MIN_KEY: torch.min(q_selected).detach(),
                            TD_ERROR_MEAN_KEY: torch.mean(td_error).detach()}, td_error.detach(), grads


class LeanSACTorchLearner(LeanOffPolicyUpdate, SACTorchLearner):
    def configure_optimizers_for_module(self, module_id: str, config: Any = None) -> None:
        """RLlib's four Adams (eps 1e-7), run fused."""
        module = self._module[module_id]
        groups = {"qf": self.get_parameters(module.qf_encoder) + self.get_parameters(module.qf)}
        if config.twin_q:
            groups["qf_twin"] = self.get_parameters(module.qf_twin_encoder) + self.get_parameters(module.qf_twin)
        groups["policy"] = self.get_parameters(module.pi_encoder) + self.get_parameters(module.pi)
        groups["alpha"] = [self.curr_log_alpha[module_id]]
        if not all(_fused_adam_supported(params) for params in groups.values()):
            return SACTorchLearner.configure_optimizers_for_module(self, module_id, config)
        adam = torch.optim.Adam if self.config.torch_compile_learner else EagerAdam
        rates = {"qf": config.critic_lr, "qf_twin": config.critic_lr, "policy": config.actor_lr,
                 "alpha": config.alpha_lr}
        for name, params in groups.items():
            self.register_optimizer(module_id=module_id, optimizer_name=name, optimizer=adam(params, eps=1e-7, fused=True),
                                    params=params, lr_or_lr_schedule=rates[name])

    @staticmethod
    def _lean_loss_applies(module: Any, config: Any) -> bool:
        return isinstance(module.action_space, gym.spaces.Box) and not module.is_stateful()

    def lean_loss_and_gradients(self, module_id: str, module: Any, config: Any, batch: dict, stats: bool = True):
        # The forward pass of DefaultSACTorchRLModule._forward_train_continuous, op for op (and so
        # the same random draws), without toggling `requires_grad` on the critics around q_curr.
        obs, next_obs = batch[Columns.OBS], batch[Columns.NEXT_OBS]
        action_logits = module.pi(module.pi_encoder({Columns.OBS: obs})[ENCODER_OUT])
        action_logits_next = module.pi(module.pi_encoder({Columns.OBS: next_obs})[ENCODER_OUT])
        current = {Columns.OBS: obs, Columns.ACTIONS: batch[Columns.ACTIONS]}
        q_selected = module._qf_forward_train_helper(current, module.qf_encoder, module.qf)
        q_twin_selected = (module._qf_forward_train_helper(current, module.qf_twin_encoder, module.qf_twin)
                           if config.twin_q else None)
        dist_class = module.get_train_action_dist_cls()
        actions_resampled, logp_resampled = dist_class.from_logits(action_logits).rsample_and_logp()
        actions_next, logp_next = dist_class.from_logits(action_logits_next).sample_and_logp()
        q_curr = module.compute_q_values({Columns.OBS: obs, Columns.ACTIONS: actions_resampled})
        with torch.no_grad():
            q_target_next_raw = module.forward_target({Columns.OBS: next_obs, Columns.ACTIONS: actions_next.detach()})

        # SACTorchLearner._compute_loss_for_module_continuous.
        log_alpha = self.curr_log_alpha[module_id]
        alpha = torch.exp(log_alpha)
        q_target_next = q_target_next_raw - alpha.detach() * logp_next.detach()
        q_next_masked = (1.0 - batch[Columns.TERMINATEDS].float()) * q_target_next
        q_selected_target = (batch[Columns.REWARDS] + (config.gamma ** batch["n_step"]) * q_next_masked).detach()
        td_error = torch.abs(q_selected - q_selected_target)
        loss_fn = _critic_loss_fn(config.learner_config_dict.get("critic_loss", "huber"))
        critic_loss = torch.mean(batch["weights"] * loss_fn(q_selected, q_selected_target))
        critic_twin_loss = None
        if config.twin_q:
            td_error += torch.abs(q_twin_selected - q_selected_target)
            td_error *= 0.5
            critic_twin_loss = torch.mean(batch["weights"] * loss_fn(q_twin_selected, q_selected_target))
        actor_loss = torch.mean(alpha.detach() * logp_resampled - q_curr)
        alpha_loss = -torch.mean(log_alpha * (logp_resampled.detach() + self.target_entropy[module_id]))
        total_loss = actor_loss + critic_loss + alpha_loss + (critic_twin_loss if config.twin_q else 0.0)

        groups = self._optimizer_params(module_id)
        actor_params = groups["policy"]
        others = [p for name, params in groups.items() if name != "policy" for p in params]
        rest_loss = critic_loss + alpha_loss + (critic_twin_loss if config.twin_q else 0.0)
        grads = dict(zip(actor_params, torch.autograd.grad(actor_loss, actor_params, retain_graph=True)))
        grads.update(zip(others, torch.autograd.grad(rest_loss, others)))

        if not stats:
            return total_loss, {}, td_error.detach(), grads
        stats_of = {POLICY_LOSS_KEY: actor_loss.detach(), QF_LOSS_KEY: critic_loss.detach(),
                    "alpha_loss": alpha_loss.detach(), "alpha_value": alpha[0].detach(),
                    "log_alpha_value": torch.log(alpha)[0].detach(), "target_entropy": self.target_entropy[module_id],
                    LOGPS_KEY: torch.mean(logp_resampled).detach(), QF_MEAN_KEY: torch.mean(q_curr).detach(),
                    QF_MAX_KEY: torch.max(q_curr).detach(), QF_MIN_KEY: torch.min(q_curr).detach(),
                    TD_ERROR_MEAN_KEY: torch.mean(td_error).detach()}
        if critic_twin_loss is not None:  # config.twin_q
            stats_of[QF_TWIN_LOSS_KEY] = critic_twin_loss.detach()
        return total_loss, stats_of, td_error.detach(), grads


def _critic_loss_fn(kind: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """`training.critic_loss`: "huber", RLlib's (delta 1); "mse", 0.5 x squared error (SB3's, the SAC paper's)."""
    if kind == "mse":
        return lambda prediction, target: 0.5 * (prediction - target) ** 2
    return torch.nn.HuberLoss(reduction="none", delta=1.0)


LEAN_OFF_POLICY_LEARNERS = {"DQN": LeanDQNTorchLearner, "SAC": LeanSACTorchLearner}

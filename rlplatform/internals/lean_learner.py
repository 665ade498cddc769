"""RLlib's torch learners with a cheaper optimizer step and PPO loss, plugged in through `learner_class`.

Profiled on CartPole PPO (80 SGD steps of 256 per 1000-step batch, one CPU thread), RLlib's
`TorchLearner.apply_gradients` took about a quarter of the update: two `isfinite().all()` checks per
parameter tensor, each a small op plus a Python bool, and Adam's per-tensor Python loop. Here one
check over all gradients answers "all finite?" and Adam runs fused (one kernel for all
tensors, on CPU and CUDA alike). Same maths: anything non-finite, a grad scaler or torch lr
schedulers take RLlib's own path, with its zeroing and warnings.

PPO's loss for a Categorical policy (`LeanPPOTorchLearner.compute_loss_for_module`) runs the same
tensor operations as RLlib's `PPOTorchLearner` in the same order, so the loss, its gradients and
the logged metrics are the same numbers; it leaves out what RLlib builds and throws away on each
minibatch: two `torch.distributions.Categorical` objects (one for the old policy, used only by the
KL term), a boolean-mask lookup per masked mean, and the tree walk of `log_dict`. The KL term, no
critic, and other action distributions take RLlib's loss.

Around the loss, per minibatch, RLlib also walks every submodule to set training mode, computes
statistics and an off-policyness metric that `window=1` keeps only for the last minibatch, and
slices and concatenates `SampleBatch`es through tree walks: the lean update sets training mode
once per update, computes those metrics once (PPO) or logs them directly (APPO, IMPALA), and cuts
flat tensor batches with `LeanMiniBatchIterator` (the same minibatches to the bit).
"""

from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional

import numpy as np
from ray.rllib.algorithms.appo.torch.appo_torch_learner import APPOTorchLearner
from ray.rllib.algorithms.impala.torch.impala_torch_learner import IMPALATorchLearner
from ray.rllib.algorithms.ppo.ppo import (
    LEARNER_RESULTS_KL_KEY,
    LEARNER_RESULTS_VF_EXPLAINED_VAR_KEY,
    LEARNER_RESULTS_VF_LOSS_UNCLIPPED_KEY,
)
from ray.rllib.algorithms.ppo.torch.ppo_torch_learner import PPOTorchLearner
from ray.rllib.core.columns import Columns
from ray.rllib.core.distribution.torch.torch_distribution import TorchCategorical
from ray.rllib.core.learner.learner import ENTROPY_KEY, POLICY_LOSS_KEY, VF_LOSS_KEY
from ray.rllib.core.learner.torch.torch_learner import TorchLearner
from ray.rllib.core.rl_module.rl_module import RLModule
from ray.rllib.core.rl_module.torch.torch_rl_module import TorchRLModule
from ray.rllib.evaluation.postprocessing import Postprocessing
from ray.rllib.policy.sample_batch import MultiAgentBatch, SampleBatch
from ray.rllib.utils.framework import try_import_torch
from ray.rllib.utils.metrics import ALL_MODULES, DIFF_NUM_GRAD_UPDATES_VS_SAMPLER_POLICY, WEIGHTS_SEQ_NO
from ray.rllib.utils.minibatch_utils import MiniBatchCyclicIterator
from ray.rllib.utils.torch_utils import explained_variance

from rlplatform.internals import GRADIENT_CPU_S, install_in_process

if TYPE_CHECKING:
    import torch
else:
    # RLlib's stub where torch is not loaded: a torch-free env runner (internals/slim_env_runner.py) loads this
    # module when it unpickles its AlgorithmConfig, which names these learners; it never builds one.
    torch, _ = try_import_torch()


def _fused_adam_supported(params: list[torch.Tensor]) -> bool:
    devices = {p.device.type for p in params}
    return len(devices) == 1 and devices <= {"cpu", "cuda"} and all(p.dtype == torch.float32 for p in params)


class EagerAdam(torch.optim.Adam if torch is not None else object):  # type: ignore[misc]  # conditional: object without torch
    """Adam for a learner that torch never compiles: the same steps, without importing torch's compiler.

    torch wraps `step`, `zero_grad`, `add_param_group`, `state_dict` and `load_state_dict` so that a
    `torch.compile`d caller does not trace into them; the first call of each imports
    `torch._dynamo` (1.0-1.7 s of CPU here, most of building a one-process run's algorithm) and
    `step` looks the module up on every call. Run eagerly, each wrapper only calls the method
    (`step` with grad off, as torch's `_use_grad_for_differentiable` does): these call it directly.
    """

    def step(self, closure=None):
        with torch.set_grad_enabled(self.defaults["differentiable"]):
            return torch.optim.Adam.step.__wrapped__(self, closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        torch.optim.Optimizer.zero_grad.__wrapped__(self, set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        torch.optim.Optimizer.add_param_group.__wrapped__(self, param_group)

    def state_dict(self) -> dict[str, Any]:
        return torch.optim.Optimizer.state_dict.__wrapped__(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        torch.optim.Optimizer.load_state_dict.__wrapped__(self, state_dict)


def clip_gradients_(grads: list[torch.Tensor], clip: float, by: str) -> tuple[Optional[torch.Tensor], torch.Tensor]:
    """RLlib's `torch_utils.clip_gradients` by "norm" or "global_norm", in place, in a few foreach kernels instead of
    several ops (and, by "norm", a host read) per tensor: each tensor's L2 norm with overflow mapped to +-1e9; by
    "norm" each tensor above `clip` scaled by clip / its norm (the others by exactly 1); by "global_norm" all by
    min(1, clip / max(global norm + 1e-6, clip)). Returns the global norm ("global_norm"; else None) and each tensor's
    norm before the overflow mapping (for a finiteness check)."""
    norms = torch.stack(torch._foreach_norm(grads, 2.0))
    safe = norms.nan_to_num(neginf=-10e8, posinf=10e8)
    if by == "norm":
        factors = torch.where(safe > clip, clip / safe, torch.ones_like(safe))
        torch._foreach_mul_(grads, list(factors.unbind()))
        return None, norms
    total = torch.norm(safe, 2.0).nan_to_num(neginf=-10e8, posinf=10e8)
    torch._foreach_mul_(grads, torch.clamp(clip / torch.clamp(total + 1e-6, min=clip), max=1.0))
    return total, norms


def foreach_clip_applies(config: Any) -> bool:
    return bool(config.grad_clip) and config.grad_clip_by in ("norm", "global_norm")


def clip_per_optimizer(config: Any, groups: dict[str, list[torch.Tensor]]) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]]:
    """`clip_gradients_` on each optimizer's gradients, as RLlib clips (per optimizer): each optimizer's global norm
    (where clipping by global norm) and every tensor's norm."""
    global_norms, tensor_norms = {}, []
    for name, grads in groups.items():
        if grads:
            total, norms = clip_gradients_(grads, config.grad_clip, config.grad_clip_by)
            tensor_norms.append(norms)
            if total is not None:
                global_norms[name] = total
    return global_norms, tensor_norms


def _all_finite(grads: list[torch.Tensor]) -> bool:
    # One concatenation and one check: 35 us for CartPole's 12 tensors against RLlib's 2 x 79 us.
    return bool(torch.cat([g.reshape(-1) for g in grads]).isfinite().all())


@contextlib.contextmanager
def _train_mode_held(multi_module) -> Iterator[None]:
    """RLlib's `TorchRLModule.forward_train` calls `module.train()` on every minibatch: a Python walk
    setting `training` on each submodule, 8 % of a CartPole PPO update. Within one `update`, each
    module's `forward_train` only puts it back in training mode when something switched it out."""
    held = []
    for module in multi_module.values():
        if type(module).forward_train is not TorchRLModule.forward_train:  # overridden, or a DDP wrapper
            continue

        def forward_train(batch, _module=module, **kwargs):
            if not _module.training:
                _module.train()
            return RLModule.forward_train(_module, batch, **kwargs)

        module.train()
        module.forward_train = forward_train
        held.append(module)
    try:
        yield
    finally:
        for module in held:
            del module.forward_train


class LeanUpdate:
    """Mixin for a TorchLearner subclass; keep it first in the bases."""

    # What this mixin reads of the RLlib learner it is mixed into (annotations only: no class attributes).
    config: Any
    metrics: Any
    module: Any
    _module: Any
    _params: Any
    _weights_seq_no: int
    get_optimizers_for_module: Any
    filter_param_dict_for_optimizer: Any
    _grad_scalers: Any
    _lr_scheduler_classes: Any
    _module_optimizers: Any
    get_parameters: Any
    get_optimizer: Any
    register_optimizer: Any

    def __init__(self, *args, **kwargs):
        install_in_process()  # before the learner builds its connector pipeline
        self._gradient_cpu_s = 0.0
        super().__init__(*args, **kwargs)

    def update(self, *args, **kwargs):
        with _train_mode_held(self.module):
            return super().update(*args, **kwargs)

    def _update(self, batch: dict) -> Any:
        """RLlib's gradient step (forward, loss, backward, optimizer) on one minibatch, its CPU time logged.

        `GRADIENT_CPU_S` is this thread's CPU time (`time.thread_time`) in the step: `bench ingest` subtracts
        it from the learner process's CPU to tell the host side (connectors, batch assembly, copies) from the
        update itself. Torch's own worker threads, where it uses more than one, are not counted."""
        started = time.thread_time()
        try:
            return super()._update(batch)  # type: ignore[misc]  # mixin: on the RLlib class in the MRO
        finally:
            self._gradient_cpu_s += time.thread_time() - started  # logged once per update: a log_value costs ~25 us

    def after_gradient_based_update(self, *, timesteps: dict) -> None:
        if self._gradient_cpu_s:
            self.metrics.log_value((ALL_MODULES, GRADIENT_CPU_S), self._gradient_cpu_s, reduce="lifetime_sum")
            self._gradient_cpu_s = 0.0
        super().after_gradient_based_update(timesteps=timesteps)  # type: ignore[misc]  # mixin: on the RLlib class

    def postprocess_gradients_for_module(self, *, module_id: str, config: Any = None, module_gradients_dict: dict) -> dict:
        """RLlib's, with clipping by norm or global norm in foreach kernels (`clip_gradients_`): the same gradients
        and the same logged global norm."""
        if not foreach_clip_applies(config) or config.log_gradients:
            return super().postprocess_gradients_for_module(  # type: ignore[misc]  # mixin: on the RLlib class
                module_id=module_id, config=config, module_gradients_dict=module_gradients_dict)
        by_optimizer = {name: self.filter_param_dict_for_optimizer(param_dict=module_gradients_dict, optimizer=optimizer)
                        for name, optimizer in self.get_optimizers_for_module(module_id)}
        global_norms, _ = clip_per_optimizer(config, {name: list(grads.values()) for name, grads in by_optimizer.items()})
        for name, total in global_norms.items():
            self.metrics.log_value((module_id, f"gradients_{name}_global_norm"), total, window=1)
        return {param: grad for grads in by_optimizer.values() for param, grad in grads.items()}

    def _create_iterator_if_necessary(self, **kwargs):
        batch_iter = super()._create_iterator_if_necessary(**kwargs)
        return LeanMiniBatchIterator(batch_iter) if LeanMiniBatchIterator.applies(batch_iter) else batch_iter

    def _compute_off_policyness(self, batch: dict) -> None:
        # RLlib's numbers, logged with one `log_value` each instead of `log_dict`'s tree walk per minibatch.
        for module_id, module_batch in batch.items():
            if WEIGHTS_SEQ_NO not in module_batch:
                continue
            diff = (self._weights_seq_no - module_batch[WEIGHTS_SEQ_NO]).float()
            if Columns.LOSS_MASK in module_batch:
                mask = module_batch[Columns.LOSS_MASK]
                value = torch.sum(diff[mask]) / torch.sum(mask)
            else:
                value = torch.mean(diff)
            self.metrics.log_value((module_id, DIFF_NUM_GRAD_UPDATES_VS_SAMPLER_POLICY), value, reduce="mean", window=1)

    def configure_optimizers_for_module(self, module_id: str, config: Any = None) -> None:
        params = self.get_parameters(self._module[module_id])
        if not _fused_adam_supported(params):
            return TorchLearner.configure_optimizers_for_module(self, module_id, config)
        adam = torch.optim.Adam if self.config.torch_compile_learner else EagerAdam
        self.register_optimizer(
            module_id=module_id,
            optimizer=adam(params, fused=True),
            params=params,
            lr_or_lr_schedule=config.lr,
        )

    def apply_gradients(self, gradients_dict: dict) -> None:
        grads = list(gradients_dict.values())
        if (
            self._grad_scalers is not None
            or self._lr_scheduler_classes is not None
            or not grads
            or any(g is None for g in grads)
            or not _all_finite(grads)
        ):
            return super().apply_gradients(gradients_dict)  # type: ignore[misc]  # mixin: on the RLlib class in the MRO
        for param_ref, grad in gradients_dict.items():
            self._params[param_ref].grad = grad
        for module_id, optimizer_names in self._module_optimizers.items():
            for name in optimizer_names:
                self.get_optimizer(module_id, name).step()


class LeanPPOTorchLearner(LeanUpdate, PPOTorchLearner):
    """The statistics RLlib logs with `window=1` on each minibatch keep only the update's last one: the
    loss statistics and the off-policyness are computed once, from the last minibatch's tensors, at
    the end of the update (before PPO's own `after_gradient_based_update` reads them)."""

    def build(self) -> None:
        super().build()
        self._last_minibatch_stats: dict[str, Callable[[], dict[str, torch.Tensor]]] = {}
        self._last_minibatch: Optional[dict] = None

    def compute_loss_for_module(self, *, module_id: str, config: Any, batch: dict, fwd_out: dict) -> torch.Tensor:
        module = self.module[module_id].unwrapped()
        if config.use_kl_loss or not config.use_critic or module.get_train_action_dist_cls() is not TorchCategorical:
            return super().compute_loss_for_module(module_id=module_id, config=config, batch=batch, fwd_out=fwd_out)
        mean = _masked_mean(batch.get(Columns.LOSS_MASK))
        log_pmf, probs = _categorical(fwd_out[Columns.ACTION_DIST_INPUTS])
        logp = log_pmf.gather(-1, batch[Columns.ACTIONS].long().unsqueeze(-1)).squeeze(-1)  # Categorical.log_prob
        logp_ratio = torch.exp(logp - batch[Columns.ACTION_LOGP])
        curr_entropy = -(torch.clamp(log_pmf, min=torch.finfo(log_pmf.dtype).min) * probs).sum(-1)  # Categorical.entropy
        advantages = batch[Postprocessing.ADVANTAGES]
        surrogate_loss = torch.min(
            advantages * logp_ratio, advantages * torch.clamp(logp_ratio, 1 - config.clip_param, 1 + config.clip_param)
        )
        value_fn_out = module.compute_values(batch, embeddings=fwd_out.get(Columns.EMBEDDINGS))
        vf_loss = torch.pow(value_fn_out - batch[Postprocessing.VALUE_TARGETS], 2.0)
        vf_loss_clipped = torch.clamp(vf_loss, 0, config.vf_clip_param)
        entropy_coeff = self.entropy_coeff_schedulers_per_module[module_id].get_current_value()
        total_loss = mean(-surrogate_loss + config.vf_loss_coeff * vf_loss_clipped - entropy_coeff * curr_entropy)
        self._last_minibatch_stats[module_id] = lambda: {
            POLICY_LOSS_KEY: -mean(surrogate_loss),
            VF_LOSS_KEY: mean(vf_loss_clipped),
            LEARNER_RESULTS_VF_LOSS_UNCLIPPED_KEY: mean(vf_loss),
            LEARNER_RESULTS_VF_EXPLAINED_VAR_KEY: explained_variance(batch[Postprocessing.VALUE_TARGETS], value_fn_out),
            ENTROPY_KEY: mean(curr_entropy),
            LEARNER_RESULTS_KL_KEY: torch.tensor(0.0, device=logp_ratio.device),
        }
        return total_loss

    def _compute_off_policyness(self, batch: dict) -> None:
        self._last_minibatch = batch

    def log_last_minibatch_stats(self) -> None:
        """What RLlib logs on every minibatch (`log_dict(..., key=module_id, window=1)`), for the last one."""
        with torch.no_grad():
            for module_id, stats in self._last_minibatch_stats.items():
                for name, value in stats().items():
                    self.metrics.log_value((module_id, name), value, reduce="mean", window=1)
        self._last_minibatch_stats.clear()
        if self._last_minibatch is not None:
            super()._compute_off_policyness(self._last_minibatch)
            self._last_minibatch = None

    def after_gradient_based_update(self, *, timesteps: dict) -> None:
        self.log_last_minibatch_stats()
        super().after_gradient_based_update(timesteps=timesteps)


def _categorical(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's Categorical(logits=...): its normalised logits (the log-pmf) and probs."""
    log_pmf = logits - logits.logsumexp(dim=-1, keepdim=True)
    return log_pmf, torch.nn.functional.softmax(log_pmf, dim=-1)


def _masked_mean(mask: Any):
    """RLlib PPO's possibly_masked_mean, with the mask's positions found once per minibatch."""
    if mask is None:
        return torch.mean
    num_valid = torch.sum(mask)
    positions = mask.nonzero(as_tuple=True)  # what data[mask] looks up each time

    def mean(data: torch.Tensor) -> torch.Tensor:
        return torch.sum(data[positions]) / num_valid

    return mean


def _flat_tensor_batch(batch: Any) -> bool:
    """A batch RLlib's cyclic iterator slices row by row: torch tensors only, no sequences, no infos."""
    return (
        isinstance(batch, SampleBatch)
        and not batch._slice_seq_lens_in_B
        and SampleBatch.SEQ_LENS not in batch
        and Columns.INFOS not in batch
        and not batch.time_major
        and batch.count > 0
        and all(torch.is_tensor(value) for value in batch.values())
    )


class LeanMiniBatchIterator:
    """RLlib's `MiniBatchCyclicIterator` for flat batches of tensors: the same minibatches, drawn
    with the same `np.random.permutation` calls, to the bit.

    RLlib slices a `SampleBatch` (a tree walk), concatenates the slices with `concat_samples`
    (another, plus its checks) for every minibatch, and shuffles with a third walk: 13.6 ms of a
    200 ms CartPole PPO update (83 minibatches). Each column cut and concatenated directly: 6.0 ms.
    """

    def __init__(self, rllib_iterator: MiniBatchCyclicIterator) -> None:
        self._batch = rllib_iterator._batch
        self._minibatch_size = rllib_iterator._minibatch_size
        self._num_epochs = rllib_iterator._num_epochs
        self._shuffle = rllib_iterator._shuffle_batch_per_epoch
        self._num_total_minibatches = rllib_iterator._num_total_minibatches

    @staticmethod
    def applies(batch_iter: Any) -> bool:
        return type(batch_iter) is MiniBatchCyclicIterator and all(
            _flat_tensor_batch(b) for b in batch_iter._batch.policy_batches.values()
        )

    def __iter__(self):
        batches = self._batch.policy_batches
        columns = {mid: dict(b) for mid, b in batches.items()}
        start = {mid: 0 for mid in batches}
        covered = {mid: 0 for mid in batches}
        count = 0
        while (self._num_total_minibatches == 0 and min(covered.values()) < self._num_epochs) or (
            0 < self._num_total_minibatches and count < self._num_total_minibatches
        ):
            minibatch = {}
            for mid, module_batch in batches.items():
                length, s, n_steps, pieces = module_batch.count, start[mid], self._minibatch_size, []
                while s + n_steps >= length:  # the rest of this epoch, then the next one (shuffled)
                    pieces.append((columns[mid], s, length))
                    n_steps -= length - s
                    s = 0
                    covered[mid] += 1
                    if self._shuffle:
                        permutation = torch.from_numpy(np.random.permutation(length))  # SampleBatch.shuffle's draw
                        columns[mid] = {k: v[permutation] for k, v in columns[mid].items()}
                if n_steps > 0:
                    pieces.append((columns[mid], s, s + n_steps))
                start[mid] = s + n_steps
                minibatch[mid] = _concatenated(module_batch, pieces)
            yield MultiAgentBatch(minibatch, len(self._batch))
            count += 1


def _concatenated(module_batch: SampleBatch, pieces: list[tuple[dict, int, int]]) -> SampleBatch:
    """What `concat_samples` makes of these slices of `module_batch`."""
    data = {k: torch.cat([cols[k][a:b] for cols, a, b in pieces], dim=0) for k in pieces[0][0]}
    rows = sum(b - a for _, a, b in pieces)
    grad_updates = module_batch.num_grad_updates
    mean_grad_updates = 0.0 if grad_updates is None else sum(grad_updates * (b - a) for _, a, b in pieces) / rows
    # A flat slice is never zero-padded and has no max_seq_len, whatever its batch says.
    return SampleBatch(data, seq_lens=[], _time_major=module_batch.time_major, _zero_padded=False, _max_seq_len=None,
                       _num_grad_updates=mean_grad_updates)


class LeanAPPOTorchLearner(LeanUpdate, APPOTorchLearner):
    pass


class LeanIMPALATorchLearner(LeanUpdate, IMPALATorchLearner):
    pass


LEAN_LEARNERS = {"PPO": LeanPPOTorchLearner, "APPO": LeanAPPOTorchLearner, "IMPALA": LeanIMPALATorchLearner}

"""An RLModule as a plain torch module for export: observation (and RNN state, and noise) in, env action out.

`InferencePolicy.forward` is what RLlib does between an observation and `env.step` at evaluation:
`forward_inference`, the inference action distribution made deterministic (or, with `stochastic`,
sampled from an explicit noise input), then the module-to-env connector's unsquash and clip
(`NormalizeAndClipActions`). Nothing in it needs RLlib at run time once traced or exported.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import torch

from rlplatform.adapter.policy import as_module_input
from rlplatform.config.schema import ExperimentConfig
from rlplatform.errors import UserError

# How the noise input of a stochastic export is drawn, by action distribution (documented in docs/export.md).
NOISE_UNIFORM = "uniform(0,1)"  # categorical: Gumbel-max, argmax(logits - log(-log(u)))
NOISE_NORMAL = "normal(0,1)"  # Gaussian: mean + std * n; squashed Gaussian: tanh(mean + std * n)
_EPS = 1e-12  # keeps log(-log(u)) finite at u = 0 or 1


@dataclass
class PolicySignature:
    """The exported model's inputs and outputs, in order, with their per-sample shapes and dtypes."""

    inputs: list[dict[str, Any]] = field(default_factory=list)
    outputs: list[dict[str, Any]] = field(default_factory=list)
    noise: Optional[str] = None  # how to draw the `noise` input; None: there is none
    state_names: list[str] = field(default_factory=list)  # `state_in.<path>` / `state_out.<path>` leaves, in order

    def input_names(self) -> list[str]:
        return [spec["name"] for spec in self.inputs]

    def output_names(self) -> list[str]:
        return [spec["name"] for spec in self.outputs]


def _tensor_spec(name: str, shape: tuple[int, ...], dtype: str) -> dict[str, Any]:
    return {"name": name, "shape": ["batch", *map(int, shape)], "dtype": dtype}


class InferencePolicy(torch.nn.Module):
    """forward(obs, [noise], [state_in leaves...]) -> (action, [state_out leaves...])."""

    def __init__(self, module, config: ExperimentConfig, stochastic: bool = False):
        super().__init__()
        import gymnasium as gym
        import tree

        self.module = module
        self.stochastic = stochastic
        self.dist_kind = _distribution_kind(module, config.algorithm, stochastic)
        self.stateful = bool(module.is_stateful())
        if self.stateful:
            initial = module.get_initial_state()
            self._state_structure = tree.map_structure(lambda _: None, initial)
            self._state_shapes = [tuple(torch.as_tensor(leaf).shape) for leaf in tree.flatten(initial)]
            self._state_paths = [".".join(map(str, path)) for path, _ in tree.flatten_with_path(initial)]
        else:
            self._state_structure, self._state_shapes, self._state_paths = None, [], []
        space = module.action_space
        env_options = config.rllib.get("environment", {})
        self.unsquash = bool(
            isinstance(space, gym.spaces.Box) and env_options.get("normalize_actions", True)
            and np.all(space.bounded_below) and np.all(space.bounded_above) and space.dtype in (np.float32, np.float64)
        )
        self.clip = bool(isinstance(space, gym.spaces.Box) and (self.unsquash or env_options.get("clip_actions", False)))
        if self.clip:
            self.register_buffer("low", torch.as_tensor(space.low, dtype=torch.float32))
            self.register_buffer("high", torch.as_tensor(space.high, dtype=torch.float32))

    def forward(self, obs: torch.Tensor, *rest: torch.Tensor):
        import tree
        from ray.rllib.core.columns import Columns

        noise = rest[0] if self.stochastic else None
        state_leaves = list(rest[1:] if self.stochastic else rest)
        obs = as_module_input(obs)  # the export takes the env's dtype (float64 for MuJoCo)
        batch: dict[str, Any] = {Columns.OBS: obs}
        if self.stateful:
            batch[Columns.OBS] = obs.unsqueeze(1)  # [B, T=1, ...]
            batch[Columns.STATE_IN] = tree.unflatten_as(self._state_structure, state_leaves)
        out = self.module.forward_inference(batch)
        action = self._action(out, noise)
        if self.stateful:
            action = action.squeeze(1)
        action = self._to_env(action)
        if not self.stateful:
            return action
        return (action, *tree.flatten(out[Columns.STATE_OUT]))

    def _action(self, out: dict[str, Any], noise: Optional[torch.Tensor]) -> torch.Tensor:
        from ray.rllib.core.columns import Columns
        from ray.rllib.utils.numpy import MAX_LOG_NN_OUTPUT, MIN_LOG_NN_OUTPUT

        if Columns.ACTIONS in out:  # DQN: the module takes the argmax of Q itself
            return out[Columns.ACTIONS]
        logits = out[Columns.ACTION_DIST_INPUTS]
        if noise is None:  # exactly RLlib's greedy action: the inference distribution made deterministic
            dist_cls = self.module.get_inference_action_dist_cls()
            return dist_cls.from_logits(logits).to_deterministic().sample()
        if self.dist_kind == "categorical":
            gumbel = -torch.log(-torch.log(noise.clamp(_EPS, 1.0 - _EPS)))
            return torch.argmax(logits + gumbel, dim=-1)
        mean, log_std = logits.chunk(2, dim=-1)
        if self.dist_kind == "squashed_gaussian":
            log_std = log_std.clamp(MIN_LOG_NN_OUTPUT, MAX_LOG_NN_OUTPUT)
            return torch.tanh(mean + log_std.exp() * noise).clamp(-1.0, 1.0)
        return mean + log_std.exp() * noise

    def _to_env(self, action: torch.Tensor) -> torch.Tensor:
        """RLlib's NormalizeAndClipActions: from [-1, 1] to the Box's bounds, then clipped."""
        if self.unsquash:
            action = self.low + (action + 1.0) * (self.high - self.low) / 2.0
        if self.clip:
            action = torch.minimum(torch.maximum(action, self.low), self.high)
        return action

    def example_inputs(self, batch: int = 2) -> tuple[torch.Tensor, ...]:
        """Inputs of the right shapes and dtypes (zeros) to trace or export with."""
        space = self.module.observation_space
        obs = torch.zeros((batch, *space.shape), dtype=_torch_dtype(space.dtype))
        extra = [torch.zeros((batch, *self.noise_shape()))] if self.stochastic else []
        states = [torch.zeros((batch, *shape)) for shape in self._state_shapes]
        return (obs, *extra, *states)

    def initial_state(self, batch: int = 1) -> list[np.ndarray]:
        import tree

        leaves = tree.flatten(self.module.get_initial_state())
        return [np.broadcast_to(torch.as_tensor(leaf).numpy(), (batch, *leaf.shape)).astype(np.float32) for leaf in leaves]

    def noise_shape(self) -> tuple[int, ...]:
        space = self.module.action_space
        return (int(space.n),) if self.dist_kind == "categorical" else tuple(space.shape)

    def signature(self) -> PolicySignature:
        obs_space, act_space = self.module.observation_space, self.module.action_space
        sig = PolicySignature(state_names=self._state_paths)
        sig.inputs.append(_tensor_spec("obs", obs_space.shape, str(np.dtype(obs_space.dtype))))
        if self.stochastic:
            sig.inputs.append(_tensor_spec("noise", self.noise_shape(), "float32"))
            sig.noise = NOISE_UNIFORM if self.dist_kind == "categorical" else NOISE_NORMAL
        action_dtype = "int64" if self.dist_kind in ("categorical", "argmax_q") else "float32"
        sig.outputs.append(_tensor_spec("action", act_space.shape, action_dtype))
        for path, shape in zip(self._state_paths, self._state_shapes):
            sig.inputs.append(_tensor_spec(f"state_in.{path}", shape, "float32"))
            sig.outputs.append(_tensor_spec(f"state_out.{path}", shape, "float32"))
        return sig


def _torch_dtype(dtype) -> torch.dtype:
    return torch.from_numpy(np.zeros(0, dtype=dtype)).dtype


def _distribution_kind(module, algorithm: str, stochastic: bool) -> str:
    """Which action distribution the module's outputs parameterise; refuses what the export cannot express."""
    from ray.rllib.core.distribution.torch.torch_distribution import (
        TorchCategorical,
        TorchDiagGaussian,
        TorchSquashedGaussian,
    )

    if algorithm == "DQN":
        if stochastic:
            raise UserError("--stochastic: a DQN policy is the argmax of Q (epsilon-greedy exploration is not a policy to export)")
        return "argmax_q"
    dist_cls = module.get_exploration_action_dist_cls() if stochastic else module.get_inference_action_dist_cls()
    for cls, kind in ((TorchSquashedGaussian, "squashed_gaussian"), (TorchDiagGaussian, "gaussian"),
                      (TorchCategorical, "categorical")):
        if isinstance(dist_cls, type) and issubclass(dist_cls, cls):
            return kind
    raise UserError(f"cannot export a policy whose action distribution is {getattr(dist_cls, '__name__', dist_cls)} "
                    f"(action space {module.action_space}): Discrete and Box actions only")


def reference_actions(module, config: ExperimentConfig, observations: np.ndarray) -> np.ndarray:
    """What `evaluate` on the checkpoint does with a batch of observations: RLlib's greedy action, as the env gets it."""
    from rlplatform.adapter.policy import greedy_actions, initial_state, to_env_action

    state = initial_state(module)
    if state is not None:
        import tree

        state = tree.map_structure(lambda s: s.expand(len(observations), *s.shape[1:]).contiguous(), state)
    actions, _ = greedy_actions(module, observations, state)
    return np.stack([np.asarray(to_env_action(a, module.action_space, config)) for a in actions])

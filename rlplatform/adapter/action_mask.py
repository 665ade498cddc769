"""Action masking (`model.action_mask: KEY`): the illegal actions of a Discrete action space never taken.

The observation is a Dict holding the mask under KEY (1 = legal, one entry per action) and the policy's input under
its one other key (PettingZoo classic's `observation` / `action_mask`). `MaskedPPOTorchRLModule` is RLlib's PPO
module (IMPALA's too) and `MaskedAPPOTorchRLModule` APPO's, built on that other key's space. Every forward pass,
APPO's target policy's included, sets the logits of illegal actions to the lowest float, so sampling, the greedy
argmax, the log-probabilities and the entropy in the loss all see only legal actions. The value function reads the same input. RLlib's own example module
(`examples/rl_modules/classes/action_masking_rlm.py`) pops the mask out of the batch in place and relies on the
order of RLlib's connectors; this one leaves the batch as it is.

`count_illegal` is the `on_sample_end` callback that counts the sampled actions their step's mask forbade
(`actions/illegal` in the metrics): with masking on it stays 0. It counts the chunks as sampled: on a local env
runner, RLlib's learner connectors later add a step to those same chunk objects (`AddOneTsToEpisodesAndTruncate`).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import gymnasium as gym
import numpy as np
import torch
from ray.rllib.algorithms.appo.torch.default_appo_torch_rl_module import DefaultAPPOTorchRLModule
from ray.rllib.algorithms.ppo.torch.default_ppo_torch_rl_module import DefaultPPOTorchRLModule
from ray.rllib.core.columns import Columns
from ray.rllib.core.rl_module.apis.target_network_api import TARGET_NETWORK_ACTION_DIST_INPUTS

from rlplatform.adapter.algorithm_config import ILLEGAL_ACTIONS
from rlplatform.errors import UserError

MASK_KEY = "action_mask_key"  # the module's model_config entry that names the mask


def input_key(observation_space: gym.spaces.Dict, mask_key: str) -> str:
    (key,) = (k for k in observation_space.spaces if k != mask_key)
    return key


def check_spaces(observation_space: gym.Space, action_space: gym.Space, mask_key: str) -> None:
    """One line naming what does not fit masking (before Ray starts)."""
    where = f"model.action_mask = {mask_key!r}"
    if not isinstance(action_space, gym.spaces.Discrete) or int(action_space.start) != 0:
        raise UserError(f"{where}: masking needs a Discrete action space starting at 0, not {action_space}")
    if not isinstance(observation_space, gym.spaces.Dict) or mask_key not in observation_space.spaces:
        keys = list(observation_space.spaces) if isinstance(observation_space, gym.spaces.Dict) else None
        raise UserError(f"{where}: the env's observation must be a Dict with that key"
                        + (f" (its keys: {', '.join(map(str, keys))})" if keys else f", not {observation_space}"))
    mask = observation_space.spaces[mask_key]
    if not isinstance(mask, (gym.spaces.Box, gym.spaces.MultiBinary)) or tuple(mask.shape) != (int(action_space.n),):
        raise UserError(f"{where}: the mask must be a Box or MultiBinary of shape ({int(action_space.n)},), one entry "
                        f"per action, not {mask}")
    others = [k for k in observation_space.spaces if k != mask_key]
    if len(others) != 1:
        raise UserError(f"{where}: the Dict must hold the mask and one other key (the policy's input), not "
                        f"{', '.join(map(str, others)) or 'nothing else'}")


def masked_logits(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return logits.masked_fill(mask == 0, torch.finfo(logits.dtype).min)


class _MaskedLogits:
    """Mixin before RLlib's PPO (or APPO) torch module: built on the Dict's input key, the mask on every logit."""

    _mask_key: str
    _input_key: str

    def __init__(self, *args: Any, observation_space: Optional[gym.Space] = None, model_config: Any = None,
                 **kwargs: Any) -> None:
        if not isinstance(observation_space, gym.spaces.Dict) or not isinstance(model_config, dict):
            raise ValueError(f"{type(self).__name__} needs a Dict observation space and a dict model_config")
        self._mask_key = model_config[MASK_KEY]
        self._input_key = input_key(observation_space, self._mask_key)
        self._space_with_mask = observation_space
        super().__init__(*args, observation_space=observation_space[self._input_key],  # type: ignore[call-arg]
                         model_config=model_config, **kwargs)

    def setup(self) -> None:
        super().setup()  # type: ignore[misc]  # the encoder and heads, built for the input's space
        self.observation_space = self._space_with_mask  # what the runners' connectors check observations against

    def _split(self, batch: dict[str, Any]) -> tuple[dict[str, Any], Any]:
        observations = batch[Columns.OBS]
        return {**batch, Columns.OBS: observations[self._input_key]}, observations[self._mask_key]

    def _forward(self, batch: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
        inputs, mask = self._split(batch)
        out = super()._forward(inputs, **kwargs)  # type: ignore[misc]
        out[Columns.ACTION_DIST_INPUTS] = masked_logits(out[Columns.ACTION_DIST_INPUTS], mask)
        return out

    def _forward_train(self, batch: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
        inputs, mask = self._split(batch)
        out = super()._forward_train(inputs, **kwargs)  # type: ignore[misc]
        out[Columns.ACTION_DIST_INPUTS] = masked_logits(out[Columns.ACTION_DIST_INPUTS], mask)
        return out

    def compute_values(self, batch: dict[str, Any], embeddings: Optional[Any] = None) -> Any:
        if embeddings is None and isinstance(batch[Columns.OBS], dict):
            batch = self._split(batch)[0]
        return super().compute_values(batch, embeddings)  # type: ignore[misc]


class MaskedPPOTorchRLModule(_MaskedLogits, DefaultPPOTorchRLModule):
    """PPO's and IMPALA's module, masked."""


class MaskedAPPOTorchRLModule(_MaskedLogits, DefaultAPPOTorchRLModule):
    """APPO's module (with its target policy for the loss), masked; the target policy's logits too."""

    def forward_target(self, batch: dict[str, Any]) -> dict[str, Any]:
        inputs, mask = self._split(batch)
        out = super().forward_target(inputs)
        out[TARGET_NETWORK_ACTION_DIST_INPUTS] = masked_logits(out[TARGET_NETWORK_ACTION_DIST_INPUTS], mask)
        return out


MASKED_MODULES = {"PPO": MaskedPPOTorchRLModule, "IMPALA": MaskedPPOTorchRLModule, "APPO": MaskedAPPOTorchRLModule}


def illegal_in(observations: Any, actions: Any, mask_key: str) -> int:
    """How many of `actions` their step's mask forbade (`observations` one longer: the last follows the last action)."""
    masks = np.asarray(observations[mask_key])[: len(actions)]
    taken = np.asarray(actions, dtype=np.int64).reshape(-1)
    return int((masks[np.arange(len(taken)), taken] == 0).sum())


def _count_illegal(*, samples: list, metrics_logger: Any, mask_key: str, **_: Any) -> None:
    """RLlib's `on_sample_end`: the sampled chunks, each env step once, before any learner connector sees them."""
    illegal = sum(illegal_in(_stacked(chunk.get_observations()), chunk.get_actions(), mask_key)
                  for chunk in samples if len(chunk))
    metrics_logger.log_value(ILLEGAL_ACTIONS, illegal, reduce="sum")


def _stacked(observations: Any) -> dict[str, np.ndarray]:
    """A chunk's observations as a dict of arrays (a list of dicts until the episode is turned to numpy)."""
    if isinstance(observations, dict):
        return observations
    return {key: np.stack([o[key] for o in observations]) for key in observations[0]}


def count_illegal(mask_key: str) -> Callable[..., None]:
    return functools.partial(_count_illegal, mask_key=mask_key)

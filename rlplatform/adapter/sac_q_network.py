"""SAC's module as SB3, CleanRL and Spinning Up build it: one Q network on [s, a], and tanh(mean) as the greedy action.

RLlib's SAC catalog (ray 2.60) encodes the observation and the action in two MLPs of `model.hidden` each and
joins their outputs with a layer of its own (512 -> 256 for hidden [256, 256]): on HalfCheetah 3.7x the
multiply-adds of Q(s, a) = MLP([s, a]), in the six Q evaluations of every update (docs/performance.md).
`JointQSACCatalog` builds each Q encoder as one MLP of `model.hidden` on [s, a] through the catalog's public
`build_qf_encoder`; the policy network, the heads, the module class (DefaultSACTorchRLModule) and the learners
stay RLlib's. Chosen by `model.q_network: joint` (the default) where the observation is a flat vector and the
action a Box; elsewhere the catalog builds RLlib's two streams (`TanhGreedySACCatalog`).

Both catalogs also give the policy `TanhGreedySquashedGaussian`: RLlib's `TorchSquashedGaussian.to_deterministic`
returns the Gaussian's mean before the tanh (ray-project/ray#51544, open), so a greedy action (evaluation,
`evaluate`, the export, serving) is the mean clipped to the bounds instead of tanh(mean), the mode that SAC's
policy was trained around and that SB3's `predict(deterministic=True)` returns. Sampling and the losses are
unchanged.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import torch
from ray.rllib.algorithms.sac.sac_catalog import SACCatalog
from ray.rllib.core.columns import Columns
from ray.rllib.core.distribution.torch.torch_distribution import TorchDeterministic, TorchSquashedGaussian
from ray.rllib.core.models.configs import MLPEncoderConfig


def joint_applies(observation_space: gym.Space, action_space: gym.Space) -> bool:
    return (isinstance(observation_space, gym.spaces.Box) and len(observation_space.shape) == 1
            and isinstance(action_space, gym.spaces.Box) and len(action_space.shape) == 1)


class JointQEncoder(torch.nn.Module):
    """Q(s, a)'s encoder: RLlib's MLP encoder applied to [observation, action]."""

    def __init__(self, mlp: torch.nn.Module) -> None:
        super().__init__()
        self.mlp = mlp

    def forward(self, inputs: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
        joined = torch.cat([inputs[Columns.OBS], inputs[Columns.ACTIONS]], dim=-1)
        return self.mlp({Columns.OBS: joined}, **kwargs)


class TanhGreedySquashedGaussian(TorchSquashedGaussian):
    """RLlib's squashed Gaussian whose deterministic action is the squashed mean."""

    def to_deterministic(self) -> TorchDeterministic:
        squashed = (torch.tanh(self.loc) + 1.0) / 2.0 * (self.high - self.low) + self.low
        return TorchDeterministic(loc=torch.clamp(squashed, self.low, self.high))


class TanhGreedySACCatalog(SACCatalog):
    """RLlib's SAC catalog with `TanhGreedySquashedGaussian` for Box actions."""

    def get_action_dist_cls(self, framework: str) -> Any:
        cls = super().get_action_dist_cls(framework)
        return TanhGreedySquashedGaussian if cls is TorchSquashedGaussian else cls


class JointQSACCatalog(TanhGreedySACCatalog):
    """The SAC catalog with the Q encoders of `JointQEncoder` for flat observations and Box actions."""

    def __init__(self, observation_space: gym.Space, action_space: gym.Space, model_config_dict: dict,
                 *args: Any, **kwargs: Any) -> None:
        self.q_model_config = dict(model_config_dict)
        super().__init__(observation_space, action_space, model_config_dict, *args, **kwargs)

    def build_qf_encoder(self, framework: str) -> Any:
        if not joint_applies(self.observation_space, self.action_space):
            return super().build_qf_encoder(framework)
        hidden = list(self.q_model_config["fcnet_hiddens"])
        activation = self.q_model_config["fcnet_activation"]
        config = MLPEncoderConfig(
            input_dims=[self.observation_space.shape[0] + self.action_space.shape[0]],
            hidden_layer_dims=hidden[:-1], hidden_layer_activation=activation,
            output_layer_dim=hidden[-1], output_layer_activation=activation,
        )
        return JointQEncoder(config.build(framework=framework))

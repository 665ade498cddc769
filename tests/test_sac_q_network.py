"""SAC's Q networks: `model.q_network: joint` builds SB3's and CleanRL's Q(s, a) = MLP([s, a]) inside RLlib's own
SAC module; `streams` keeps RLlib's two encoders and fusion layers. Real modules built from the presets."""

import gymnasium as gym
import pytest
import torch
from conftest import ROOT
from ray.rllib.core import DEFAULT_MODULE_ID
from ray.rllib.core.columns import Columns
from ray.rllib.core.models.base import ENCODER_OUT

from rlplatform.adapter.algorithm_config import build_algorithm_config
from rlplatform.config.experiment import resolve_experiment
from rlplatform.errors import UserError


def sac_module(experiment: str, *overrides: str):
    config = resolve_experiment(ROOT / "experiments" / f"{experiment}.yaml", list(overrides), "laptop").config
    algo_config = build_algorithm_config(config)
    env = gym.make(config.env)
    torch.manual_seed(0)
    return algo_config.get_multi_rl_module_spec(env=env).build()[DEFAULT_MODULE_ID], env


def linear_shapes(module: torch.nn.Module) -> list[tuple[int, int]]:
    return [(m.in_features, m.out_features) for m in module.modules() if isinstance(m, torch.nn.Linear)]


def test_the_joint_q_network_has_sb3s_shape_and_the_policy_stays_rllibs():
    module, env = sac_module("halfcheetah_sac")
    obs_dim, act_dim = env.observation_space.shape[0], env.action_space.shape[0]
    # SB3's critic for HalfCheetah: Linear(23, 256) - ReLU - Linear(256, 256) - ReLU - Linear(256, 1), twice.
    for encoder, head in ((module.qf_encoder, module.qf), (module.qf_twin_encoder, module.qf_twin)):
        assert linear_shapes(encoder) + linear_shapes(head) == [(obs_dim + act_dim, 256), (256, 256), (256, 1)]
    assert linear_shapes(module.pi_encoder) + linear_shapes(module.pi) == [(obs_dim, 256), (256, 256),
                                                                           (256, 2 * act_dim)]
    # Q(s, a) reads the action: the same observation with another action gives another value.
    obs = torch.as_tensor(env.observation_space.sample()[None], dtype=torch.float32)
    q = [module.qf(module.qf_encoder({Columns.OBS: obs, Columns.ACTIONS: torch.full((1, act_dim), a)})[ENCODER_OUT])
         for a in (-1.0, 1.0)]
    assert not torch.equal(q[0], q[1])


def test_streams_keeps_rllibs_two_encoders_and_fusion_layers():
    module, env = sac_module("halfcheetah_sac", "model.q_network=streams", "model.fusion_hidden=[64]")
    shapes = linear_shapes(module.qf_encoder)
    obs_dim, act_dim = env.observation_space.shape[0], env.action_space.shape[0]
    assert (obs_dim, 256) in shapes and (act_dim, 256) in shapes and (512, 64) in shapes


def test_fusion_layers_without_streams_are_refused_by_name():
    with pytest.raises(UserError, match="fusion_hidden.*q_network: streams"):
        resolve_experiment(ROOT / "experiments" / "pendulum_sac.yaml", ["model.fusion_hidden=[64]"])


@pytest.mark.parametrize("q_network", ["joint", "streams"])
def test_the_greedy_action_is_the_squashed_mean_and_sampling_stays_rllibs(q_network):
    """RLlib's squashed Gaussian made deterministic returns the mean before the tanh (ray-project/ray#51544): a
    greedy SAC policy would act with clip(mean) instead of tanh(mean). Ours squashes; samples are RLlib's."""
    from ray.rllib.core.distribution.torch.torch_distribution import TorchSquashedGaussian

    module, env = sac_module("pendulum_sac", f"model.q_network={q_network}")
    obs = torch.as_tensor(gym.vector.utils.batch_space(env.observation_space, 256).sample(), dtype=torch.float32)
    with torch.no_grad():
        logits = module.forward_inference({Columns.OBS: obs})[Columns.ACTION_DIST_INPUTS]
    assert logits.shape == (256, 2)  # Pendulum: one mean, one log std
    mean = torch.linspace(-3.0, 3.0, 256)[:, None]  # an untrained policy's means are near 0; a trained one's are not
    logits = torch.cat([mean, logits[:, 1:]], dim=-1)
    dist_cls = module.get_inference_action_dist_cls()
    torch.testing.assert_close(dist_cls.from_logits(logits).to_deterministic().sample(), torch.tanh(mean))
    assert not torch.allclose(TorchSquashedGaussian.from_logits(logits).to_deterministic().sample(), torch.tanh(mean))
    torch.manual_seed(3)
    ours = dist_cls.from_logits(logits).sample()
    torch.manual_seed(3)
    torch.testing.assert_close(ours, TorchSquashedGaussian.from_logits(logits).sample())

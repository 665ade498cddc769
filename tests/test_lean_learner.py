"""The lean gradient step updates the policy as RLlib's TorchLearner does, and hands non-finite gradients to it.

Real learners built from the real experiment, in this process, on episodes sampled from CartPole.
"""

import copy

import pytest
import torch

from conftest import ROOT
from rlplatform.experiment import resolve_experiment
from rlplatform.rllib_adapter import build_algorithm_config


def algo_config(*overrides: str, experiment: str = "cartpole_ppo"):
    config = resolve_experiment(ROOT / "experiments" / f"{experiment}.yaml", list(overrides), "laptop").config
    return build_algorithm_config(config)


def learner(*overrides: str):
    import gymnasium as gym

    torch.manual_seed(0)  # both learners start from the same weights
    return algo_config(*overrides).build_learner(env=gym.make("CartPole-v1"))


@pytest.fixture(scope="module")
def episodes():
    from rlplatform.lean_env_runner import LeanEnvRunner

    runner = LeanEnvRunner(config=algo_config("scale.envs_per_runner=4"), worker_index=1, num_workers=1)
    return runner.sample(num_timesteps=400)


def weights(learner) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in learner.module["default_policy"].state_dict().items()}


def test_the_experiments_use_it():
    from ray.rllib.algorithms.ppo.torch.ppo_torch_learner import PPOTorchLearner

    from rlplatform.lean_learner import LeanPPOTorchLearner

    assert algo_config().learner_class is LeanPPOTorchLearner
    assert algo_config("scale.update=rllib").learner_class is PPOTorchLearner
    assert "Lean" not in algo_config(experiment="cartpole_dqn").learner_class.__name__


def test_it_uses_fused_adam():
    lean = learner()
    (optimizer,) = lean._named_optimizers.values()
    assert isinstance(optimizer, torch.optim.Adam) and optimizer.defaults["fused"]
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.001)


def test_same_update_as_rllib(episodes):
    lean, plain = learner(), learner("scale.update=rllib")
    before = weights(plain)
    assert all(torch.equal(before[k], v) for k, v in weights(lean).items())
    for each in (lean, plain):  # the learner connector edits episodes in place: each gets its own
        each.update(episodes=copy.deepcopy(episodes), timesteps={"num_env_steps_sampled_lifetime": 400}, num_epochs=3, minibatch_size=100)
    after_lean, after_plain = weights(lean), weights(plain)
    assert any(not torch.equal(before[k], after_plain[k]) for k in before)  # it learned something
    for name, value in after_plain.items():
        torch.testing.assert_close(after_lean[name], value, rtol=1e-4, atol=1e-6)


def test_non_finite_gradients_take_rllibs_path():
    lean, plain = learner(), learner("scale.update=rllib")
    for each in (lean, plain):
        grads = {ref: torch.full_like(param, 0.1) for ref, param in each._params.items()}
        first = next(iter(grads))
        grads[first][0] = float("nan")  # RLlib zeroes it (with a warning) and steps
        each.apply_gradients(grads)
    for name, value in weights(plain).items():
        assert torch.isfinite(value).all()
        torch.testing.assert_close(weights(lean)[name], value, rtol=1e-5, atol=1e-7)

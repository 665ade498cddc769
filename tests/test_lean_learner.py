"""The lean gradient step updates the policy as RLlib's TorchLearner does, and hands non-finite gradients to it.

Real learners built from the real experiment, in this process, on episodes sampled from CartPole.
"""

import copy
import subprocess
import sys

import pytest
import torch
from conftest import ROOT
from ray.rllib.core.learner.torch.torch_learner import TorchLearner

from rlplatform.adapter.algorithm_config import build_algorithm_config
from rlplatform.config.experiment import resolve_experiment


def algo_config(*overrides: str, experiment: str = "cartpole_ppo"):
    config = resolve_experiment(ROOT / "experiments" / f"{experiment}.yaml", list(overrides), "laptop").config
    return build_algorithm_config(config)


def learner(*overrides: str):
    import gymnasium as gym

    torch.manual_seed(0)  # both learners start from the same weights
    return algo_config(*overrides).build_learner(env=gym.make("CartPole-v1"))


@pytest.fixture(scope="module")
def episodes():
    from rlplatform.internals.lean_env_runner import LeanEnvRunner

    runner = LeanEnvRunner(config=algo_config("scale.envs_per_runner=4"), worker_index=1, num_workers=1)
    return runner.sample(num_timesteps=400)


def weights(learner) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in learner.module["default_policy"].state_dict().items()}


def test_the_experiments_use_it():
    from ray.rllib.algorithms.ppo.torch.ppo_torch_learner import PPOTorchLearner

    from rlplatform.internals.lean_learner import LeanPPOTorchLearner

    assert algo_config().learner_class is LeanPPOTorchLearner
    assert algo_config("speedups=false").learner_class is PPOTorchLearner


def test_it_uses_fused_adam():
    from rlplatform.internals.lean_learner import EagerAdam

    lean = learner()
    (optimizer,) = lean._named_optimizers.values()
    assert isinstance(optimizer, EagerAdam) and optimizer.defaults["fused"]
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.001)


def test_eager_adam_steps_saves_and_loads_as_torch_adam():
    from rlplatform.internals.lean_learner import EagerAdam

    torch.manual_seed(0)
    start = [torch.randn(5, 3), torch.randn(3)]
    ours, theirs = ([p.clone().requires_grad_() for p in start] for _ in range(2))
    eager, plain = EagerAdam(ours, lr=0.01, fused=True), torch.optim.Adam(theirs, lr=0.01, fused=True)
    for step in range(5):
        for optimizer, params in ((eager, ours), (plain, theirs)):
            optimizer.zero_grad()
            ((params[0] ** 2).sum() * (step + 1) + params[1].sum()).backward()
            optimizer.step()
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)
    assert not ours[0].grad_fn  # the step ran with grad off
    state = eager.state_dict()
    torch.testing.assert_close(state, plain.state_dict())
    restored = EagerAdam([p.detach().clone().requires_grad_() for p in start], lr=0.5, fused=True)
    restored.load_state_dict(state)
    assert restored.param_groups[0]["lr"] == 0.01
    torch.testing.assert_close(restored.state_dict(), state)


@pytest.mark.slow  # a Python process that imports RLlib and builds a learner (4 s on 2 cores)
def test_building_and_updating_imports_no_torch_compiler():
    """torch._dynamo costs 1-1.7 s of CPU to import: a learner that is not compiled never loads it."""
    script = (
        "import sys, gymnasium as gym, torch\n"
        "from test_lean_learner import algo_config\n"
        "learner = algo_config().build_learner(env=gym.make('CartPole-v1'))\n"
        "grads = {ref: torch.full_like(p, 0.1) for ref, p in learner._params.items()}\n"
        "learner.apply_gradients(grads)\n"
        "learner.set_state(learner.get_state())\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], cwd=str(ROOT / "tests"), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "False"


CLIPS = [(), ("training.grad_clip=0.05", "training.grad_clip_by=norm"),
         ("training.grad_clip=0.05", "training.grad_clip_by=global_norm")]


@pytest.mark.parametrize("clip", CLIPS, ids=["no-clip", "clip-per-tensor", "clip-global"])
def test_same_update_as_rllib(episodes, clip):
    lean, plain = learner(*clip), learner("speedups=false", *clip)
    before = weights(plain)
    assert all(torch.equal(before[k], v) for k, v in weights(lean).items())
    for each in (lean, plain):  # the learner connector edits episodes in place: each gets its own
        each.update(episodes=copy.deepcopy(episodes), timesteps={"num_env_steps_sampled_lifetime": 400}, num_epochs=3, minibatch_size=100)
    after_lean, after_plain = weights(lean), weights(plain)
    assert any(not torch.equal(before[k], after_plain[k]) for k in before)  # it learned something
    for name, value in after_plain.items():
        torch.testing.assert_close(after_lean[name], value, rtol=1e-4, atol=1e-6)


def test_the_gradient_steps_cpu_time_is_summed_over_the_run(episodes):
    """`bench ingest` splits the learner's cost with it: only the gradient steps count, and only lean learners log it."""
    from ray.rllib.core import ALL_MODULES

    from rlplatform.internals import GRADIENT_CPU_S

    lean, plain = learner(), learner("speedups=false")
    results = lean.update(episodes=copy.deepcopy(episodes), timesteps={"num_env_steps_sampled_lifetime": 400},
                          num_epochs=3, minibatch_size=100)
    stats = results[ALL_MODULES][GRADIENT_CPU_S]
    assert type(stats).__name__ == "LifetimeSumStats" and stats.peek() > 0  # the algorithm's logger sums it over the run
    results = plain.update(episodes=copy.deepcopy(episodes), timesteps={"num_env_steps_sampled_lifetime": 400}, num_epochs=1)
    assert GRADIENT_CPU_S not in results[ALL_MODULES]


def test_non_finite_gradients_take_rllibs_path():
    lean, plain = learner(), learner("speedups=false")
    for each in (lean, plain):
        grads = {ref: torch.full_like(param, 0.1) for ref, param in each._params.items()}
        first = next(iter(grads))
        grads[first][0] = float("nan")  # RLlib zeroes it (with a warning) and steps
        each.apply_gradients(grads)
    for name, value in weights(plain).items():
        assert torch.isfinite(value).all()
        torch.testing.assert_close(weights(lean)[name], value, rtol=1e-5, atol=1e-7)


def test_ppo_loss_gradients_and_metrics_are_rllibs(episodes):
    """The lean PPO loss runs RLlib's operations in RLlib's order: the same numbers, not just close ones."""
    from ray.rllib.algorithms.ppo.torch.ppo_torch_learner import PPOTorchLearner
    from ray.rllib.core.columns import Columns

    lean = learner()
    minibatches = []
    own_loss = lean.compute_loss_for_module

    def record(**kwargs):  # keeps each minibatch the update computed its loss on
        minibatches.append(kwargs)
        return own_loss(**kwargs)

    lean.compute_loss_for_module = record
    lean.update(episodes=copy.deepcopy(episodes), timesteps={"num_env_steps_sampled_lifetime": 400}, num_epochs=1, minibatch_size=100)
    lean.compute_loss_for_module = own_loss
    assert minibatches
    params = list(lean.module["default_policy"].parameters())
    for seen in minibatches:
        batch, module_id = seen["batch"], seen["module_id"]
        assert Columns.LOSS_MASK in batch  # PPO's bootstrap step: the masked means are the ones compared
        results = []
        for loss_fn in (lean.compute_loss_for_module, lambda **kw: PPOTorchLearner.compute_loss_for_module(lean, **kw)):
            fwd_out = lean.module[module_id].forward_train(batch)
            loss = loss_fn(module_id=module_id, config=seen["config"], batch=batch, fwd_out=fwd_out)
            lean.log_last_minibatch_stats()  # the lean loss logs its statistics once per update
            grads = torch.autograd.grad(loss, params)
            logged = {k: float(v.detach() if torch.is_tensor(v) else v) for k, v in lean.metrics.peek(module_id).items() if not isinstance(v, dict)}
            results.append((loss.detach(), grads, logged))
        (loss_a, grads_a, logged_a), (loss_b, grads_b, logged_b) = results
        assert torch.equal(loss_a, loss_b)
        assert all(torch.equal(a, b) for a, b in zip(grads_a, grads_b))
        assert logged_a == logged_b and {"policy_loss", "vf_loss", "entropy", "mean_kl_loss"} <= set(logged_a)


def test_ppo_with_the_kl_term_takes_rllibs_loss(episodes, monkeypatch):
    from ray.rllib.algorithms.ppo.torch.ppo_torch_learner import PPOTorchLearner

    rllibs_loss, calls = PPOTorchLearner.compute_loss_for_module, []

    def observed(self, **kwargs):  # RLlib's own loss, called through: only counts who called it
        calls.append(self)
        return rllibs_loss(self, **kwargs)

    monkeypatch.setattr(PPOTorchLearner, "compute_loss_for_module", observed)
    lean, plain = learner("training.use_kl_loss=true"), learner("speedups=false", "training.use_kl_loss=true")
    results = {}
    for name, each in (("lean", lean), ("plain", plain)):
        results[name] = each.update(episodes=copy.deepcopy(episodes), timesteps={"num_env_steps_sampled_lifetime": 400},
                                    num_epochs=2, minibatch_size=100)
    lean_calls, plain_calls = sum(c is lean for c in calls), sum(c is plain for c in calls)
    assert lean_calls == plain_calls > 0  # every minibatch of the lean learner went to RLlib's loss
    # RLlib's loss with the KL term logs the real mean KL (the lean loss logs 0.0) and the KL coefficient
    kl = {name: float(r["default_policy"]["mean_kl_loss"]) for name, r in results.items()}
    assert kl["lean"] == pytest.approx(kl["plain"], rel=1e-4) and kl["lean"] > 0, kl
    assert "curr_kl_coeff" in results["lean"]["default_policy"]
    for name, value in weights(plain).items():
        torch.testing.assert_close(weights(lean)[name], value, rtol=1e-4, atol=1e-6)


def record_minibatches(lean) -> list[dict]:
    """Keeps each minibatch (and the module's training mode) that the lean loss sees."""
    seen, own_loss = [], lean.compute_loss_for_module

    def record(**kwargs):
        module = lean.module[kwargs["module_id"]]
        seen.append({**kwargs, "training": [m.training for m in module.modules()]})
        return own_loss(**kwargs)

    lean.compute_loss_for_module = record
    return seen


def test_each_minibatch_trains_in_training_mode_without_a_walk_per_minibatch(episodes):
    lean = learner()
    module = lean.module["default_policy"]
    walks, full_train = [], module.train
    module.train = lambda mode=True: (walks.append(mode), full_train(mode))[1]
    module.eval()  # the update puts it in training mode itself
    seen = record_minibatches(lean)
    own_loss = lean.compute_loss_for_module

    def switch_to_eval_once(**kwargs):
        loss = own_loss(**kwargs)
        if len(seen) == 2:
            module.eval()  # something between minibatches switches it out: the next one switches back
        return loss

    lean.compute_loss_for_module = switch_to_eval_once
    lean.update(episodes=copy.deepcopy(episodes), timesteps={"num_env_steps_sampled_lifetime": 400}, num_epochs=3, minibatch_size=100)
    assert len(seen) >= 10 and all(all(s["training"]) for s in seen)
    assert walks == [False, True, False, True]  # eval, the update's one walk, the switch out and back
    assert "forward_train" not in vars(module)  # RLlib's own method again after the update


def test_off_policyness_metric_is_rllibs(episodes):
    from ray.rllib.utils.metrics import DIFF_NUM_GRAD_UPDATES_VS_SAMPLER_POLICY, WEIGHTS_SEQ_NO

    from rlplatform.internals.lean_learner import LeanUpdate

    lean = learner()
    seen = record_minibatches(lean)
    lean.update(episodes=copy.deepcopy(episodes), timesteps={"num_env_steps_sampled_lifetime": 400}, num_epochs=1, minibatch_size=100)
    key = ("default_policy", DIFF_NUM_GRAD_UPDATES_VS_SAMPLER_POLICY)
    lean._weights_seq_no += 3  # as if three updates had passed since these samples
    for s in seen:
        batch = {"default_policy": s["batch"]}
        assert WEIGHTS_SEQ_NO in s["batch"]
        values = []
        for compute in (lambda b: LeanUpdate._compute_off_policyness(lean, b), lambda b: TorchLearner._compute_off_policyness(lean, b)):
            compute(batch)
            values.append(lean.metrics.peek(key))
        assert values[0] == values[1] and values[0] > 0


def test_minibatches_are_rllibs_to_the_bit(episodes):
    """The lean iterator cuts the same minibatches from the same random state as RLlib's cyclic iterator."""
    import numpy as np
    from ray.rllib.utils.minibatch_utils import MiniBatchCyclicIterator

    from rlplatform.internals.lean_learner import LeanMiniBatchIterator

    lean, built = learner(), []
    own_iterator = lean._create_iterator_if_necessary
    lean._create_iterator_if_necessary = lambda **kwargs: built.append(own_iterator(**kwargs)) or built[-1]
    lean.update(episodes=copy.deepcopy(episodes), timesteps={"num_env_steps_sampled_lifetime": 400}, num_epochs=1, minibatch_size=100)
    (used,) = built
    assert isinstance(used, LeanMiniBatchIterator)  # the update really took it
    batch = used._batch  # the learner connector's batch of tensors, as PPO's update gets it
    attributes = ("count", "num_grad_updates", "time_major", "zero_padded", "max_seq_len", "is_training", "_slice_seq_lens_in_B")
    for epochs, size, shuffle, total in ((3, 100, True, 0), (2, 64, True, 0), (2, 1000, True, 0), (1, 100, False, 7)):
        streams = []
        for lean_one in (False, True):
            np.random.seed(0)
            rllib_iterator = MiniBatchCyclicIterator(copy.deepcopy(batch), num_epochs=epochs, minibatch_size=size,
                                                     shuffle_batch_per_epoch=shuffle, num_total_minibatches=total)
            streams.append(list(LeanMiniBatchIterator(rllib_iterator) if lean_one else rllib_iterator))
        theirs, ours = streams
        assert len(ours) == len(theirs) >= (1 if size > len(batch) else 4)
        for a, b in zip(ours, theirs):
            assert a.env_steps() == b.env_steps()
            for module_id, y in b.policy_batches.items():
                x = a.policy_batches[module_id]
                assert list(x) == list(y) and all(torch.equal(x[k], y[k]) for k in y)
                assert [getattr(x, n) for n in attributes] == [getattr(y, n) for n in attributes]


def test_ppo_reports_the_statistics_of_the_updates_last_minibatch(episodes):
    """RLlib logs them with window=1 on every minibatch, so the update reports its last minibatch's:
    the lean PPO learner computes them once, from that minibatch (the same numbers as RLlib, above)."""
    from ray.rllib.utils.metrics import DIFF_NUM_GRAD_UPDATES_VS_SAMPLER_POLICY

    lean = learner()
    per_minibatch, batches, own_loss = [], [], lean.compute_loss_for_module

    def record(**kwargs):  # each minibatch's statistics, taken before its gradient step
        loss = own_loss(**kwargs)
        per_minibatch.append({k: float(v.detach()) for k, v in lean._last_minibatch_stats[kwargs["module_id"]]().items()})
        batches.append({kwargs["module_id"]: kwargs["batch"]})
        return loss

    lean.compute_loss_for_module = record
    results = lean.update(episodes=copy.deepcopy(episodes), timesteps={"num_env_steps_sampled_lifetime": 400}, num_epochs=2, minibatch_size=100)
    assert len(per_minibatch) >= 8 and per_minibatch[0] != per_minibatch[-1]
    reported = {k: float(v.peek()) for k, v in results["default_policy"].items()}
    assert {k: reported.get(k) for k in per_minibatch[-1]} == per_minibatch[-1]
    TorchLearner._compute_off_policyness(lean, batches[-1])  # RLlib's own, on the last minibatch
    key = DIFF_NUM_GRAD_UPDATES_VS_SAMPLER_POLICY
    assert reported[key] == float(lean.metrics.peek(("default_policy", key)))

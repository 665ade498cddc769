"""Env ids as experiment files write them: Gymnasium ids, `module:Id`, and our `rlplatform/` ids."""

import pytest

from rlplatform.env_ids import make_env, runner_env_id
from rlplatform.errors import UserError


def test_gymnasium_id_is_passed_through():
    assert runner_env_id("CartPole-v1") == "CartPole-v1"


def test_own_ids_travel_with_their_package_so_remote_runners_import_it():
    assert runner_env_id("rlplatform/CostlySim-v0") == "envs:rlplatform/CostlySim-v0"


def test_module_colon_id_is_kept():
    assert runner_env_id("envs:rlplatform/CostlySim-v0") == "envs:rlplatform/CostlySim-v0"


def test_unknown_module_and_atari_without_prefix_are_explained():
    with pytest.raises(UserError, match="cannot import module 'no_such_mod'"):
        runner_env_id("no_such_mod:Thing-v0")
    with pytest.raises(UserError, match="ale_py:ALE/Pong-v5"):
        runner_env_id("ALE/Pong-v5")


def test_costly_sim_burns_the_cpu_time_it_is_asked_for():
    import time

    env = make_env("rlplatform/CostlySim-v0", work_ms=2.0)
    env.reset(seed=0)
    start = time.thread_time()
    for _ in range(20):
        env.step(1)
    assert time.thread_time() - start >= 20 * 0.002 * 0.9

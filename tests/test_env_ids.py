"""Env ids as experiment files write them: Gymnasium ids, `module:Id`, and our `rlplatform/` ids."""

import pytest

from rlplatform.config.env_ids import make_env, runner_env_id
from rlplatform.errors import UserError


def test_gymnasium_id_is_passed_through():
    assert runner_env_id("CartPole-v1") == "CartPole-v1"


def test_own_ids_travel_with_their_package_so_remote_runners_import_it():
    assert runner_env_id("rlplatform/CostlySim-v0") == "rlplatform_envs:rlplatform/CostlySim-v0"


def test_module_colon_id_is_kept():
    assert runner_env_id("rlplatform_envs:rlplatform/CostlySim-v0") == "rlplatform_envs:rlplatform/CostlySim-v0"
    assert runner_env_id("gymnasium.envs.classic_control:CartPole-v1") == "gymnasium.envs.classic_control:CartPole-v1"


def test_ids_written_with_the_old_package_name_still_resolve():
    # Configs written before envs/ was installed as rlplatform_envs name the package `envs`.
    assert runner_env_id("envs:rlplatform/CostlySim-v0") == "rlplatform_envs:rlplatform/CostlySim-v0"


def test_our_envs_are_not_installed_as_a_global_envs_package():
    import importlib.util
    import subprocess
    import sys

    assert importlib.util.find_spec("rlplatform_envs") is not None
    # Outside the project's root (where the folder itself is on sys.path), `envs` is nobody's.
    out = subprocess.run([sys.executable, "-c", "import importlib.util; print(importlib.util.find_spec('envs'))"],
                         capture_output=True, text=True, cwd="/", check=True)
    assert out.stdout.strip() == "None", out.stdout


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

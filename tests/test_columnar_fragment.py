"""The columnar env runner's episodes are the per-step path's, field by field.

Two real lean env runners built from the same experiment and seed, in this process: one adds every
env step to its episode objects (RLlib's way), the other keeps the fragment as arrays and cuts the
episodes at its end (internals/columnar_fragment.py). They sample the same fragments one after the
other (torch's global generator is re-seeded when a runner is built), so their actions agree.
"""

import pickle

import numpy as np
import pytest
from conftest import ROOT
from ray.rllib.env.utils.infinite_lookback_buffer import InfiniteLookbackBuffer

from rlplatform.adapter.algorithm_config import build_algorithm_config
from rlplatform.config.experiment import resolve_experiment
from rlplatform.internals.columnar_fragment import FragmentEpisodes
from rlplatform.internals.episode_transport import EPISODE_SLOTS

FRAGMENTS = (7, 64, 1, 33, 200, 5, 400, 3)  # short ones cut episodes often; a 1-step fragment ends where a reset is due


def runner(columnar: bool, *overrides: str):
    from rlplatform.internals.lean_env_runner import LeanEnvRunner

    config = resolve_experiment(ROOT / "experiments" / "cartpole_ppo.yaml", ["seed=5", *overrides], "laptop").config
    lean = LeanEnvRunner(config=build_algorithm_config(config), worker_index=1, num_workers=1)
    assert lean.lean and lean._fragments is not None
    if not columnar:
        lean._fragments = None
    return lean


def sampled(columnar: bool, *overrides: str, fragments=FRAGMENTS, explore: bool = True):
    lean = runner(columnar, *overrides)
    batches = [lean.sample(num_timesteps=n, explore=explore) for n in fragments]
    returns = sorted(lean.get_metrics()["rlp_episode_returns"].peek())
    return batches, returns


def assert_buffers_equal(a: InfiniteLookbackBuffer, b: InfiniteLookbackBuffer, what: str):
    assert (a.lookback, a.finalized, a.space, a.space_struct) == (b.lookback, b.finalized, b.space, b.space_struct), what
    assert set(vars(a)) == set(vars(b)), what
    if isinstance(a.data, np.ndarray):
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape, what
        np.testing.assert_array_equal(a.data, b.data, err_msg=what)
    else:
        assert a.data == b.data, what


def assert_same_episodes(per_step: list, columnar: list):
    ids: dict[str, str] = {}
    for batch_a, batch_b in zip(per_step, columnar, strict=True):
        assert len(batch_a) == len(batch_b)
        for a, b in zip(batch_a, batch_b):
            assert ids.setdefault(a.id_, b.id_) == b.id_  # one id on both sides, across fragments
            assert (a.t_started, a.t, len(a)) == (b.t_started, b.t, len(b))
            for slot in EPISODE_SLOTS:
                assert hasattr(b, slot), slot
            assert (a.agent_id, a.module_id, a.multi_agent_episode_id, a.custom_data) == (b.agent_id, b.module_id, b.multi_agent_episode_id, b.custom_data)
            assert (a.observation_space, a.action_space) == (b.observation_space, b.action_space)
            assert (a.is_terminated, a.is_truncated) == (b.is_terminated, b.is_truncated)
            assert type(a.is_terminated) is type(b.is_terminated)
            for name in ("observations", "infos", "actions", "rewards"):
                assert_buffers_equal(getattr(a, name), getattr(b, name), f"{name} of {a.id_}")
            assert set(a.extra_model_outputs) == set(b.extra_model_outputs)
            for key in a.extra_model_outputs:
                assert_buffers_equal(a.extra_model_outputs[key], b.extra_model_outputs[key], f"{key} of {a.id_}")
            np.testing.assert_array_equal(a._last_added_observation, b._last_added_observation)
            assert a._last_added_infos == b._last_added_infos
            assert b._start_time is not None and b._start_time <= b._last_step_time
            b.validate()
    assert len(set(ids.values())) == len(ids)


@pytest.mark.parametrize("envs", [1, 4, 16])
def test_columnar_episodes_equal_the_per_step_ones(envs):
    per_step, returns_a = sampled(False, f"scale.envs_per_runner={envs}")
    columnar, returns_b = sampled(True, f"scale.envs_per_runner={envs}")
    assert sum(e.is_done for batch in per_step for e in batch) > envs  # episodes end inside and across fragments
    assert_same_episodes(per_step, columnar)
    assert returns_a == returns_b and returns_a
    shipped = [pickle.loads(pickle.dumps(batch, protocol=5)) for batch in columnar]  # as a remote runner's leave it
    assert all(type(batch) is FragmentEpisodes for batch in columnar)
    assert_same_episodes(per_step, shipped)


def test_one_step_fragments_end_and_reset_episodes_on_their_last_step():
    """Every episode ends on a fragment's last step and the next fragment's only step resets it."""
    per_step, _ = sampled(False, "scale.envs_per_runner=2", fragments=(1,) * 90)
    columnar, _ = sampled(True, "scale.envs_per_runner=2", fragments=(1,) * 90)
    assert sum(e.is_done for batch in per_step for e in batch) >= 2
    assert_same_episodes(per_step, columnar)


def test_greedy_sampling_too():
    per_step, _ = sampled(False, "scale.envs_per_runner=4", explore=False)
    columnar, _ = sampled(True, "scale.envs_per_runner=4", explore=False)
    assert_same_episodes(per_step, columnar)


def test_box_actions_and_truncation():
    """Pendulum: float actions, and every episode ends truncated by the time limit (200 steps)."""
    overrides = ("scale.envs_per_runner=3",)
    fragments = (150, 100, 3, 400, 600)
    per_step = [runner_batches for runner_batches in _sampled_pendulum(False, overrides, fragments)]
    columnar = [runner_batches for runner_batches in _sampled_pendulum(True, overrides, fragments)]
    assert any(e.is_truncated for batch in per_step for e in batch)
    assert_same_episodes(per_step, columnar)


def _sampled_pendulum(columnar, overrides, fragments):
    from rlplatform.internals.lean_env_runner import LeanEnvRunner

    config = resolve_experiment(ROOT / "experiments" / "pendulum_sac.yaml", ["seed=5", *overrides], "laptop").config
    lean = LeanEnvRunner(config=build_algorithm_config(config), worker_index=1, num_workers=1)
    assert lean._fragments is not None
    if not columnar:
        lean._fragments = None
    return [lean.sample(num_timesteps=n) for n in fragments]


def test_switching_to_rllibs_path_and_back_resets():
    lean = runner(True, "scale.envs_per_runner=2")
    first = lean.sample(num_timesteps=10)
    assert sum(e.env_steps() for e in lean.sample(num_timesteps=10, random_actions=True)) >= 10
    again = lean.sample(num_timesteps=10)
    assert not {e.id_ for e in first} & {e.id_ for e in again}  # fresh episodes after the random ones
    assert all(e.t_started == 0 for e in again)


def test_episode_callbacks_that_must_run_in_step_take_the_per_step_path():
    from rlplatform.internals.lean_env_runner import LeanEnvRunner

    config = build_algorithm_config(resolve_experiment(None, ["scale.envs_per_runner=2"]).config)
    config.callbacks(on_episode_end=lambda **_: None)  # not marked: it may read the env at the episode's end
    assert LeanEnvRunner(config=config, worker_index=1, num_workers=1)._fragments is None


def test_a_failed_env_step_keeps_the_finished_episodes_and_resets_as_rllib_does():
    """RLlib recreates the envs after a step raises (restart_failed_sub_environments) and starts over."""
    overrides = ("env=rlplatform/Faulty-v0", "env_config.env=CartPole-v1", "env_config.crash_mode=raise",
                 "env_config.crash_probability=0.01", "env_config.active=true", "env_config.seed=3",
                 "scale.envs_per_runner=4", "rllib.fault_tolerance.restart_failed_sub_environments=true")
    fragments = (300, 200, 300)
    per_step, _ = sampled(False, *overrides, fragments=fragments)
    lean = runner(True, *overrides)
    columnar = [lean.sample(num_timesteps=n) for n in fragments]
    assert lean.get_metrics()["num_env_step_failures"].peek() > 0
    assert_same_episodes(per_step, columnar)


def test_a_failed_env_step_without_restarts_raises_as_rllib_does_and_logs_the_steps_before_it():
    """Without `restart_failed_sub_environments` RLlib raises a RuntimeError from the env's error; the columnar
    loop does too, after counting the failure and feeding the env-step timer the fragment's steps, the failed
    one included (RLlib's timer block pushes on the way out either way)."""
    from ray.rllib.utils.metrics import ENV_STEP_TIMER

    overrides = ("env=rlplatform/Faulty-v0", "env_config.env=CartPole-v1", "env_config.crash_mode=raise",
                 "env_config.crash_probability=0.01", "env_config.active=true", "env_config.seed=3",
                 "scale.envs_per_runner=4", "rllib.fault_tolerance.restart_failed_sub_environments=false")
    for columnar in (True, False):
        lean = runner(columnar, *overrides)
        with pytest.raises(RuntimeError) as raised:
            for _ in range(50):
                lean.sample(num_timesteps=100)
        assert raised.value.__cause__ is not None, columnar  # the env's own error, chained
        metrics = lean.get_metrics()
        assert metrics["num_env_step_failures"].peek() == 1, columnar
        assert metrics[ENV_STEP_TIMER].peek() > 0, columnar


def test_an_episode_chunk_starts_its_clock_in_its_own_fragment():
    """RLlib's `cut` leaves a continuation without a start time: each chunk's duration lies within the `sample`
    call that returned it (no time bound: the call's own span is the measure), over 60 one-step fragments."""
    import time as clock

    lean = runner(True, "scale.envs_per_runner=2")
    for _ in range(60):
        before = clock.perf_counter()
        episodes = lean.sample(num_timesteps=1)
        span = clock.perf_counter() - before
        for episode in episodes:
            assert episode.get_duration_s() <= span, (episode.t_started, len(episode))
        clock.sleep(0.01)  # a pause between fragments, which no chunk's duration may include


def test_a_changed_list_or_custom_data_pickles_packed_and_keeps_it():
    lean = runner(True, "scale.envs_per_runner=4")
    episodes = lean.sample(num_timesteps=100)
    episodes[0].custom_data["seen"] = 1
    assert pickle.loads(pickle.dumps(episodes))[0].custom_data == {"seen": 1}
    again = lean.sample(num_timesteps=100)
    again.reverse()
    assert [e.id_ for e in pickle.loads(pickle.dumps(again))] == [e.id_ for e in again]


def test_an_extra_output_the_last_fragment_lacked_gets_a_zero_lookback():
    import gymnasium as gym
    from ray.rllib.env.single_agent_episode import SingleAgentEpisode

    from rlplatform.internals.columnar_fragment import ColumnarFragments

    obs_space, act_space = gym.spaces.Box(-1, 1, (3,), np.float32), gym.spaces.Discrete(2)
    starts = []
    for _ in range(2):
        episode = SingleAgentEpisode(observation_space=obs_space, action_space=act_space)
        episode.add_env_reset(observation=np.zeros(3, np.float32))
        starts.append(episode)
    fragments = ColumnarFragments(obs_space, act_space)
    fragments.start(starts)
    never = np.zeros(2, bool)
    for extras in ({"logp": np.zeros(2, np.float32)}, {"logp": np.zeros(2, np.float32), "vf": np.ones(2, np.float32)}):
        fragments.begin()
        for _ in range(3):
            fragments.add(np.zeros(2, np.int64), dict(extras), np.ones((2, 3), np.float32), np.ones(2), never, never, [{}, {}])
        _, episodes = fragments.finish({})
    for episode in episodes:  # chunks continuing the first fragment's episodes
        episode.validate()
        assert episode.extra_model_outputs["vf"].lookback == 1
        np.testing.assert_array_equal(episode.extra_model_outputs["vf"].data, [0.0, 1.0, 1.0, 1.0])


def test_episode_end_callbacks_see_the_earlier_chunks_also_before_a_failed_step():
    """on_episode_end of an episode that ended before a failed env step runs before RLlib's reset forgets its
    earlier chunks: the recorded lengths and returns equal the per-step path's."""
    from rlplatform.internals.columnar_fragment import runs_at_fragment_end
    from rlplatform.internals.lean_env_runner import LeanEnvRunner

    overrides = ["env=rlplatform/Faulty-v0", "env_config.env=CartPole-v1", "env_config.crash_mode=raise",
                 "env_config.crash_probability=0.01", "env_config.active=true", "env_config.seed=3", "seed=5",
                 "scale.envs_per_runner=4", "rllib.fault_tolerance.restart_failed_sub_environments=true"]
    recorded = {}
    for columnar in (False, True):
        seen = recorded.setdefault(columnar, [])

        def record(*, episode, prev_episode_chunks=(), _seen=seen, **_):
            _seen.append((len(episode) + sum(len(c) for c in prev_episode_chunks),
                          float(episode.get_return() + sum(c.get_return() for c in prev_episode_chunks))))

        config = build_algorithm_config(resolve_experiment(ROOT / "experiments" / "cartpole_ppo.yaml", overrides, "laptop").config)
        config.callbacks(on_episode_end=runs_at_fragment_end(record))
        lean = LeanEnvRunner(config=config, worker_index=1, num_workers=1)
        assert lean._fragments is not None
        if not columnar:
            lean._fragments = None
        for n in (30, 300, 200):
            lean.sample(num_timesteps=n)
        assert lean.get_metrics()["num_env_step_failures"].peek() > 0
    assert recorded[True] == recorded[False] and recorded[True]


def test_with_an_on_sample_end_callback_the_episodes_travel_packed():
    """Such a callback may change the episodes after they were cut: the columns would not carry that."""
    from rlplatform.internals.episode_transport import PackedEpisodes
    from rlplatform.internals.lean_env_runner import LeanEnvRunner

    config = build_algorithm_config(resolve_experiment(None, ["scale.envs_per_runner=2"]).config)
    config.callbacks(on_sample_end=lambda *, samples, **_: samples[0].custom_data.update(tagged=True))
    lean = LeanEnvRunner(config=config, worker_index=1, num_workers=1)
    assert lean._fragments is not None  # the columnar path samples; only the transport changes
    episodes = lean.sample(num_timesteps=20)
    assert type(episodes) is PackedEpisodes
    assert pickle.loads(pickle.dumps(episodes))[0].custom_data == {"tagged": True}


def test_rllibs_env_step_timer_gets_each_vector_steps_time():
    """The columnar loop feeds RLlib's env-step timer at the fragment's end: each vector step's own time, as
    RLlib's per-step `_try_env_step` does (not the fragment's total, not a per-sub-env share). Each vector step
    of two sub-envs sleeps at least 2 x 3 ms, so both paths' timers read at least 6 ms and agree."""
    from ray.rllib.utils.metrics import ENV_STEP_TIMER

    overrides = ("env=rlplatform/CostlySim-v0", "env_config.work_ms=0.0", "env_config.wait_ms=3.0",
                 "scale.envs_per_runner=2")
    timers = {}
    for columnar in (True, False):
        lean = runner(columnar, *overrides)
        for _ in range(3):
            lean.sample(num_timesteps=20)
        timers[columnar] = lean.get_metrics()[ENV_STEP_TIMER].peek()
    assert timers[True] >= 0.006 and timers[False] >= 0.006, timers
    assert 0.5 < timers[True] / timers[False] < 2, timers

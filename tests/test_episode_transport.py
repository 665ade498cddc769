"""A remote runner's episodes, packed column by column, unpickle to the episodes RLlib's own pickling gives.

Real env runners sample real experiments in this process; the last tests send episodes through a
real private Ray instance (its object store, zero-copy) and from a real remote runner actor.
"""

import pickle

import numpy as np
import pytest
import ray
import ray.cloudpickle as cloudpickle
from ray.rllib.env.single_agent_episode import SingleAgentEpisode
from ray.rllib.env.utils.infinite_lookback_buffer import InfiniteLookbackBuffer
from test_lean_env_runner import runner

from rlplatform.adapter.env_runners import remote_env_runners
from rlplatform.config.experiment import resolve_experiment
from rlplatform.config.sizing import Resources
from rlplatform.infra.local_ray import connect as connect_ray
from rlplatform.infra.local_ray import shutdown as shutdown_ray
from rlplatform.internals.columnar_fragment import FragmentEpisodes
from rlplatform.internals.episode_stats import chunk_return
from rlplatform.internals.episode_transport import EPISODE_SLOTS, PackedEpisodes


def through_pickle(value):
    """As Ray pickles a task's result: cloudpickle, protocol 5, arrays as out-of-band buffers."""
    buffers = []
    data = cloudpickle.dumps(value, protocol=5, buffer_callback=buffers.append)
    return pickle.loads(data, buffers=[memoryview(b).toreadonly() for b in buffers]), len(buffers)


def assert_same(a, b, path="episode"):
    assert type(a) is type(b), f"{path}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape, path
        np.testing.assert_array_equal(a, b, err_msg=path)
    elif isinstance(a, SingleAgentEpisode):
        for name in EPISODE_SLOTS:
            assert_same(getattr(a, name), getattr(b, name), f"{path}.{name}")
    elif isinstance(a, InfiniteLookbackBuffer):
        assert_same(vars(a), vars(b), path)
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for key in a:
            assert_same(a[key], b[key], f"{path}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


@pytest.mark.parametrize("experiment,overrides,steps", [
    ("cartpole_ppo", ["scale.envs_per_runner=16"], 800),  # Discrete actions: many done episodes and chunks
    ("pendulum_sac", ["scale.envs_per_runner=2"], 60),  # Box actions, only chunks
    ("cartpole_ppo", ["scale.envs_per_runner=2", "model.use_lstm=true", "model.max_seq_len=4"], 60),  # RLlib's path
])
def test_packed_episodes_unpickle_to_what_plain_pickling_gives(experiment, overrides, steps):
    sampler = runner(experiment, *overrides)
    sampled = sampler.sample(num_timesteps=steps)
    # A remote runner (worker_index 1) packs what it returns; the columnar one ships its fragment's columns.
    assert type(sampled) is (FragmentEpisodes if sampler._fragments is not None else PackedEpisodes)
    episodes = PackedEpisodes(list(sampled))  # what a lean runner whose episodes are not columnar sends
    packed, packed_buffers = through_pickle(episodes)
    plain, plain_buffers = through_pickle(list(episodes))
    assert type(packed) is list and len(packed) == len(episodes) > 0
    assert_same(packed, plain)
    shipped, shipped_buffers = through_pickle(sampled)
    assert_same(shipped, plain)
    assert shipped_buffers <= packed_buffers
    for episode in shipped:
        assert not episode.observations.data.flags.writeable
    assert len(episodes) >= 2  # each of the runner's (at least 2) sub-envs returns at least its running chunk
    assert packed_buffers < plain_buffers  # the arrays of all episodes travel in fewer out-of-band buffers
    if sampler.lean:  # every column packs: one buffer per array column, however many episodes
        assert through_pickle(PackedEpisodes(list(episodes)[:2]))[1] == packed_buffers
    for episode in packed:
        episode.validate()
        assert episode.is_numpy
        assert not episode.observations.data.flags.writeable  # read-only, as Ray's zero-copy arrays are
        assert chunk_return(episode) == episode.get_return()


def test_packed_episodes_keep_working_as_episodes():
    sampler = runner("cartpole_ppo", "scale.envs_per_runner=4")
    sampler.sample(num_timesteps=100)
    (packed, _) = through_pickle(PackedEpisodes(sampler.sample(num_timesteps=40)))
    chunk = next(e for e in packed if not e.is_done)
    assert len(chunk.get_observations()) == len(chunk) + 1
    successor = chunk.cut(len_lookback_buffer=1)
    assert successor.id_ == chunk.id_ and successor.t_started == chunk.t
    np.testing.assert_array_equal(successor.get_observations(-1), chunk.get_observations(-1))


def test_anything_but_single_agent_episodes_pickles_as_a_plain_list():
    values = PackedEpisodes([1, "two", np.arange(3)])
    out, _ = through_pickle(values)
    assert type(out) is list and out[:2] == [1, "two"]
    np.testing.assert_array_equal(out[2], np.arange(3))
    assert through_pickle(PackedEpisodes())[0] == []


def test_chunk_return_is_get_return_on_lists_with_a_lookback():
    episode = SingleAgentEpisode(observations=[0.0] * 6, actions=[0] * 5, rewards=[1.0, 2.0, 0.5, -1.0, 3.0],
                                 len_lookback_buffer=2)
    assert chunk_return(episode) == episode.get_return() == 2.5
    episode.to_numpy()
    assert chunk_return(episode) == episode.get_return() == 2.5


@pytest.fixture(scope="module")
def local_ray():
    connect_ray(None, Resources(2, 0, [{"CPU": 2, "GPU": 0}]))
    yield
    shutdown_ray()


@pytest.mark.slow  # a private local Ray instance
def test_packed_episodes_through_rays_object_store(local_ray):
    episodes = runner("cartpole_ppo", "scale.envs_per_runner=16").sample(num_timesteps=800)
    assert type(episodes) is FragmentEpisodes
    assert_same(ray.get(ray.put(episodes)), through_pickle(list(episodes))[0])
    assert_same(ray.get(ray.put(PackedEpisodes(episodes))), through_pickle(list(episodes))[0])


@pytest.mark.slow  # a private local Ray instance
def test_a_remote_lean_runner_delivers_plain_episodes(local_ray):
    config = resolve_experiment(None, ["scale.envs_per_runner=8"]).config
    (remote,) = remote_env_runners(config, 1, num_cpus=0)
    try:
        episodes = ray.get(remote.sample.remote(num_timesteps=400), timeout=120)
    finally:
        ray.kill(remote)
    assert type(episodes) is list and all(type(e) is SingleAgentEpisode for e in episodes)
    assert 400 <= sum(e.env_steps() for e in episodes) < 408
    for episode in episodes:
        episode.validate()

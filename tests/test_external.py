"""Simulators outside Ray (`env: external`): the wire format, the runner's answers to good and bad clients, and
PPO and APPO learning CartPole from simulator processes that are not Ray workers.

The runner tests build the real `ExternalEnvRunner` in this process, listening on a real socket, and talk to it
with the real client (and with raw bytes, for what a broken client sends). The learning tests run `train` and
the example simulator (`python -m rlplatform.client.cartpole`) as separate OS processes.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
from conftest import ROOT, assert_user_error, only_run_dir, run_cli

from rlplatform.client import ExternalClient, protocol

PRESET = ROOT / "experiments" / "cartpole_external_ppo.yaml"


# ---- the wire format --------------------------------------------------------------------------------------


def _framed(message: dict) -> bytes:
    """A message framed by hand (msgpack without the client's array encoding)."""
    import msgpack

    body = msgpack.packb(message, use_bin_type=True)
    return b"%08d" % len(body) + body


def _pipe():
    a, b = socket.socketpair()
    return a, b


def test_arrays_and_scalars_cross_the_wire_unchanged():
    a, b = _pipe()
    arrays = {"f32": np.arange(6, dtype=np.float32).reshape(2, 3), "i64": np.array([-1, 2**40]), "u8": np.zeros((2, 2, 3), np.uint8),
              "f64": np.array([np.inf, -0.5]), "bool": np.array([True, False]), "empty": np.zeros((0, 4), np.float32)}
    protocol.send(a, {"type": protocol.EPISODES, "arrays": arrays, "scalar": np.float32(1.5), "nested": [{"x": arrays["i64"]}]})
    kind, body = protocol.receive(b)
    assert kind == protocol.EPISODES and body["scalar"] == 1.5
    for key, value in arrays.items():
        assert body["arrays"][key].dtype == value.dtype and body["arrays"][key].shape == value.shape
        np.testing.assert_array_equal(body["arrays"][key], value)
    np.testing.assert_array_equal(body["nested"][0]["x"], arrays["i64"])


@pytest.mark.parametrize("raw, fragment", [
    (b"abcdefgh", "8 ASCII digits"),
    (b"99999999", "over the limit"),
    (b"00000003\xc1\xc1\xc1", "not msgpack"),
    (protocol.pack({"no_type": 1}), "`type` string"),
    (_framed({"type": "X", "a": {"__ndarray__": True, "dtype": "float32", "shape": [3], "data": b"\x00" * 5}}), "needs 12 bytes"),
    (_framed({"type": "X", "a": {"__ndarray__": True, "dtype": "object", "shape": [1], "data": b"\x00" * 8}}), "malformed array"),
])
def test_bytes_that_break_the_protocol_are_named(raw, fragment):
    a, b = _pipe()
    a.sendall(raw)
    with pytest.raises(protocol.ProtocolError, match=fragment):
        protocol.receive(b, max_bytes=1000)


def test_free_ports_for_the_runners_come_from_outside_the_ranges_other_processes_draw_from():
    from rlplatform.run import plan

    low, high = plan._ephemeral_ports()
    ports = plan._listen_ports("127.0.0.1", 4)
    assert len(set(ports)) == 4
    for port in ports:
        assert not low <= port <= high and not plan.RAY_WORKER_PORTS[0] <= port <= plan.RAY_WORKER_PORTS[1], port
        socket.create_server(("127.0.0.1", port)).close()  # free now
    with socket.create_server(("127.0.0.1", ports[0])):  # a port taken now is not handed out
        assert ports[0] not in plan._listen_ports("127.0.0.1", 1)


def test_an_error_message_and_a_closed_connection_reach_the_caller():
    a, b = _pipe()
    protocol.send(a, {"type": protocol.ERROR, "error": "refused: token"})
    with pytest.raises(protocol.PeerError, match="refused: token"):
        protocol.receive(b)
    a.close()
    with pytest.raises(protocol.PeerError, match="closed"):
        protocol.receive(b)


# ---- the experiment ---------------------------------------------------------------------------------------


def _config(*overrides: str):
    from rlplatform.config.experiment import resolve_experiment

    return resolve_experiment(PRESET, list(overrides), "laptop").config


@pytest.mark.parametrize("override, fragment", [
    ("env=CartPole-v1", "needs env: external"),
    ("algorithm=DQN", "external simulators train PPO, APPO, IMPALA"),
    ("model.use_lstm=true", "model.use_lstm"),
    ("evaluation.interval=5", "evaluation.interval"),
    ("scale.env_runners=0", "scale.env_runners = 0"),
    ("external.host=0.0.0.0", "external.token_file"),
    ("external.action_space={type: Box, shape: [2, 2], low: -1, high: 1}", "1-D Box"),
    ("external.observation_space={type: Discrete}", "a Discrete space needs n"),
])
def test_an_external_experiment_that_cannot_run_is_refused_in_one_line(override, fragment, tmp_path):
    assert_user_error(run_cli("train", PRESET, "--set", override, "--runs-dir", tmp_path, timeout=120), fragment)
    assert not list(tmp_path.rglob("config.yaml"))


# ---- the runner, in this process, against real clients ------------------------------------------------------


@pytest.fixture
def runner(tmp_path):
    from rlplatform.adapter.algorithm_config import build_algorithm_config
    from rlplatform.adapter.external_runner import ExternalEnvRunner

    token_file = tmp_path / "token"
    token_file.write_text("let-me-in\n")
    algo_config = build_algorithm_config(_config(f"external.token_file={token_file}", "training.train_batch_size_per_learner=64", "training.minibatch_size=32", "scale.env_runners=2"))
    runner = ExternalEnvRunner(config=algo_config, worker_index=1, num_workers=2)
    module = algo_config.get_rl_module_spec(spaces=runner.get_spaces(), inference_only=True).build()
    runner.set_state({"rl_module": module.get_state(), "weights_seq_no": 1})
    yield runner
    runner.stop()


def _client(runner, **kwargs) -> ExternalClient:
    return ExternalClient("127.0.0.1", runner.port, token="let-me-in", connect_timeout=10, seed=0, **kwargs)


def _play(client: ExternalClient, steps: int, record: list, seed: int = 0) -> None:
    """CartPole for `steps` steps through the client; what it did, step by step, into `record` as it goes."""
    env = gym.make("CartPole-v1")
    obs = client.start_episode(env.reset(seed=seed)[0])
    for _ in range(steps):
        action = client.act(obs)
        next_obs, reward, terminated, truncated, _ = env.step(action)
        record.append((obs, action, reward))
        client.step(next_obs, float(reward), terminated, truncated)
        obs = next_obs if not (terminated or truncated) else client.start_episode(env.reset()[0])


def test_a_client_gets_config_and_weights_and_its_batch_arrives_as_rllib_episodes(runner):
    client = _client(runner)
    assert client.config["fragment"] == 32 and client.config["policy"]["action_kind"] == "categorical"
    assert client.weights_seq_no == 1
    record: list = []
    player = threading.Thread(target=_play, args=(client, 32, record))  # blocks for the next weights at step 32
    player.start()
    episodes = runner.sample()
    assert sum(len(e) for e in episodes) == 32
    flat_obs = np.concatenate([e.get_observations()[:-1] for e in episodes])
    np.testing.assert_allclose(flat_obs, np.stack([r[0] for r in record]), rtol=0, atol=0)
    np.testing.assert_array_equal(np.concatenate([e.get_actions() for e in episodes]), [r[1] for r in record])
    assert all(e.get_extra_model_outputs("action_logp").shape == (len(e),) for e in episodes)
    assert player.is_alive()  # on-policy: the client waits for weights newer than the ones it acted with
    runner.set_state({"rl_module": runner.get_state()["rl_module"], "weights_seq_no": 2})
    player.join(timeout=30)
    assert not player.is_alive() and client.weights_seq_no == 2
    metrics = runner.get_metrics()
    assert metrics["num_env_steps_sampled"] == 32
    client.close()


def _raw(runner) -> socket.socket:
    return socket.create_connection(("127.0.0.1", runner.port), timeout=10)


def _refusal(sock: socket.socket) -> str:
    """The ERROR the runner sent, after which it closed the connection."""
    with pytest.raises(protocol.PeerError) as caught:
        protocol.receive(sock)
    assert sock.recv(1) == b""  # closed
    return str(caught.value)


def _ping(token="let-me-in", version=protocol.PROTOCOL) -> dict:
    return {"type": protocol.PING, "protocol": version, "token": token}


@pytest.mark.parametrize("messages, fragment", [
    ([b"not-a-header"], "8 ASCII digits"),
    ([b"%08d" % (protocol.MAX_MESSAGE_BYTES + 1)], "over the limit"),
    ([protocol.pack({"type": protocol.GET_STATE})], "the first message must be PING"),
    ([protocol.pack(_ping(version="rlplatform-rllink/0"))], "not this run's"),
    ([protocol.pack(_ping(token="wrong"))], "needs its token"),
    ([protocol.pack(_ping(token=None))], "needs its token"),
    ([protocol.pack(_ping()), protocol.pack({"type": "LAUNCH"})], "unknown message type 'LAUNCH'"),
    ([protocol.pack(_ping()), b"%08d" % (protocol.MAX_MESSAGE_BYTES + 1)], "over the limit"),
    ([protocol.pack(_ping()), protocol.pack({"type": protocol.EPISODES, "episodes": "all of them"})], "must be a list"),
    ([protocol.pack(_ping()), protocol.pack({"type": protocol.EPISODES, "episodes": [{
        "observations": np.zeros((3, 5), np.float32), "actions": np.zeros(2, np.int64), "rewards": np.zeros(2, np.float32),
        "action_logp": np.zeros(2, np.float32), "action_dist_inputs": np.zeros((2, 2), np.float32)}]})], "observations of shape [5]"),
    ([protocol.pack(_ping()), protocol.pack({"type": protocol.EPISODES, "episodes": [{
        "observations": np.zeros((3, 4), np.float32), "actions": np.array([0, 7]), "rewards": np.zeros(2, np.float32),
        "action_logp": np.zeros(2, np.float32), "action_dist_inputs": np.zeros((2, 2), np.float32)}]})], "integers in [0, 2)"),
    ([protocol.pack(_ping()), protocol.pack({"type": protocol.EPISODES, "episodes": [{
        "observations": np.zeros((3, 4), np.float32), "actions": np.zeros(2, np.int64), "rewards": np.array([0, np.nan], np.float32),
        "action_logp": np.zeros(2, np.float32), "action_dist_inputs": np.zeros((2, 2), np.float32)}]})], "must be finite"),
])
def test_a_bad_client_gets_an_error_and_a_closed_connection_and_the_runner_serves_on(runner, messages, fragment):
    sock = _raw(runner)
    for i, message in enumerate(messages):
        sock.sendall(message)
        if i == 0 and len(messages) > 1:
            assert protocol.receive(sock)[0] == protocol.PONG
    assert fragment in _refusal(sock)
    time.sleep(0.2)
    assert not runner._received  # nothing of a refused message reaches the learner
    client = _client(runner)  # the next simulator is served as ever
    assert client.weights_seq_no == 1
    client.close()


def test_a_port_takes_one_simulator_at_a_time_and_the_next_after_it_leaves(runner):
    idle = _raw(runner)  # connects and says nothing: holds no port
    first = _client(runner)
    second = _raw(runner)
    second.sendall(protocol.pack(_ping()))
    assert "busy" in _refusal(second)
    first.close()
    time.sleep(0.3)
    again = _client(runner)
    assert again.weights_seq_no == 1
    again.close()
    idle.close()


def test_a_waiting_simulator_goes_on_with_unchanged_weights_when_the_learner_asks_again(runner):
    """PPO asks again before an update (a round that came up short): the simulator, waiting for the next weights,
    samples on with the ones it has, which are still the learner's."""
    client = _client(runner)
    record: list = []
    player = threading.Thread(target=_play, args=(client, 64, record))
    player.start()
    assert sum(len(e) for e in runner.sample()) == 32  # the first batch; the client now waits
    assert sum(len(e) for e in runner.sample()) == 32  # asked again, no update between: the client was let go
    assert client.weights_seq_no == 1 and len(record) == 64  # the second batch sampled with the same weights
    runner.set_state({"rl_module": runner.get_state()["rl_module"], "weights_seq_no": 2})
    player.join(timeout=30)
    assert not player.is_alive() and client.weights_seq_no == 2
    client.close()


# ---- training through simulator processes ---------------------------------------------------------------------


def _start_train(tmp_path: Path, *overrides: str) -> tuple[subprocess.Popen, Path]:
    runs = tmp_path / "runs"
    train = subprocess.Popen([sys.executable, "-m", "rlplatform", "train", str(PRESET), "--runs-dir", str(runs),
                              *[a for o in overrides for a in ("--set", o)]],
                             cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 180
    while not list(runs.glob("*/*/external.json")):
        assert train.poll() is None and time.monotonic() < deadline, train.stdout.read() if train.stdout else ""
        time.sleep(0.5)
    return train, only_run_dir(runs, "cartpole-external-ppo")


def _simulator(run_dir: Path, index: int, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "rlplatform.client.cartpole", "--run-dir", str(run_dir), "--index", str(index),
                             "--seed", str(index), *extra], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(train: subprocess.Popen, simulators: list, timeout: float) -> str:
    try:
        out, _ = train.communicate(timeout=timeout)
    finally:
        for sim in simulators:
            if sim.poll() is None:
                sim.kill()
    assert train.returncode == 0, out
    return out


def _last_metrics(run_dir: Path) -> dict:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return json.loads(lines[-1])


APPO = ["algorithm=APPO", "training={lr: 0.001, gamma: 0.99, vf_loss_coeff: 0.05, entropy_coeff: 0.0, clip_param: 0.2, "
        "use_kl_loss: false, grad_clip: null, train_batch_size_per_learner: 512, minibatch_size: 256, num_epochs: 1, "
        "circular_buffer_num_batches: 4, circular_buffer_iterations_per_batch: 1, broadcast_interval: 1}",
        "scale.rollout_fragment_length=64", "rllib.reporting={min_time_s_per_iteration: 1}"]


@pytest.mark.slow
@pytest.mark.learning
@pytest.mark.parametrize("algorithm", ["PPO", "APPO"])
def test_cartpole_stepped_by_two_simulator_processes_learns_to_475(tmp_path, algorithm):
    overrides = ["stop.env_steps=400000"] if algorithm == "PPO" else [*APPO, "stop.env_steps=1500000"]
    train, run_dir = _start_train(tmp_path, *overrides)
    simulators = [_simulator(run_dir, i) for i in range(2)]
    out = _finish(train, simulators, timeout=900)
    assert "stopped: return" in out, out
    assert _last_metrics(run_dir)["return/mean"] >= 475


@pytest.mark.slow
def test_a_killed_simulator_loses_its_steps_only_and_one_that_reconnects_carries_on(tmp_path):
    train, run_dir = _start_train(tmp_path, "stop.iterations=12", "stop.return_mean=null", "external.sample_timeout_s=3",
                                  "training.train_batch_size_per_learner=400")
    steady = _simulator(run_dir, 0, "--reconnect")
    victim = _simulator(run_dir, 1)
    deadline = time.monotonic() + 120
    while not (run_dir / "metrics.jsonl").exists() or len((run_dir / "metrics.jsonl").read_text().splitlines()) < 3:
        assert time.monotonic() < deadline and train.poll() is None
        time.sleep(0.5)
    os.kill(victim.pid, signal.SIGKILL)  # mid-episode, mid-batch
    victim.wait()
    time.sleep(4)
    returning = _simulator(run_dir, 1, "--reconnect")  # a simulator comes back on the same port
    out = _finish(train, [steady, returning], timeout=600)
    assert "stopped: iterations 12" in out, out
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert lines[-1]["iteration"] == 12 and lines[-1]["faults/healthy_env_runners"] == 2


@pytest.mark.slow
def test_an_appo_run_with_a_port_left_empty_trains_on_the_other_and_stops(tmp_path):
    """A runner whose simulator never came (or went away) waits in `sample()`; the run trains on the other
    and, at its end, tells the waiting runner to return, so that stopping does not hang."""
    train, run_dir = _start_train(tmp_path, *APPO, "stop.iterations=6", "stop.return_mean=null")
    only = _simulator(run_dir, 0)
    out = _finish(train, [only], timeout=300)
    assert "stopped: iterations 6" in out, out
    assert _last_metrics(run_dir)["env_steps"] > 0

"""`rlplatform serve`: request checks, and a real Serve application driven over real HTTP.

The request checks run without Ray. The application tests train CartPole PPO for one iteration, start
`python -m rlplatform serve RUN_DIR` as a user would (its own process, a private Ray instance, Ray
Serve's proxy on a free loopback port, a bearer token), and talk to it with an HTTP client: actions
equal what `evaluate` computes from the checkpoint, batched requests each get their own, every bad
request gets a 4xx naming its field and the replica goes on serving.
"""

import io
import json
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
from conftest import ROOT, assert_user_error, only_run_dir, run_cli
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from rlplatform.serving.requests import NPY_CONTENT_TYPE, BadRequest, ObservationSpec, parse_act

BOX = gym.spaces.Box(low=np.array([-1, -2, -np.inf], np.float32), high=np.array([1, 2, np.inf], np.float32))
SPECS = {"pi": ObservationSpec.of(BOX), "image": ObservationSpec.of(gym.spaces.Box(0, 255, (2, 2, 3), np.uint8))}
TOKEN = "s3cret-token"


def _parse(body, content_type="application/json", query=None, **kwargs):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return parse_act(raw, content_type, query or {}, SPECS, "pi", **kwargs)


def _npy(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return buffer.getvalue()


def test_a_json_request_and_its_npy_twin_read_the_same():
    obs = [[0.5, -1.0, 1e6], [0.0, 2.0, -3.0]]
    by_json = _parse({"observations": obs, "stochastic": True})
    by_npy = _parse(_npy(np.array(obs, np.float64)), NPY_CONTENT_TYPE, {"stochastic": "true"})
    for request in (by_json, by_npy):
        assert request.policy == "pi" and request.stochastic is True
        assert request.observations.dtype == np.float32 and request.observations.shape == (2, 3)
        np.testing.assert_array_equal(request.observations, np.array(obs, np.float32))
    image = _parse(_npy(np.full((1, 2, 2, 3), 7, np.uint8)), NPY_CONTENT_TYPE, {"policy": "image"})
    assert image.policy == "image" and image.observations.dtype == np.uint8


BAD = {
    "not json": (b"{nope", 400, "body"),
    "JSON nested past Python's recursion": (b"[" * 100_000 + b"]" * 100_000, 400, "body"),
    "not an object": ([1, 2], 400, "body"),
    "no observations": ({"policy": "pi"}, 422, "observations"),
    "unknown field": ({"observations": [[0, 0, 0]], "greedy": True}, 422, "greedy"),
    "wrong shape": ({"observations": [[0, 0]]}, 422, "observations"),
    "one observation, no batch": ({"observations": [0, 0, 0]}, 422, "observations"),
    "ragged": ({"observations": [[0, 0, 0], [0, 0]]}, 422, "observations"),
    "strings": ({"observations": [["a", "b", "c"]]}, 422, "observations"),
    "empty batch": ({"observations": []}, 422, "observations"),
    "NaN": (b'{"observations": [[0, NaN, 0]]}', 422, "observations[0][1]"),
    "infinity": (b'{"observations": [[0, 0, 0], [Infinity, 0, 0]]}', 422, "observations[1][0]"),
    "above the Box": ({"observations": [[0, 2.5, 0]]}, 422, "observations[0][1]"),
    "below the Box": ({"observations": [[0, 0, 0], [-1.01, 0, 0]]}, 422, "observations[1][0]"),
    "fractions for uint8 pixels": ({"observations": np.full((1, 2, 2, 3), 0.5).tolist(), "policy": "image"}, 422, "observations"),
    "pixel above 255": ({"observations": np.full((1, 2, 2, 3), 256).tolist(), "policy": "image"}, 422, "observations[0][0][0][0]"),
    "unknown policy": ({"observations": [[0, 0, 0]], "policy": "nobody"}, 404, "policy"),
    "policy not a string": ({"observations": [[0, 0, 0]], "policy": 3}, 422, "policy"),
    "stochastic not a bool": ({"observations": [[0, 0, 0]], "stochastic": "yes"}, 422, "stochastic"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_request_names_its_field(case):
    body, status, field = BAD[case]
    with pytest.raises(BadRequest) as caught:
        _parse(body)
    assert (caught.value.status, caught.value.field) == (status, field), caught.value.message


def _npy_header_only(shape: tuple) -> bytes:
    buffer = io.BytesIO()
    np.lib.format.write_array_header_1_0(buffer, {"descr": "<f4", "fortran_order": False, "shape": shape})
    return buffer.getvalue() + b"\x00" * 12


def test_bad_binary_requests_and_a_body_too_large():
    for body, query, field in ((_npy_header_only((10**12, 3)), {}, "body"),(b"\x93NUMPY garbage", {}, "body"), (_npy(np.zeros((1, 3))), {"stochastic": "maybe"}, "stochastic"),
                               (_npy(np.zeros((1, 3), complex)), {}, "observations")):
        with pytest.raises(BadRequest) as caught:
            _parse(body, NPY_CONTENT_TYPE, query)
        assert caught.value.field == field and 400 <= caught.value.status < 500
    with pytest.raises(BadRequest) as caught:
        _parse({"observations": [[0, 0, 0]] * 100}, max_body_bytes=1000)
    assert (caught.value.status, caught.value.field) == (413, "body")


@settings(max_examples=60, deadline=None)
@given(hnp.arrays(np.float32, st.tuples(st.integers(1, 20), st.just(3)),
                  elements=st.floats(-1, 1, width=32)))
def test_any_observation_the_env_can_produce_is_taken_as_it_is(obs):
    request = _parse({"observations": obs.tolist()})
    np.testing.assert_array_equal(request.observations, obs)


def test_a_wide_address_without_a_token_is_refused_before_ray_starts(tmp_path):
    result = run_cli("serve", tmp_path, "--host", "0.0.0.0", timeout=60, env={"RLPLATFORM_SERVE_TOKEN": ""})
    assert_user_error(result, "--host 0.0.0.0", "token")
    assert_user_error(run_cli("serve", tmp_path, "--replicas", "0", timeout=60), "--replicas")
    assert_user_error(run_cli("serve", tmp_path / "missing", timeout=60), "no such run directory")


# ---- a real application ----------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, target: Path, tmp: Path, *extra: str):
        self.port = _free_port()
        token_file = tmp / "token"
        token_file.write_text(TOKEN + "\n")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "rlplatform", "serve", str(target), "--port", str(self.port), "--token-file", str(token_file),
             *extra], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.output: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.output.append(line)

    def wait_ready(self, timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.process.poll() is None, "".join(self.output)
            if any(line.startswith("serving ") for line in self.output):
                return
            time.sleep(0.5)
        raise AssertionError("serve did not come up:\n" + "".join(self.output))

    def request(self, path: str, body=None, token=TOKEN, content_type="application/json") -> tuple[int, dict]:
        data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
        headers = {"Content-Type": content_type, **({"Authorization": f"Bearer {token}"} if token else {})}
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", data=data, headers=headers,
                                     method="POST" if data is not None else "GET")
        try:
            with urllib.request.urlopen(req, timeout=60) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as error:
            return error.code, json.loads(error.read())

    def stop(self) -> int:
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=120)


ONE_ITERATION = ("--set", "stop.iterations=1", "--set", "stop.return_mean=null", "--set", "stop.env_steps=null",
                 "--set", "scale.env_runners=0", "--set", "model.hidden=[32]", "--set", "checkpoint.every=1",
                 "--set", "training.train_batch_size_per_learner=256", "--set", "rllib.reporting.min_time_s_per_iteration=0")


def _train(runs: Path, *extra) -> Path:
    result = run_cli("train", "--runs-dir", runs, *ONE_ITERATION, *extra, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    return only_run_dir(runs, Path(str(extra[0])).stem.replace("_", "-") if extra and str(extra[0]).endswith(".yaml")
                        else "cartpole-ppo")


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    return _train(tmp_path_factory.mktemp("serve-runs"))


@pytest.fixture(scope="module")
def server(trained, tmp_path_factory):
    server = Server(trained, tmp_path_factory.mktemp("serve"))
    try:
        server.wait_ready()
        yield server
    finally:
        assert server.stop() == 0, "".join(server.output)


def _evaluate_actions(run_dir: Path, obs: np.ndarray) -> np.ndarray:
    """What `evaluate` does with the checkpoint: RLlib's module, greedy, as the env gets the action."""
    from rlplatform.adapter.policy import greedy_actions, load_inference_module
    from rlplatform.commands.evaluate import find_checkpoint

    module = load_inference_module(find_checkpoint(run_dir).path)
    actions, _ = greedy_actions(module, obs)
    return np.asarray(actions)


def _cartpole_observations(n: int) -> np.ndarray:
    space = gym.make("CartPole-v1").observation_space
    space.seed(0)
    return np.stack([space.sample() for _ in range(n)])


@pytest.mark.slow
def test_served_greedy_actions_are_evaluates_in_json_and_npy(server, trained):
    obs = _cartpole_observations(300)
    expected = _evaluate_actions(trained, obs)
    status, reply = server.request("/v1/act", {"observations": obs.tolist()})
    assert status == 200, reply
    np.testing.assert_array_equal(reply["actions"], expected)
    assert reply["policy"] == "default_policy" and reply["stochastic"] is False
    assert reply["version"]["iteration"] == 1 and Path(reply["version"]["checkpoint"]).name == "checkpoint_000001"
    status, reply = server.request("/v1/act", _npy(obs), content_type=NPY_CONTENT_TYPE)
    assert status == 200 and reply["actions"] == expected.tolist()


@pytest.mark.slow
def test_the_policy_is_described_and_stochastic_requests_sample_it(server):
    status, info = server.request("/v1/policy")
    assert status == 200
    policy = info["policies"]["default_policy"]
    assert policy["observation_space"]["shape"] == [4] and policy["action_space"] == {"type": "Discrete", "n": 2, "start": 0}
    assert policy["modes"] == ["greedy", "stochastic"] and info["version"]["env_steps"] > 0
    obs = np.zeros((400, 4), np.float32)  # one state, asked 400 times: an untrained policy picks both actions
    status, reply = server.request("/v1/act", {"observations": obs.tolist(), "stochastic": True})
    assert status == 200 and set(reply["actions"]) == {0, 1}


@pytest.mark.slow
def test_concurrent_requests_batched_together_each_get_their_own_actions(server, trained):
    obs = _cartpole_observations(64 * 5)
    expected = _evaluate_actions(trained, obs)
    batches = [(obs[i * 5:(i + 1) * 5 - (i % 3)], expected[i * 5:(i + 1) * 5 - (i % 3)]) for i in range(64)]
    with ThreadPoolExecutor(64) as pool:
        replies = list(pool.map(lambda b: server.request("/v1/act", {"observations": b[0].tolist()}), batches))
    for (_, want), (status, reply) in zip(batches, replies):
        assert status == 200 and reply["actions"] == want.tolist()


@pytest.mark.slow
def test_bad_requests_get_4xx_naming_the_field_and_the_replica_serves_on(server):
    cases = [({"observations": [[0, 0, 0]]}, 422, "observations"),
             (b'{"observations": [[0, NaN, 0, 0]]}', 422, "observations[0][1]"),
             ({"observations": [[5.0, 0, 0, 0]]}, 422, "observations[0][0]"),
             ({"observations": [["x", 0, 0, 0]]}, 422, "observations"),
             ({"observations": [[0, 0, 0, 0]], "policy": "other"}, 404, "policy"),
             (b"[1", 400, "body"),
             (b"\x00" * (17 * 1024 * 1024), 413, "body")]
    for body, status, field in cases:
        got, reply = server.request("/v1/act", body)
        assert (got, reply.get("field")) == (status, field), reply
        assert reply["error"]
    assert server.request("/v1/act", {"observations": [[0, 0, 0, 0]]}, token=None) == (
        401, {"error": "a bearer token is required (Authorization: Bearer TOKEN)", "field": "authorization"})
    assert server.request("/v1/act", {"observations": [[0, 0, 0, 0]]}, token="wrong")[0] == 401
    assert server.request("/v1/nothing")[0] == 404
    status, reply = server.request("/v1/act", {"observations": [[0, 0, 0, 0]]})
    assert status == 200 and len(reply["actions"]) == 1


class Load:
    """Clients sending greedy requests in a loop until stopped, every reply's status and version kept."""

    def __init__(self, server: Server, clients: int):
        self.server, self.replies, self._stop = server, [], threading.Event()
        self._threads = [threading.Thread(target=self._client, daemon=True) for _ in range(clients)]
        for thread in self._threads:
            thread.start()

    def _client(self) -> None:
        obs = {"observations": np.zeros((4, 4)).tolist()}
        while not self._stop.is_set():
            try:
                status, reply = self.server.request("/v1/act", obs)
            except (OSError, ValueError) as exc:  # a connection reset, or a reply that is not JSON
                status, reply = -1, {"error": repr(exc)}
            self.replies.append((status, reply.get("version", {}).get("iteration"), reply.get("error")))

    def stop(self) -> list:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=120)
        return self.replies


def _replica_pids(server: Server) -> list[int]:
    """This server's replica processes: descendants of its `serve` process (its private Ray instance's workers)."""
    import psutil

    found = []
    for child in psutil.Process(server.process.pid).children(recursive=True):
        try:
            if "ServeReplica:rlplatform:policy" in " ".join(child.cmdline()):
                found.append(child.pid)
        except psutil.Error:  # gone meanwhile
            continue
    return found


@pytest.mark.slow
def test_follow_switches_to_each_new_checkpoint_under_load_without_a_failed_request(tmp_path):
    run_dir = _train(tmp_path / "runs")
    server = Server(run_dir, tmp_path, "--follow", "--checkpoint", "latest", "--poll", "1")
    try:
        server.wait_ready()
        load = Load(server, clients=4)
        resumed = run_cli("train", "--resume", run_dir, "--set", "stop.iterations=3", timeout=300)
        assert resumed.returncode == 0, resumed.stdout + resumed.stderr
        deadline = time.monotonic() + 180
        while server.request("/v1/policy")[1]["version"]["iteration"] != 3:
            assert time.monotonic() < deadline, "".join(server.output)
            time.sleep(1)
        time.sleep(2)
        replies = load.stop()
    finally:
        assert server.stop() == 0, "".join(server.output)
    failed = [r for r in replies if r[0] != 200]
    assert not failed, failed[:5]
    iterations = [r[1] for r in replies]
    assert iterations[0] == 1 and iterations[-1] == 3 and len(replies) > 20
    assert any("now serving checkpoint checkpoint_000003" in line for line in server.output)


@pytest.mark.slow
def test_a_killed_replica_is_replaced_and_only_requests_in_flight_fail(trained, tmp_path):
    clients = 6
    server = Server(trained, tmp_path, "--replicas", "2")
    try:
        server.wait_ready()
        assert len(_replica_pids(server)) == 2
        load = Load(server, clients=clients)
        time.sleep(3)
        victim = _replica_pids(server)[0]
        subprocess.run(["kill", "-9", str(victim)], check=True)
        deadline = time.monotonic() + 120
        while not (len(pids := _replica_pids(server)) == 2 and victim not in pids):
            assert time.monotonic() < deadline, "the killed replica was not replaced"
            time.sleep(1)
        time.sleep(5)  # the new replica serves beside the survivor
        replies = load.stop()
        status, reply = server.request("/v1/act", {"observations": [[0, 0, 0, 0]]})
    finally:
        assert server.stop() == 0, "".join(server.output)
    failed = [r for r in replies if r[0] != 200]
    # at most one request per client was in flight on the killed replica when it died
    assert len(failed) <= clients, failed
    assert sum(r[0] == 200 for r in replies) > 50 and status == 200


@pytest.mark.slow
def test_a_multi_agent_run_serves_each_policy_by_id_and_an_export_directory_serves_as_exported(tmp_path):
    from rlplatform.adapter.policy import greedy_actions, load_inference_module
    from rlplatform.commands.evaluate import find_checkpoint

    run_dir = _train(tmp_path / "runs", ROOT / "experiments" / "pursuit_ppo.yaml", "--set", "model.hidden=[16]",
                     "--set", "multi_agent.policies.evader.model.hidden=[8]", "--set", "training.minibatch_size=64")
    checkpoint = find_checkpoint(run_dir).path
    exported = tmp_path / "export"
    result = run_cli("export", run_dir, "-o", exported, "--policy", "evader", timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    for target, policies in ((run_dir, {"evader", "pursuer"}), (exported, {"evader"})):
        server = Server(target, tmp_path)
        try:
            server.wait_ready()
            status, info = server.request("/v1/policy")
            assert status == 200 and set(info["policies"]) == policies
            for policy in policies:
                space = info["policies"][policy]["observation_space"]
                obs = np.random.default_rng(0).integers(0, 2, (50, *space["shape"])).astype(space["dtype"])
                expected, _ = greedy_actions(load_inference_module(checkpoint, policy), obs)
                status, reply = server.request("/v1/act", {"observations": obs.tolist(), "policy": policy})
                assert status == 200 and reply["policy"] == policy, reply
                np.testing.assert_array_equal(reply["actions"], np.asarray(expected))
            if target == exported:
                assert server.request("/v1/act", {"observations": obs.tolist(), "stochastic": True})[0] == 422
        finally:
            assert server.stop() == 0, "".join(server.output)


@pytest.mark.slow
def test_bench_serve_measures_every_way_at_every_concurrency(trained, tmp_path):
    result = run_cli("bench", "serve", trained, "--concurrency", "1", "3", "--seconds", "1", "-o", tmp_path, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    (path,) = tmp_path.glob("serve-*/serve.json")
    rows = json.loads(path.read_text())["results"]
    assert [(r["way"], r["concurrency"]) for r in rows] == [
        (way, c) for way in ("serve-batched", "serve-unbatched", "onnxruntime") for c in (1, 3)]
    for row in rows:
        assert row["requests"] > 0 and row["errors"] == 0 and row["requests_per_s"] > 0
        assert 0 < row["p50_ms"] <= row["p99_ms"]
    assert "bench serve: requests/s and latency" in result.stdout

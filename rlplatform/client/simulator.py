"""`ExternalClient`: what a simulator outside Ray embeds to train with a run that has `env: external`.

    client = ExternalClient("127.0.0.1", port, token=token)   # a port from the run's external.json
    obs = client.start_episode(env.reset()[0])
    while True:
        action = client.act(obs)
        obs, reward, terminated, truncated, _ = env.step(action)
        client.step(obs, reward, terminated, truncated)         # sends a batch now and then, takes new weights
        if terminated or truncated:
            obs = client.start_episode(env.reset()[0])

The client acts with a numpy copy of the run's policy (RLlib's default MLP, as the torch-free env runner
does), records what the learner needs (observations, actions, rewards, the actions' log-probabilities
and distribution inputs) and, every `fragment` steps, sends the episodes' chunks and takes the newest
weights. Only numpy and msgpack are imported. The messages are in docs/external.md.
"""

from __future__ import annotations

import socket
import time
import uuid
from typing import Any, Optional

import numpy as np

from rlplatform.client import protocol
from rlplatform.client.numpy_policy import ACTION_DIST_INPUTS, ACTION_LOGP, ACTIONS, NumpyPolicy


class ExternalClient:
    def __init__(self, host: str, port: int, *, token: Optional[str] = None, connect_timeout: float = 60.0,
                 seed: Optional[int] = None):
        self._sock = _connect(host, port, connect_timeout)
        try:
            self._request({"type": protocol.PING, "protocol": protocol.PROTOCOL, "token": token}, protocol.PONG)
            self.config = self._request({"type": protocol.GET_CONFIG}, protocol.SET_CONFIG)
            policy = self.config["policy"]
            self.policy = NumpyPolicy(action_kind=policy["action_kind"], action_dim=int(policy["action_dim"]),
                                      activation=policy["activation"], head_activation=policy["head_activation"], seed=seed)
            self._take_state(self._request({"type": protocol.GET_STATE}, protocol.SET_STATE))
        except BaseException:
            self._sock.close()
            raise
        self.fragment = int(self.config["fragment"])
        self._discrete = policy["action_kind"] == "categorical"
        self._chunks: list[dict[str, Any]] = []  # finished chunks of this batch
        self._episode: Optional[dict[str, Any]] = None
        self._pending: Optional[dict[str, np.ndarray]] = None
        self._batch_steps = 0
        self.weights_seq_no: int = self._seq_no

    # ---- the simulator's side -----------------------------------------------------------------------

    def start_episode(self, observation: Any) -> Any:
        """A new episode from its first observation (an unfinished one before it is dropped); the observation back."""
        self._episode = {"id": uuid.uuid4().hex, "t_started": 0, "observations": [np.asarray(observation)],
                         "actions": [], "rewards": [], ACTION_LOGP: [], ACTION_DIST_INPUTS: []}
        self._pending = None
        return observation

    def act(self, observation: Any) -> Any:
        """An action sampled from the current policy (an int for a Discrete space, an array for a Box)."""
        if self._episode is None:
            raise RuntimeError("call start_episode(first_observation) first")
        out = self.policy.compute_actions(np.asarray(observation, np.float32)[None], explore=True)
        self._pending = {key: value[0] for key, value in out.items()}
        action = self._pending[ACTIONS]
        return int(action) if self._discrete else action

    def step(self, observation: Any, reward: float, terminated: bool, truncated: bool) -> None:
        """The env's answer to the last action; every `fragment` steps the batch goes to the run."""
        if self._episode is None or self._pending is None:
            raise RuntimeError("call act(observation) before step(...)")
        episode, pending = self._episode, self._pending
        episode["observations"].append(np.asarray(observation))
        episode["actions"].append(pending[ACTIONS])
        episode["rewards"].append(float(reward))
        episode[ACTION_LOGP].append(pending[ACTION_LOGP])
        episode[ACTION_DIST_INPUTS].append(pending[ACTION_DIST_INPUTS])
        self._pending = None
        self._batch_steps += 1
        if terminated or truncated:
            self._chunks.append(_chunk(episode, bool(terminated), bool(truncated)))
            self._episode = None
        if self._batch_steps >= self.fragment:
            self._send_batch()

    def close(self) -> None:
        self._sock.close()

    def __enter__(self) -> "ExternalClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---- the wire -----------------------------------------------------------------------------------

    def _send_batch(self) -> None:
        chunks = self._chunks
        if self._episode is not None and self._episode["actions"]:  # the ongoing episode's chunk; it goes on after
            chunks = [*chunks, _chunk(self._episode, False, False)]
            last = self._episode
            self._episode = {"id": last["id"], "t_started": last["t_started"] + len(last["actions"]),
                             "observations": [last["observations"][-1]], "actions": [], "rewards": [],
                             ACTION_LOGP: [], ACTION_DIST_INPUTS: []}
        kind = protocol.EPISODES_AND_GET_STATE
        self._take_state(self._request({"type": kind, "episodes": chunks}, protocol.SET_STATE))
        self._chunks, self._batch_steps = [], 0

    def _take_state(self, body: dict[str, Any]) -> None:
        self.policy.set_state(body["weights"])
        self._seq_no = int(body.get("weights_seq_no", 0))
        self.weights_seq_no = self._seq_no

    def _request(self, message: dict[str, Any], answer: str) -> dict[str, Any]:
        protocol.send(self._sock, message)
        kind, body = protocol.receive(self._sock)
        if kind != answer:
            raise protocol.ProtocolError(f"expected {answer}, the run sent {kind}")
        return body


def _chunk(episode: dict[str, Any], terminated: bool, truncated: bool) -> dict[str, Any]:
    return {"id": episode["id"], "t_started": episode["t_started"], "terminated": terminated, "truncated": truncated,
            "observations": np.stack(episode["observations"]), "actions": np.stack(episode["actions"]),
            "rewards": np.asarray(episode["rewards"], np.float32),
            ACTION_LOGP: np.asarray(episode[ACTION_LOGP], np.float32),
            ACTION_DIST_INPUTS: np.stack(episode[ACTION_DIST_INPUTS]).astype(np.float32)}


def _connect(host: str, port: int, timeout: float) -> socket.socket:
    """Connect, retrying while the run is starting (connection refused) until `timeout` seconds have passed."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            sock = socket.create_connection((host, port), timeout=10)
            sock.settimeout(None)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return sock
        except (ConnectionRefusedError, socket.timeout):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)

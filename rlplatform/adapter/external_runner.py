"""`ExternalEnvRunner`: an env runner whose env is a simulator outside Ray, connected over RLlink (docs/external.md).

Each remote runner listens on one TCP port for one simulator at a time (`scale.env_runners` simulators
at once). The simulator (`rlplatform.client.ExternalClient`, or any client of the protocol) acts with a
numpy copy of the policy and sends its episodes' chunks; `sample()` hands them to RLlib as
`SingleAgentEpisode`s. On-policy algorithms (PPO) answer a batch with the next weights only once the
learner has produced them; APPO and IMPALA answer at once with the newest weights.

What a connection may not do, and what happens: a wrong protocol version, a wrong or missing token,
a message that is malformed, over the size limit, or whose arrays disagree with the spaces: an ERROR
message saying why, then the connection is closed; the runner goes on listening. A client that
disappears loses the steps it had not sent. The runner never raises for anything a client sends.
"""

from __future__ import annotations

import hmac
import logging
import socket
import threading
from collections import defaultdict
from typing import Any, Optional

import gymnasium as gym
import numpy as np
import ray
from ray.rllib.core import COMPONENT_RL_MODULE, DEFAULT_AGENT_ID, DEFAULT_MODULE_ID
from ray.rllib.core.columns import Columns
from ray.rllib.env import INPUT_ENV_SPACES
from ray.rllib.env.env_runner import EnvRunner
from ray.rllib.env.single_agent_episode import SingleAgentEpisode
from ray.rllib.utils.checkpoints import Checkpointable
from ray.rllib.utils.metrics import (
    EPISODE_LEN_MEAN,
    EPISODE_RETURN_MEAN,
    NUM_AGENT_STEPS_SAMPLED,
    NUM_AGENT_STEPS_SAMPLED_LIFETIME,
    NUM_ENV_STEPS_SAMPLED,
    NUM_ENV_STEPS_SAMPLED_LIFETIME,
    NUM_EPISODES,
    NUM_EPISODES_LIFETIME,
    NUM_MODULE_STEPS_SAMPLED,
    NUM_MODULE_STEPS_SAMPLED_LIFETIME,
    WEIGHTS_SEQ_NO,
)
from ray.rllib.utils.metrics.metrics_logger import MetricsLogger

from rlplatform.adapter.algorithm_config import EPISODE_LENGTHS, EPISODE_RETURNS
from rlplatform.client import protocol

logger = logging.getLogger("rlplatform.external")
SETTINGS_KEY = "rlplatform_external"
STOP = "STOP"  # from the run's own driver only (the run's stop key), never from a simulator
HANDSHAKE_TIMEOUT_S = 10.0  # a connection must send PING within this
MAX_OPEN_EPISODES = 10_000  # unfinished episodes whose earlier chunks' returns are kept  # env_config key of the runner's settings (ports, host, token file, ...)


class ExternalEnvRunner(EnvRunner, Checkpointable):
    def __init__(self, *, config: Any, **kwargs: Any):
        super().__init__(config=config, **kwargs)
        self.worker_index: int = kwargs.get("worker_index", 0)
        settings = dict(config.env_config.get(SETTINGS_KEY) or {})
        self.observation_space, self.action_space = config.observation_space, config.action_space
        self.on_policy: bool = bool(settings.get("on_policy", True))
        self.max_message_bytes = int(settings.get("max_message_bytes", protocol.MAX_MESSAGE_BYTES))
        self._client_config = dict(settings.get("client_config") or {})
        self._token = _read_token(settings.get("token_file"))
        self._stop_key: Optional[str] = settings.get("stop_key")
        self.metrics = MetricsLogger(stats_cls_lookup=config.stats_cls_lookup, root=False)
        self._changed = threading.Condition()
        self._module_state: Optional[dict[str, Any]] = None
        self._weights_seq_no = 0
        self._received: list[SingleAgentEpisode] = []
        self._chunks_before: dict[str, list[tuple[float, int]]] = defaultdict(list)  # episode id -> (return, length) sent
        self._active: Optional[socket.socket] = None  # the connected simulator's socket
        self._waiting_after: Optional[int] = None  # the connected client waits for weights newer than this
        self._release_waiting = False  # let the waiting client go on with the weights it has
        self._stopping = False
        self.max_queued_steps = int(settings.get("max_queued_steps", 100_000))
        self._server: Optional[socket.socket] = None
        self.port: Optional[int] = None
        if self.worker_index > 0:  # the local runner (the algorithm's process) only holds the weights
            ports = settings.get("ports") or []
            port = int(ports[self.worker_index - 1]) if len(ports) >= self.worker_index else 0
            self._server = socket.create_server((settings.get("host", "127.0.0.1"), port), reuse_port=False, backlog=8)
            self.port = self._server.getsockname()[1]
            threading.Thread(target=self._accept_loop, daemon=True, name="external-accept").start()

    # ---- RLlib's EnvRunner ----------------------------------------------------------------------------

    def assert_healthy(self) -> None:
        assert self.worker_index == 0 or self._server is not None, "not listening"

    def get_spaces(self) -> dict[str, Any]:
        return {INPUT_ENV_SPACES: (self.observation_space, self.action_space),
                DEFAULT_MODULE_ID: (self.observation_space, self.action_space)}

    def sample(self, **kwargs: Any) -> list[SingleAgentEpisode]:
        """The chunks the simulator has sent since the last call, waiting for them up to a bound.

        On-policy (PPO): a simulator that waits for newer weights is let go on the ones it has (no update came
        between, so what it samples next is still on-policy), and the wait ends before the driver's own
        `sample_timeout_s`, so that a batch is not taken by a call whose answer the driver no longer reads.
        Asynchronous algorithms: waits until a batch comes (IMPALA counts every reply as a fragment, so an empty
        one would be trained as one), or the run's driver says the run ends (`release_waiting_runners`)."""
        with self._changed:
            if self.on_policy:
                if not self._received and self._client_waits_for_weights():
                    self._release_waiting = True
                    self._changed.notify_all()
                self._changed.wait_for(lambda: bool(self._received) or self._stopping,
                                       timeout=0.8 * float(self.config.sample_timeout_s))
            else:
                self._changed.wait_for(lambda: bool(self._received) or self._stopping)
            episodes, self._received = self._received, []
        self._count(episodes)
        return episodes

    def get_metrics(self) -> dict[str, Any]:
        return self.metrics.reduce()

    def get_state(self, components: Any = None, *, not_components: Any = None, **kwargs: Any) -> dict[str, Any]:
        """The weights last set (no connectors: the simulator's side has none of RLlib's)."""
        wanted = components is None or COMPONENT_RL_MODULE in ([components] if isinstance(components, str) else components)
        if not wanted or COMPONENT_RL_MODULE in ([not_components] if isinstance(not_components, str) else not_components or ()):
            return {}
        return {COMPONENT_RL_MODULE: self._module_state or {}, WEIGHTS_SEQ_NO: self._weights_seq_no}

    def set_state(self, state: dict[str, Any]) -> None:
        if NUM_ENV_STEPS_SAMPLED_LIFETIME in state:
            self.num_env_steps_sampled_lifetime = state[NUM_ENV_STEPS_SAMPLED_LIFETIME]
        if COMPONENT_RL_MODULE not in state:
            return
        module_state = state[COMPONENT_RL_MODULE]
        if isinstance(module_state, ray.ObjectRef):
            module_state = ray.get(module_state)
        if isinstance(module_state, dict) and DEFAULT_MODULE_ID in module_state:
            module_state = module_state[DEFAULT_MODULE_ID]
        with self._changed:
            self._module_state = module_state
            self._weights_seq_no = max(self._weights_seq_no + 1, int(state.get(WEIGHTS_SEQ_NO) or 0))
            self._changed.notify_all()

    def _stop_waiting(self) -> None:
        with self._changed:
            self._stopping = True
            self._changed.notify_all()

    def stop(self) -> None:
        self._stop_waiting()
        with self._changed:
            active = self._active
        for sock in (self._server, active):
            if sock is not None:
                try:
                    sock.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked in accept() or recv()
                except OSError:
                    pass
                sock.close()

    def get_ctor_args_and_kwargs(self) -> tuple[tuple, dict[str, Any]]:
        return (), {"config": self.config}

    def get_checkpointable_components(self) -> list:
        return []  # the weights are in get_state; there is no module here

    def listening_port(self) -> Optional[int]:
        return self.port

    # ---- connections ------------------------------------------------------------------------------------

    def _accept_loop(self) -> None:
        assert self._server is not None
        while not self._stopping:
            try:
                conn, address = self._server.accept()
            except OSError:  # closed by stop()
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._serve, args=(conn, address), daemon=True, name="external-client").start()

    def _serve(self, conn: socket.socket, address: Any) -> None:
        """One connection: the handshake (a connection that sends nothing holds no port), then its messages."""
        try:
            conn.settimeout(HANDSHAKE_TIMEOUT_S)
            self._handshake(conn)
            conn.settimeout(None)
            _keepalive(conn)  # a simulator whose network went away silently frees the port within about a minute
            with self._changed:
                if self._active is not None:
                    raise protocol.ProtocolError(f"busy: another simulator is connected to port {self.port}; each port takes one")
                self._active = conn
            protocol.send(conn, {"type": protocol.PONG, "protocol": protocol.PROTOCOL})
            while True:
                kind, body = protocol.receive(conn, self.max_message_bytes)
                self._answer(conn, kind, body)
        except protocol.PeerError:
            pass  # the client closed: its unsent steps are lost, the run goes on
        except (protocol.ProtocolError, ValueError, KeyError, TypeError, socket.timeout) as exc:
            self._release(conn)  # the next simulator may come while this one is told why
            _refuse(conn, str(exc) or type(exc).__name__)
        except Exception as exc:  # never let a client take the runner down
            logger.warning("external client %s: %s: %s", address, type(exc).__name__, exc)
            self._release(conn)
            _refuse(conn, f"the runner could not handle the message: {type(exc).__name__}")
        finally:
            conn.close()
            self._release(conn)

    def _release(self, conn: socket.socket) -> None:
        with self._changed:
            if self._active is conn:
                self._active = None
                self._changed.notify_all()

    def _handshake(self, conn: socket.socket) -> None:
        kind, body = protocol.receive(conn, 64 * 1024)
        if kind == STOP and self._stop_key and hmac.compare_digest(str(body.get("key") or "").encode(), self._stop_key.encode()):
            self._stop_waiting()  # the run is ending: a sample() waiting for a simulator returns
            raise protocol.PeerError("stopped")
        if kind != protocol.PING:
            raise protocol.ProtocolError(f"the first message must be PING, not {kind}")
        if body.get("protocol") != protocol.PROTOCOL:
            raise protocol.ProtocolError(f"protocol {body.get('protocol')!r} is not this run's {protocol.PROTOCOL!r}")
        if self._token is not None and not hmac.compare_digest(str(body.get("token") or "").encode(), self._token.encode()):
            raise protocol.ProtocolError("refused: this run needs its token (PING's `token`)")

    def _answer(self, conn: socket.socket, kind: str, body: dict[str, Any]) -> None:
        if kind == protocol.GET_CONFIG:
            protocol.send(conn, {"type": protocol.SET_CONFIG, **self._client_config})
        elif kind == protocol.GET_STATE:
            self._send_state(conn, after=-1)
        elif kind in (protocol.EPISODES, protocol.EPISODES_AND_GET_STATE):
            episodes = [self._episode(chunk) for chunk in _list(body.get("episodes"), "episodes")]
            with self._changed:
                if sum(len(e) for e in self._received) + sum(len(e) for e in episodes) > self.max_queued_steps:
                    raise ValueError(f"over {self.max_queued_steps:,} steps wait for the learner: send EPISODES_AND_GET_STATE "
                                     "and wait for its answer")
                seq_no = self._weights_seq_no
                self._received.extend(episodes)
                self._changed.notify_all()
            if kind == protocol.EPISODES_AND_GET_STATE:
                self._send_state(conn, after=seq_no if self.on_policy else -1)
        else:
            raise protocol.ProtocolError(f"unknown message type {kind!r}; a client sends {', '.join(protocol.CLIENT_TYPES)}")

    def _client_waits_for_weights(self) -> bool:
        return self._waiting_after is not None and self._weights_seq_no <= self._waiting_after

    def _send_state(self, conn: socket.socket, after: int) -> None:
        """The module's weights, once there are weights newer than `after` (on-policy: the next update's)."""
        with self._changed:
            self._waiting_after, self._release_waiting = after, False
            self._changed.notify_all()
            try:
                self._changed.wait_for(lambda: self._module_state is not None and (
                    self._weights_seq_no > after or self._release_waiting or self._stopping))
            finally:
                self._waiting_after, self._release_waiting = None, False
            state, seq_no = self._module_state, self._weights_seq_no
        protocol.send(conn, {"type": protocol.SET_STATE, "weights": state, "weights_seq_no": seq_no})

    # ---- episodes ----------------------------------------------------------------------------------------

    def _episode(self, chunk: Any) -> SingleAgentEpisode:
        """A chunk as RLlib's episode, after checking it against the spaces (ValueError naming what is wrong)."""
        if not isinstance(chunk, dict):
            raise ValueError("an episode chunk must be a map")
        obs = _array(chunk, "observations")
        actions = _array(chunk, "actions")
        rewards = _array(chunk, "rewards").astype(np.float32)
        logp = _array(chunk, Columns.ACTION_LOGP).astype(np.float32)
        dist_inputs = _array(chunk, Columns.ACTION_DIST_INPUTS).astype(np.float32)
        steps = len(actions)
        if steps < 1 or len(obs) != steps + 1 or len(rewards) != steps or len(logp) != steps or len(dist_inputs) != steps:
            raise ValueError(f"episode chunk lengths disagree: {len(obs)} observations (steps + 1), {steps} actions, "
                             f"{len(rewards)} rewards, {len(logp)} log-probs, {len(dist_inputs)} distribution inputs")
        obs = obs.astype(self.observation_space.dtype, copy=False)
        if tuple(obs.shape[1:]) != self.observation_space.shape or not np.all(np.isfinite(obs)):
            raise ValueError(f"observations of shape {list(obs.shape[1:])} (or not finite); the space is {self.observation_space}")
        if isinstance(self.action_space, gym.spaces.Discrete):
            if actions.dtype.kind not in "iu" or actions.ndim != 1 or actions.min() < 0 or actions.max() >= self.action_space.n:
                raise ValueError(f"actions must be integers in [0, {self.action_space.n})")
        elif tuple(actions.shape[1:]) != self.action_space.shape or not np.all(np.isfinite(actions)):
            raise ValueError(f"actions of shape {list(actions.shape[1:])} (or not finite); the space is {self.action_space}")
        width = self.action_space.n if isinstance(self.action_space, gym.spaces.Discrete) else 2 * self.action_space.shape[0]
        if dist_inputs.shape != (steps, width):
            raise ValueError(f"action_dist_inputs of shape {list(dist_inputs.shape)}: expected [{steps}, {width}]")
        if not (np.all(np.isfinite(rewards)) and np.all(np.isfinite(logp)) and np.all(np.isfinite(dist_inputs))):
            raise ValueError("rewards, log-probabilities and distribution inputs must be finite")
        terminated, truncated = bool(chunk.get("terminated")), bool(chunk.get("truncated"))
        episode = SingleAgentEpisode(
            id_=str(chunk.get("id") or ""), observations=list(obs), actions=list(actions), rewards=list(rewards),
            extra_model_outputs={Columns.ACTION_LOGP: list(logp), Columns.ACTION_DIST_INPUTS: list(dist_inputs)},
            terminated=terminated, truncated=truncated, observation_space=self.observation_space,
            action_space=self.action_space, t_started=int(chunk.get("t_started") or 0), len_lookback_buffer=0)
        return episode.to_numpy()

    def _count(self, episodes: list[SingleAgentEpisode]) -> None:
        steps = sum(len(e) for e in episodes)
        finished = [e for e in episodes if e.is_done]
        log = self.metrics.log_value
        for key, reduce in ((NUM_ENV_STEPS_SAMPLED, "sum"), (NUM_ENV_STEPS_SAMPLED_LIFETIME, "lifetime_sum")):
            log(key, steps, reduce=reduce)
        log((NUM_AGENT_STEPS_SAMPLED, DEFAULT_AGENT_ID), steps, reduce="sum")
        log((NUM_MODULE_STEPS_SAMPLED, DEFAULT_MODULE_ID), steps, reduce="sum")
        log((NUM_AGENT_STEPS_SAMPLED_LIFETIME, DEFAULT_AGENT_ID), steps, reduce="lifetime_sum")
        log((NUM_MODULE_STEPS_SAMPLED_LIFETIME, DEFAULT_MODULE_ID), steps, reduce="lifetime_sum")
        log(NUM_EPISODES, len(finished), reduce="sum")
        log(NUM_EPISODES_LIFETIME, len(finished), reduce="lifetime_sum")
        window = self.config.metrics_num_episodes_for_smoothing
        for episode in episodes:
            ret, length = float(episode.get_return()), len(episode)
            if not episode.is_done:
                self._chunks_before[episode.id_].append((ret, length))
                while len(self._chunks_before) > MAX_OPEN_EPISODES:  # episodes whose simulator went away
                    self._chunks_before.pop(next(iter(self._chunks_before)))
                continue
            for before_ret, before_len in self._chunks_before.pop(episode.id_, []):
                ret, length = ret + before_ret, length + before_len
            log(EPISODE_RETURNS, ret, reduce="item_series")
            log(EPISODE_LENGTHS, length, reduce="item_series")
            log(EPISODE_RETURN_MEAN, ret, window=window)
            log(EPISODE_LEN_MEAN, length, window=window)


def release_waiting_runners(algo_config: Any) -> None:
    """Before an external run's algorithm stops: tell each runner over its own port that the run ends, so that a
    `sample()` waiting for a simulator returns and the runner takes RLlib's `stop()` (queued behind it otherwise)."""
    settings = (algo_config.env_config or {}).get(SETTINGS_KEY)
    if not settings or not settings.get("stop_key"):
        return
    for port in settings.get("ports") or []:
        try:
            with socket.create_connection((settings.get("host", "127.0.0.1"), int(port)), timeout=2) as sock:
                protocol.send(sock, {"type": STOP, "key": settings["stop_key"]})
        except OSError:  # a runner already gone
            continue


def space_from_spec(spec: dict[str, Any]) -> gym.Space:
    """The experiment's `external.*_space` (export.json's form) as a gymnasium space."""
    if spec["type"] == "Discrete":
        return gym.spaces.Discrete(int(spec["n"]))
    dtype = np.dtype(spec.get("dtype") or "float32")
    shape = tuple(int(d) for d in spec["shape"])
    low, high = (np.broadcast_to(np.asarray(spec[k], dtype=np.float64), shape).astype(dtype) for k in ("low", "high"))
    return gym.spaces.Box(low=low, high=high, shape=shape, dtype=dtype)


def _array(chunk: dict[str, Any], key: str) -> np.ndarray:
    value = chunk.get(key)
    if not isinstance(value, np.ndarray):
        raise ValueError(f"episode chunk field {key!r} must be an array")
    return value


def _list(value: Any, name: str) -> list:
    if not isinstance(value, list):
        raise ValueError(f"{name!r} must be a list")
    return value


def _read_token(path: Any) -> Optional[str]:
    if not path:
        return None
    with open(path) as f:
        return f.read().strip() or None


def _keepalive(conn: socket.socket) -> None:
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in (("TCP_KEEPIDLE", 30), ("TCP_KEEPINTVL", 10), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, option):  # Linux; other systems keep their defaults
            conn.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)


def _refuse(conn: socket.socket, why: str) -> None:
    """ERROR, then close; what the client sent meanwhile is read away first (up to a second), so that the close is a
    FIN after the message and not a reset that could overtake it."""
    try:
        protocol.send(conn, {"type": protocol.ERROR, "error": why})
        conn.shutdown(socket.SHUT_WR)
        conn.settimeout(1.0)
        for _ in range(64):
            if not conn.recv(1 << 16):
                break
    except OSError:
        pass
    finally:
        conn.close()

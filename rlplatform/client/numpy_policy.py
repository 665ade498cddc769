"""RLlib's default PPO/APPO/IMPALA policy network, for inference, in numpy: an env runner without torch.

A remote env runner only runs its module's inference forward pass: an MLP encoder, the pi head,
and a sample from the action distribution. Importing torch for that costs a runner process about
126 MB of private memory and seconds of start-up (docs/performance.md). This class computes, from
the same inference-only weights that RLlib sends (`TorchRLModule.get_state` returns numpy arrays;
they are used as they arrive, read-only and uncopied), what the lean env runner's torch path
computes: ACTION_DIST_INPUTS, ACTIONS and ACTION_LOGP with the same shapes and dtypes.

Covered (`internals.numpy_policy_applies` decides on the driver, before a runner starts):
DefaultPPOTorchRLModule and its APPO/IMPALA kin with an MLP encoder (shared or separate actor
encoder) on a 1-D Box observation, `fcnet_activation` on every encoder layer, the pi head's hidden
layers with `head_fcnet_activation` and a linear output; Categorical (Discrete) actions, and
diagonal Gaussian (Box) actions with RLlib's [mean, log_std] layout, log-std clipped to
+-`log_std_clip_param` as TorchMLPHead does, from the head or a free log-std parameter.
Greedy (explore=False): the argmax with a log-prob of zeros in the actions' dtype (TorchDeterministic
of the Categorical), or the mean with a log-prob of zeros per action dimension (of the Gaussian).

No torch and no RLlib is imported here.
"""

from __future__ import annotations

import math
import re
from typing import Any, Callable, Optional

import numpy as np

ACTIVATIONS: dict[Optional[str], Callable[[np.ndarray], np.ndarray]] = {
    "tanh": np.tanh,
    "relu": lambda x: np.maximum(x, np.float32(0)),
    "elu": lambda x: np.where(x > 0, x, np.expm1(np.minimum(x, np.float32(0)))),
    "swish": lambda x: x / (np.float32(1) + np.exp(-x)),
    "silu": lambda x: x / (np.float32(1) + np.exp(-x)),
    "linear": lambda x: x,
    None: lambda x: x,
}
ENCODER_PREFIXES = ("encoder.encoder.net.mlp.", "encoder.actor_encoder.net.mlp.")
HEAD_PREFIX = "pi.net.mlp."
# Columns' values (ray.rllib.core.columns), spelled out so that this module imports no RLlib.
ACTIONS, ACTION_LOGP, ACTION_DIST_INPUTS = "actions", "action_logp", "action_dist_inputs"
_HALF_LOG_2PI = math.log(math.sqrt(2 * math.pi))


def _layers(state: dict[str, Any], prefix: str) -> list[tuple[np.ndarray, np.ndarray]]:
    """The Linear layers under `prefix`, in order: (weight [out, in], bias [out]) as they arrived."""
    indices = sorted({int(m.group(1)) for k in state if (m := re.fullmatch(re.escape(prefix) + r"(\d+)\.weight", k))})
    return [(np.asarray(state[f"{prefix}{i}.weight"]), np.asarray(state[f"{prefix}{i}.bias"])) for i in indices]


class NumpyPolicy:
    """The inference forward pass and action sampling of a default PPO-family module, in numpy."""

    def __init__(self, *, action_kind: str, action_dim: int, activation: Optional[str], head_activation: Optional[str],
                 seed: Optional[int] = None):
        if action_kind not in ("categorical", "gaussian"):
            raise ValueError(f"action_kind {action_kind!r}: categorical or gaussian")
        self.action_kind, self.action_dim = action_kind, action_dim
        self.activation, self.head_activation = ACTIVATIONS[activation], ACTIVATIONS[head_activation]
        self.rng = np.random.default_rng(seed)
        self.encoder: list[tuple[np.ndarray, np.ndarray]] = []
        self.head: list[tuple[np.ndarray, np.ndarray]] = []
        self.free_log_std: Optional[np.ndarray] = None
        self.log_std_clip: Optional[np.float32] = None
        self._state: dict[str, Any] = {}

    # What RLlib's env runner asks of its module (SingleAgentEnvRunner, lean_path_applies).
    def is_stateful(self) -> bool:
        return False

    def eval(self) -> "NumpyPolicy":
        return self

    def get_state(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return dict(self._state)

    def set_state(self, state: dict[str, Any]) -> None:
        """Take RLlib's inference-only state dict of numpy arrays, without copying them."""
        encoder = next((layers for p in ENCODER_PREFIXES if (layers := _layers(state, p))), None)
        head = _layers(state, HEAD_PREFIX)
        if not encoder or not head:
            raise ValueError(f"not a default MLP policy's state: {sorted(state)[:8]}")
        self.encoder, self.head, self._state = encoder, head, dict(state)
        self.free_log_std = np.asarray(state["pi.log_std"]) if "pi.log_std" in state else None
        clip = state.get("pi.log_std_clip_param_const")
        # TorchMLPHead clips the log-std only for a diagonal Gaussian (PPOCatalog: clip_log_std=is_diag_gaussian).
        self.log_std_clip = np.float32(np.asarray(clip).reshape(-1)[0]) if clip is not None and self.action_kind == "gaussian" else None

    def initial_state(self, *, obs_dim: int, hidden: list[int], head_hidden: list[int], shared: bool = True,
                      free_log_std: bool = False, log_std_clip: float = 20.0) -> dict[str, np.ndarray]:
        """Fresh weights in RLlib's layout (torch.nn.Linear's default uniform init), until the first sync."""
        def linear(prefix: str, index: int, fan_in: int, fan_out: int) -> dict[str, np.ndarray]:
            bound = 1.0 / math.sqrt(fan_in)
            return {f"{prefix}{index}.weight": self.rng.uniform(-bound, bound, (fan_out, fan_in)).astype(np.float32),
                    f"{prefix}{index}.bias": self.rng.uniform(-bound, bound, fan_out).astype(np.float32)}

        state: dict[str, np.ndarray] = {}
        encoder = ENCODER_PREFIXES[0 if shared else 1]
        sizes = [obs_dim, *hidden]
        for i in range(len(hidden)):
            state.update(linear(encoder, 2 * i, sizes[i], sizes[i + 1]))
        gaussian = self.action_kind == "gaussian"
        out_dim = self.action_dim * (2 if gaussian and not free_log_std else 1)
        sizes = [sizes[-1], *head_hidden, out_dim]
        for i in range(len(sizes) - 1):
            state.update(linear(HEAD_PREFIX, 2 * i, sizes[i], sizes[i + 1]))
        if gaussian and free_log_std:
            state["pi.log_std"] = np.zeros(self.action_dim, np.float32)
        state["pi.log_std_clip_param_const"] = np.array([log_std_clip], np.float32)
        return state

    def dist_inputs(self, observations: np.ndarray) -> np.ndarray:
        x = np.asarray(observations, dtype=np.float32)  # NumpyToTensor + .float()
        for weight, bias in self.encoder:
            x = self.activation(x @ weight.T + bias)
        for i, (weight, bias) in enumerate(self.head):
            x = x @ weight.T + bias
            if i < len(self.head) - 1:
                x = self.head_activation(x)
        x = x.astype(np.float32, copy=False)
        if self.action_kind == "categorical":
            return x
        if self.free_log_std is not None:
            log_std = np.broadcast_to(self.free_log_std, x.shape).astype(np.float32)
            if self.log_std_clip is not None:
                log_std = np.clip(log_std, -self.log_std_clip, self.log_std_clip)
            return np.concatenate([x, log_std], axis=-1)
        if self.log_std_clip is not None:
            mean, log_std = np.split(x, 2, axis=-1)
            return np.concatenate([mean, np.clip(log_std, -self.log_std_clip, self.log_std_clip)], axis=-1)
        return x

    def compute_actions(self, observations: np.ndarray, explore: bool) -> dict[str, np.ndarray]:
        logits = self.dist_inputs(observations)
        out = {ACTION_DIST_INPUTS: logits}
        if self.action_kind == "categorical":
            if not explore:
                actions = logits.argmax(axis=-1).astype(np.int64)
                out.update({ACTIONS: actions, ACTION_LOGP: np.zeros_like(actions)})
                return out
            actions, logp = sample_categorical_with_logp(logits, self.rng)
            out.update({ACTIONS: actions, ACTION_LOGP: logp})
            return out
        mean, log_std = np.split(logits, 2, axis=-1)
        if not explore:
            out.update({ACTIONS: mean.copy(), ACTION_LOGP: np.zeros_like(mean)})
            return out
        scale = np.exp(log_std)
        actions = (mean + scale * self.rng.standard_normal(mean.shape, dtype=np.float32)).astype(np.float32)
        out.update({ACTIONS: actions, ACTION_LOGP: gaussian_logp(actions, mean, log_std)})
        return out


def log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return (shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))).astype(np.float32)


def sample_categorical_with_logp(logits: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """One draw per row from softmax(logits), by the Gumbel-max trick (argmax of logits + Gumbel noise, the noise
    as -log of a standard exponential), and the draws' log-probabilities. This runs once per vector step: on a
    32-env batch it takes 15-16 us where the inverse of the cumulative sum took 30-33 us (a few numpy calls fewer).
    An exponential draw of exactly 0 (about once in 2**53; float64 keeps it that rare) gives an infinite noise,
    which wins the argmax: a valid draw of the race."""
    noise = -np.log(rng.standard_exponential(logits.shape))
    actions = (logits + noise).argmax(axis=-1)
    shifted = logits - logits.max(axis=-1, keepdims=True)
    log_total = np.log(np.exp(shifted).sum(axis=-1))
    logp = shifted[np.arange(len(actions)), actions] - log_total
    return actions, logp.astype(np.float32, copy=False)


def gaussian_logp(actions: np.ndarray, mean: np.ndarray, log_std: np.ndarray) -> np.ndarray:
    """torch.distributions.Normal.log_prob, summed over the action dimensions (TorchDiagGaussian.logp)."""
    var = np.exp(log_std) ** 2
    return (-((actions - mean) ** 2) / (2 * var) - log_std - np.float32(_HALF_LOG_2PI)).sum(-1).astype(np.float32)

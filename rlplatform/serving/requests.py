"""`POST /v1/act` bodies read and checked against the policy's spaces: a 4xx naming the field, never a 500.

Two forms of the same request:
- JSON: `{"observations": [[...], ...], "policy": "id", "stochastic": false}`;
- binary, for large observations such as images: the body a `.npy` array (`Content-Type:
  application/x-npy`), `policy` and `stochastic` as query parameters.

An observation must be one the env can produce: the space's shape, a number type that converts to
its dtype without loss of kind, finite, and inside a Box's bounds.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from typing import Any, Mapping, Optional

import numpy as np

NPY_CONTENT_TYPE = "application/x-npy"
DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024
DEFAULT_MAX_BATCH = 4096


class BadRequest(Exception):
    """A client error: HTTP status, the field it concerns, and what is wrong with it."""

    def __init__(self, status: int, field: str, message: str):
        super().__init__(message)
        self.status, self.field, self.message = status, field, message

    def body(self) -> dict[str, Any]:
        return {"error": self.message, "field": self.field}


@dataclass(frozen=True)
class ObservationSpec:
    """What a policy accepts: the observation space's per-sample shape, dtype and (for a Box) bounds."""

    shape: tuple[int, ...]
    dtype: np.dtype
    low: Optional[np.ndarray] = None
    high: Optional[np.ndarray] = None

    @classmethod
    def of(cls, space: Any) -> "ObservationSpec":
        import gymnasium as gym

        if isinstance(space, gym.spaces.Box):
            return cls(tuple(space.shape), np.dtype(space.dtype), np.asarray(space.low), np.asarray(space.high))
        if isinstance(space, gym.spaces.Discrete):
            return cls((), np.dtype(np.int64), np.asarray(space.start), np.asarray(space.start + space.n - 1))
        raise ValueError(f"serving needs a Box or Discrete observation space, not {type(space).__name__}")


@dataclass(frozen=True)
class ActRequest:
    observations: np.ndarray  # [batch, *shape], the space's dtype
    policy: str
    stochastic: bool


def parse_act(body: bytes, content_type: str, query: Mapping[str, str], specs: Mapping[str, ObservationSpec],
              default_policy: str, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
              max_batch: int = DEFAULT_MAX_BATCH) -> ActRequest:
    """The request, checked; `BadRequest` otherwise."""
    if len(body) > max_body_bytes:
        raise BadRequest(413, "body", f"the body is {len(body):,} bytes; at most {max_body_bytes:,} are taken")
    if content_type.split(";")[0].strip().lower() == NPY_CONTENT_TYPE:
        fields: dict[str, Any] = {"policy": query.get("policy"), "stochastic": _query_bool(query.get("stochastic"))}
        raw = _npy(body)
    else:
        fields = _json_object(body)
        unknown = sorted(set(fields) - {"observations", "policy", "stochastic"})
        if unknown:
            raise BadRequest(422, unknown[0], f"unknown field {unknown[0]!r}; the fields are observations, policy, stochastic")
        if "observations" not in fields:
            raise BadRequest(422, "observations", "missing: a list of observations")
        raw = fields["observations"]
    policy = fields.get("policy") or default_policy
    if not isinstance(policy, str):
        raise BadRequest(422, "policy", f"must be a string, not {type(policy).__name__}")
    if policy not in specs:
        raise BadRequest(404, "policy", f"no policy {policy!r}; served: {', '.join(sorted(specs))}")
    stochastic = fields.get("stochastic", False)
    if not isinstance(stochastic, bool):
        raise BadRequest(422, "stochastic", f"must be true or false, not {stochastic!r}")
    return ActRequest(observations(raw, specs[policy], max_batch), policy, stochastic)


def observations(raw: Any, spec: ObservationSpec, max_batch: int = DEFAULT_MAX_BATCH) -> np.ndarray:
    """A batch of observations as the policy's dtype, after every check of the module's text."""
    try:
        array = np.asarray(raw)
    except (ValueError, TypeError, RecursionError):  # ragged or absurdly deep nesting
        raise BadRequest(422, "observations", f"not a regular array: every observation must have shape {list(spec.shape)}") from None
    if array.dtype == object or array.dtype.kind not in "biuf":
        kind = "ragged or mixed" if array.dtype == object else f"of {array.dtype}"
        raise BadRequest(422, "observations", f"must be numbers, not an array {kind}")
    if array.ndim != len(spec.shape) + 1 or tuple(array.shape[1:]) != spec.shape:
        raise BadRequest(422, "observations", f"shape {list(array.shape)}: expected [batch, {', '.join(map(str, spec.shape))}]"
                         .replace(", ]", "]"))
    if not 1 <= len(array) <= max_batch:
        raise BadRequest(422, "observations", f"a batch of {len(array)}: 1 to {max_batch} observations are taken")
    if spec.dtype.kind in "iu" and array.dtype.kind == "f":
        if not np.all(np.isfinite(array)) or np.any(array != np.round(array)):
            raise BadRequest(422, "observations", f"the space holds integers ({spec.dtype}); got fractions")
    if array.dtype.kind == "f" and not np.all(np.isfinite(array)):
        index = np.argwhere(~np.isfinite(array))[0]
        raise BadRequest(422, f"observations{_at(index)}", f"{array[tuple(index)]} is not a finite number")
    _inside(array, spec)
    return array.astype(spec.dtype, copy=False)


def _inside(array: np.ndarray, spec: ObservationSpec) -> None:
    if spec.low is None or spec.high is None:
        return
    below, above = array < spec.low, array > spec.high
    for mask, side, bound in ((below, "below", spec.low), (above, "above", spec.high)):
        if mask.any():
            index = np.argwhere(mask)[0]
            limit = np.broadcast_to(bound, array.shape[1:])[tuple(index[1:])]
            raise BadRequest(422, f"observations{_at(index)}",
                             f"{array[tuple(index)]} is {side} the observation space's {'low' if side == 'below' else 'high'} {limit}")


def _at(index: np.ndarray) -> str:
    return "".join(f"[{int(i)}]" for i in index)


def _json_object(body: bytes) -> dict[str, Any]:
    try:
        value = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(400, "body", f"not JSON: {exc}") from None
    except RecursionError:
        raise BadRequest(400, "body", "JSON nested too deeply") from None
    if not isinstance(value, dict):
        raise BadRequest(400, "body", f"must be a JSON object, not {type(value).__name__}")
    return value


def _npy(body: bytes) -> np.ndarray:
    """The array, after its header's shape and dtype are checked against the bytes that came (no allocation first)."""
    fp = io.BytesIO(body)
    try:
        version = np.lib.format.read_magic(fp)
        read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, _, dtype = read_header(fp)
        if int(np.prod(shape, dtype=np.int64)) * dtype.itemsize > len(body):
            raise ValueError(f"its header declares shape {list(shape)} of {dtype}, more than the {len(body):,} bytes sent")
        fp.seek(0)
        return np.load(fp, allow_pickle=False)
    except (ValueError, OSError, EOFError, MemoryError) as exc:
        raise BadRequest(400, "body", f"not a .npy array: {exc}") from None


def _query_bool(value: Optional[str]) -> Any:
    if value is None:
        return False
    lowered = value.lower()
    return True if lowered in ("1", "true") else False if lowered in ("0", "false") else value

"""`export.json`, the description beside an exported policy: spaces, inputs and outputs, preprocessing, source.

Read by `evaluate` on an export (with onnxruntime or torch alone) and by anyone who serves the model.
Nothing here imports Ray or RLlib.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from rlplatform.errors import UserError

SPEC_FILE = "export.json"
SPEC_VERSION = 1
FORMATS = {"onnx": ".onnx", "torchscript": ".pt"}
SINGLE_POLICY_STEM = "policy"  # a single-agent export is policy.onnx / policy.pt; multi-agent: <policy id>.onnx


def model_file_name(policy: str, fmt: str, multi_agent: bool) -> str:
    return f"{policy if multi_agent else SINGLE_POLICY_STEM}{FORMATS[fmt]}"


def _number(value: float) -> Any:
    """JSON has no infinity: unbounded Box dimensions are written as the strings "inf" / "-inf"."""
    value = float(value)
    return value if math.isfinite(value) else ("inf" if value > 0 else "-inf")


def _numbers(array) -> Any:
    """One number when every element is the same (an 84x84x4 image space), else the nested list."""
    import numpy as np

    array = np.asarray(array)
    flat = array.reshape(-1)
    if flat.size and np.all(flat == flat[0]):
        return _number(flat[0])
    return [_numbers(a) for a in array] if array.ndim > 1 else [_number(v) for v in flat]


def space_to_json(space) -> dict[str, Any]:
    import gymnasium as gym
    import numpy as np

    if isinstance(space, gym.spaces.Discrete):
        return {"type": "Discrete", "n": int(space.n), "start": int(space.start)}
    if isinstance(space, gym.spaces.Box):
        return {"type": "Box", "shape": list(space.shape), "dtype": str(np.dtype(space.dtype)),
                "low": _numbers(space.low), "high": _numbers(space.high)}
    if isinstance(space, gym.spaces.MultiDiscrete):
        return {"type": "MultiDiscrete", "nvec": np.asarray(space.nvec).tolist()}
    return {"type": type(space).__name__, "repr": repr(space)}


def space_from_json(data: dict[str, Any]):
    import gymnasium as gym
    import numpy as np

    def bound(value):
        return np.asarray(value if not isinstance(value, str) else float(value), dtype=np.float64)

    if data["type"] == "Discrete":
        return gym.spaces.Discrete(data["n"], start=data.get("start", 0))
    if data["type"] == "Box":
        low = np.vectorize(float)(np.asarray(data["low"], dtype=object)) if isinstance(data["low"], list) else bound(data["low"])
        high = np.vectorize(float)(np.asarray(data["high"], dtype=object)) if isinstance(data["high"], list) else bound(data["high"])
        return gym.spaces.Box(np.broadcast_to(low, data["shape"]), np.broadcast_to(high, data["shape"]),
                              shape=tuple(data["shape"]), dtype=np.dtype(data["dtype"]))
    if data["type"] == "MultiDiscrete":
        return gym.spaces.MultiDiscrete(data["nvec"])
    raise UserError(f"{SPEC_FILE}: cannot rebuild a {data['type']} space")


def write_spec(out_dir: Path, spec: dict[str, Any]) -> Path:
    path = out_dir / SPEC_FILE
    path.write_text(json.dumps({"version": SPEC_VERSION, **spec}, indent=1, default=str) + "\n")
    return path


def read_spec(path: Path) -> dict[str, Any]:
    """`path`: an export directory or its export.json."""
    file = path / SPEC_FILE if path.is_dir() else path
    if not file.is_file():
        raise UserError(f"not an export directory (no {SPEC_FILE}): {path}")
    try:
        spec = json.loads(file.read_text())
    except ValueError as exc:
        raise UserError(f"{file}: not valid JSON ({exc})") from None
    if not isinstance(spec, dict) or spec.get("version") != SPEC_VERSION or not isinstance(spec.get("policies"), dict):
        raise UserError(f"{file}: not an rlplatform export description (version {SPEC_VERSION})")
    return spec


def spec_beside(model_file: Path) -> dict[str, Any] | None:
    """The export.json in a model file's directory that describes that file, if there is one."""
    file = model_file.parent / SPEC_FILE
    if not file.is_file():
        return None
    spec = read_spec(file)
    names = {p.get("file") for p in spec["policies"].values()}
    return spec if model_file.name in names else None

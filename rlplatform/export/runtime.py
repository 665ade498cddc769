"""An exported policy run with onnxruntime (or torch, for TorchScript) alone: no Ray, no RLlib.

`ExportedPolicy.act` takes a batch of observations (and the RNN state, for recurrent policies) and
returns env actions, ready for `env.step`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import numpy as np

from rlplatform.errors import UserError
from rlplatform.export.spec import FORMATS


class ExportedPolicy:
    def __init__(self, path: Path, description: Optional[dict[str, Any]] = None, seed: int = 0):
        """`description`: the policy's entry in export.json; without one, inputs and outputs are read from the model."""
        if path.suffix not in FORMATS.values():
            raise UserError(f"{path}: an exported policy ends in .onnx or .pt")
        if not path.is_file():
            raise UserError(f"no such model file: {path}")
        self.path = path
        self._rng = np.random.default_rng(seed)
        self.noise = (description or {}).get("noise")
        if path.suffix == ".onnx":
            self._load_onnx(path)
        else:
            self._load_torchscript(path, description)

    def _load_onnx(self, path: Path) -> None:
        try:
            import onnxruntime as ort
        except ImportError:
            raise UserError('an ONNX policy needs onnxruntime (pip install -e ".[export]")') from None
        options = ort.SessionOptions()
        options.log_severity_level = 3  # errors only
        try:
            self._session = ort.InferenceSession(str(path), sess_options=options, providers=["CPUExecutionProvider"])
        except Exception as exc:  # a truncated or foreign file
            raise UserError(f"{path}: onnxruntime cannot load it: {str(exc).splitlines()[0]}") from None
        self.inputs = [(i.name, [d if isinstance(d, int) else None for d in i.shape], i.type) for i in self._session.get_inputs()]
        self.outputs = [o.name for o in self._session.get_outputs()]
        self._torch_module = None

    def _load_torchscript(self, path: Path, description: Optional[dict[str, Any]]) -> None:
        import torch

        if description is None:
            raise UserError(f"{path}: a TorchScript policy needs the export.json written beside it")
        try:
            self._torch_module = torch.jit.load(str(path), map_location="cpu")
        except Exception as exc:
            raise UserError(f"{path}: torch cannot load it: {str(exc).splitlines()[0]}") from None
        self.inputs = [(s["name"], s["shape"][1:], s["dtype"]) for s in description["inputs"]]
        self.outputs = [s["name"] for s in description["outputs"]]

    @property
    def state_inputs(self) -> list[str]:
        return [name for name, _, _ in self.inputs if name.startswith("state_in.")]

    @property
    def obs_dtype(self):
        name, _, dtype = self.inputs[0]
        return np.float64 if "double" in dtype or dtype == "float64" else np.uint8 if "uint8" in dtype else np.float32

    def initial_state(self, batch: int = 1) -> Optional[list[np.ndarray]]:
        """Zeros for every state input (RLlib's LSTM encoders start from zeros), or None for a stateless policy."""
        if not self.state_inputs:
            return None
        shapes = {name: shape for name, shape, _ in self.inputs}
        return [np.zeros((batch, *self._per_sample(shapes[name])), dtype=np.float32) for name in self.state_inputs]

    @staticmethod
    def _per_sample(shape: list) -> list[int]:
        """ONNX shapes carry the batch dimension first; export.json's TorchScript shapes do not."""
        return [int(d) for d in shape if d is not None and not isinstance(d, str)]

    def _noise(self, batch: int) -> Optional[np.ndarray]:
        spec = next(((name, shape) for name, shape, _ in self.inputs if name == "noise"), None)
        if spec is None:
            return None
        shape = (batch, *self._per_sample(spec[1]))
        if self.noise is None:
            raise UserError(f"{self.path} samples from a `noise` input: its export.json (which says how to draw it) must be beside it")
        if self.noise == "normal(0,1)":
            return self._rng.standard_normal(shape).astype(np.float32)
        return self._rng.random(shape).astype(np.float32)

    def act(self, observations, state: Optional[list[np.ndarray]] = None):
        """Env actions for a batch of observations, and the next RNN state (None for stateless policies)."""
        obs = np.asarray(observations, dtype=self.obs_dtype)
        feeds: dict[str, np.ndarray] = {"obs": obs}
        noise = self._noise(len(obs))
        if noise is not None:
            feeds["noise"] = noise
        for name, value in zip(self.state_inputs, state or []):
            feeds[name] = value
        results = self._run(feeds)
        actions = results[0]
        next_state = list(results[1:]) if self.state_inputs else None
        return actions, next_state

    def _run(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        if self._torch_module is None:
            return self._session.run(self.outputs, feeds)
        import torch

        with torch.no_grad():
            out = self._torch_module(*(torch.from_numpy(np.ascontiguousarray(feeds[name])) for name, _, _ in self.inputs))
        return [t.numpy() for t in (out if isinstance(out, tuple) else (out,))]

"""Write a checkpoint's policies as ONNX (torch's exporter, checked by onnx.checker) or TorchScript files,
one per policy, with `export.json` beside them."""

from __future__ import annotations

import datetime as dt
import logging
import warnings
from pathlib import Path
from typing import Any, Optional

from rlplatform.config.schema import ExperimentConfig
from rlplatform.errors import UserError
from rlplatform.export.spec import model_file_name, space_to_json, write_spec
from rlplatform.run.checkpoints import CheckpointInfo

EXTRA_HINT = 'pip install -e ".[export]"'


def export_checkpoint(info: CheckpointInfo, config: ExperimentConfig, fmt: str, out_dir: Path,
                      stochastic: bool = False, policy: Optional[str] = None) -> dict[str, Any]:
    """Every policy of the checkpoint (or the one named) into `out_dir`; returns the export description."""
    from rlplatform.adapter.policy import load_inference_module, module_ids

    if config.model.action_mask is not None:  # before anything is written
        raise UserError(f"checkpoint {info.path}: a masked policy (model.action_mask) does not export yet: the model "
                        "would take the mask as an input; evaluate it from the checkpoint")
    if fmt == "onnx":
        _require_onnx()
    ma = config.multi_agent
    multi_agent = ma is not None
    names = [policy] if policy else (list(ma.policies) if ma is not None else module_ids(info.path)[:1])
    out_dir.mkdir(parents=True, exist_ok=True)
    policies = {}
    for name in names:
        module = load_inference_module(info.path, name if multi_agent or policy else None)
        policies[name] = _export_policy(module, config, fmt, stochastic, out_dir / model_file_name(name, fmt, multi_agent))
    spec = {
        "format": fmt,
        "algorithm": config.algorithm,
        "env": config.env,
        "env_config": config.env_config,
        "stochastic": stochastic,
        "preprocessing": preprocessing(config),
        "multi_agent": {"mapping": ma.mapping} if ma is not None else None,
        "policies": policies,
        "source": {"checkpoint": str(info.path.resolve()), "iteration": info.iteration, "env_steps": info.env_steps,
                   "experiment": config.name, "seed": config.seed},
        "versions": versions(fmt),
        "created": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
    }
    write_spec(out_dir, spec)
    return spec


def preprocessing(config: ExperimentConfig) -> dict[str, Any]:
    """What the model expects: the observation exactly as the env (with `env_config`) returns it.

    Frame stacking and scaling of our image envs happen inside the env (`rlplatform/Atari-v0`,
    `rlplatform/PixelCatch-v0`); RLlib's default env-to-module connectors only batch the observation.
    """
    return {
        "observation": "as returned by the env built from `env` and `env_config`; no scaling, flattening or stacking in the model",
        "frame_stack": int(config.env_config.get("frame_stack", 1)),
        "frame_stack_done_by": "the env" if "frame_stack" in config.env_config else None,
        "scaling": "none in the model (image envs here scale to [0, 1] themselves)",
        "actions": "the model outputs env actions: unsquashed to the Box bounds and clipped as RLlib's "
                   "NormalizeAndClipActions does (rllib.environment normalize_actions / clip_actions)",
    }


def versions(fmt: str) -> dict[str, Optional[str]]:
    from rlplatform.run.run_dir import library_versions

    return library_versions(("onnx", "onnxscript", "onnxruntime") if fmt == "onnx" else ())


def _require_onnx() -> None:
    try:
        import onnx  # noqa: F401
        import onnxscript  # noqa: F401
    except ImportError as exc:
        raise UserError(f"--format onnx needs the `export` extra ({EXTRA_HINT}): {exc}") from None


def _export_policy(module, config: ExperimentConfig, fmt: str, stochastic: bool, path: Path) -> dict[str, Any]:
    import torch

    from rlplatform.adapter.export import InferencePolicy

    wrapper = InferencePolicy(module, config, stochastic).eval()
    signature = wrapper.signature()
    inputs = wrapper.example_inputs()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # tracing notes about RLlib's asserts and shape checks, not about the result
        if fmt == "onnx":
            _write_onnx(wrapper, inputs, signature, path)
        else:
            _write_torchscript(wrapper, inputs, path)
    return {
        "file": path.name,
        "observation_space": space_to_json(module.observation_space),
        "action_space": space_to_json(module.action_space),
        "action_distribution": wrapper.dist_kind,
        "inputs": signature.inputs,
        "outputs": signature.outputs,
        "noise": signature.noise,
        "module_class": type(module).__name__,
    }


def _write_onnx(wrapper, inputs, signature, path: Path) -> None:
    import onnx
    import torch

    logging.getLogger("torch.onnx").setLevel(logging.ERROR)  # "torchvision is not installed" notes, per operator
    batch = torch.export.Dim("batch")
    rest = tuple({0: batch} for _ in inputs[1:])
    dynamic = ({0: batch}, rest) if rest else ({0: batch},)  # the structure of forward(obs, *rest)
    try:
        program = torch.onnx.export(wrapper, inputs, dynamo=True, input_names=signature.input_names(),
                                    output_names=signature.output_names(), dynamic_shapes=dynamic,
                                    external_data=False, verbose=False)
    except Exception as exc:  # the exporter's errors are pages long; their first line names the construct
        raise UserError(f"torch's ONNX exporter failed on this policy: {type(exc).__name__}: {str(exc).splitlines()[0]}") from None
    program.save(str(path), external_data=False)
    model = onnx.load(str(path))
    onnx.checker.check_model(model, full_check=True)


def _write_torchscript(wrapper, inputs, path: Path) -> None:
    import torch

    traced = torch.jit.trace(wrapper, inputs, check_trace=False)
    traced.save(str(path))

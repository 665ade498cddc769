"""Trained policies out of RLlib checkpoints: only the RLModule loaded, greedy actions in this process."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from rlplatform.adapter.algorithm_config import quiet_rllib_logs
from rlplatform.config.schema import ExperimentConfig
from rlplatform.errors import UserError

RL_MODULE_SUBDIR = Path("learner_group") / "learner" / "rl_module"


def is_rllib_checkpoint(path: Path) -> bool:
    return (path / "rllib_checkpoint.json").is_file() and (path / RL_MODULE_SUBDIR).is_dir()


def module_ids(checkpoint: Path) -> list[str]:
    return sorted(p.name for p in (checkpoint / RL_MODULE_SUBDIR).iterdir() if p.is_dir())


def load_inference_module(checkpoint: Path, module_id: Optional[str] = None):
    """Load only the policy network from a checkpoint: no Ray, no env runners, no learners."""
    from ray.rllib.core import DEFAULT_MODULE_ID
    from ray.rllib.core.rl_module.rl_module import RLModule

    quiet_rllib_logs()
    module_id = module_id or DEFAULT_MODULE_ID
    module_dir = (checkpoint / RL_MODULE_SUBDIR / module_id).resolve()  # pyarrow rejects relative paths
    if not module_dir.is_dir():
        raise UserError(f"checkpoint {checkpoint} has no policy {module_id!r}; it has: {', '.join(module_ids(checkpoint))}")
    try:
        return RLModule.from_checkpoint(module_dir)
    except Exception as exc:  # a torn or foreign checkpoint: any error means it cannot be used
        raise UserError(f"checkpoint {checkpoint} cannot be loaded: {type(exc).__name__}: {exc}") from None


def check_loads(checkpoint: Path, module_id: Optional[str] = None) -> None:
    """Load the named policy (default: the checkpoint's first) to prove the checkpoint usable; UserError if not."""
    load_inference_module(checkpoint, module_id or next(iter(module_ids(checkpoint)), None))


def as_module_input(obs):
    """Observations as RLlib's NumpyToTensor hands them to a module: floats other than float16 as float32
    (MuJoCo's are float64; the module's weights are float32)."""
    import torch

    return obs.float() if obs.is_floating_point() and obs.dtype != torch.float16 else obs


def greedy_actions(module: Any, observations: Any, state: Any = None) -> tuple[Any, Any]:
    """Deterministic actions for a batch of observations (and the next RNN state, if any)."""
    import numpy as np
    import torch
    import tree  # dm-tree, an RLlib dependency: a Dict observation's entries each become a tensor
    from ray.rllib.core.columns import Columns

    def tensor(value: Any) -> Any:
        out = as_module_input(torch.as_tensor(np.asarray(value)))
        return out.unsqueeze(1) if state is not None else out  # [B, T=1, ...]

    batch: dict[str, Any] = {Columns.OBS: tree.map_structure(tensor, observations)}
    if state is not None:
        batch[Columns.STATE_IN] = state
    with torch.no_grad():
        out = module.forward_inference(batch)
    if Columns.ACTIONS in out:  # DQN/SAC modules pick their greedy action themselves
        actions = out[Columns.ACTIONS]
    else:
        dist_cls = module.get_inference_action_dist_cls()
        actions = dist_cls.from_logits(out[Columns.ACTION_DIST_INPUTS]).to_deterministic().sample()
    if state is not None:
        actions = actions.squeeze(1) if actions.dim() > 1 else actions
    return actions.cpu().numpy(), out.get(Columns.STATE_OUT)


def initial_state(module):
    """The RNN state of a stateful module for a batch of one episode (None for stateless ones)."""
    import torch
    import tree  # dm-tree, an RLlib dependency: states are nested dicts

    if not module.is_stateful():
        return None
    return tree.map_structure(lambda s: torch.as_tensor(s).unsqueeze(0), module.get_initial_state())


def to_env_action(action, action_space, config: ExperimentConfig):
    """What RLlib's module-to-env connector does to an action: unsquash from [-1, 1], then clip."""
    from ray.rllib.utils.spaces.space_utils import clip_action, unsquash_action

    env_runner_options = config.rllib.get("environment", {})
    if env_runner_options.get("normalize_actions", True):
        action = unsquash_action(action, action_space)
    if env_runner_options.get("clip_actions", False):
        action = clip_action(action, action_space)
    return action

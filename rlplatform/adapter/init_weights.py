"""`init_from`: a run's policy starts from the weights of another run's checkpoint (BC -> PPO, CQL or IQL -> SAC).

Tensors are matched by name, or across RLlib's module families by the renames below, and copied where the shapes
agree; what finds no source (PPO's value function after BC) keeps its fresh initialisation.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rlplatform.errors import UserError

# RLlib 2.60's BC module (DefaultBCTorchRLModule) names its encoder `_encoder` and its policy head `_pi_head`; the
# PPO family's calls them `encoder.actor_encoder` (`encoder.encoder` with vf_share_layers) and `pi`.
_RENAMES = (("_encoder.", ("encoder.actor_encoder.", "encoder.encoder.")), ("_pi_head.", ("pi.",)))
# The tensors that make a policy act: PPO's family and BC (`pi`, the actor encoder), SAC's family (`pi_encoder`), DQN's
# (`encoder`, the advantage head `af`).
POLICY_PREFIXES = ("pi.", "pi_encoder.", "encoder.", "af.")


def mapped_state(source: dict[str, Any], target: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """`target` with every tensor that has a source of the same shape replaced by it; the names replaced."""
    state, copied = dict(target), []
    for key, value in source.items():
        names = [key, *(new + key[len(old):] for old, news in _RENAMES if key.startswith(old) for new in news)]
        for name in names:
            if name in target and tuple(target[name].shape) == tuple(value.shape) and name not in copied:
                state[name] = value.to(dtype=target[name].dtype)
                copied.append(name)
                break
    return state, copied


def start_from(algo: Any, checkpoint: Path) -> list[str]:
    """Load the checkpoint's policy weights into every learner's module and send them to the env runners; the
    tensors copied. UserError when no tensor of the policy fits (another network shape, another env)."""
    from ray.rllib.core import DEFAULT_MODULE_ID

    from rlplatform.adapter.policy import load_inference_module

    source = load_inference_module(checkpoint).state_dict()

    def load(learner: Any) -> list[str]:
        module = learner.module[DEFAULT_MODULE_ID].unwrapped()  # with several learners, under torch's DDP wrapper
        state, copied = mapped_state(source, module.state_dict())
        module.load_state_dict(state)
        return copied

    copied = [result.get() for result in algo.learner_group.foreach_learner(load)][0]  # get() raises a learner's error
    if not any(name.startswith(POLICY_PREFIXES) for name in copied):
        raise UserError(f"init_from {checkpoint}: none of its policy's tensors fits this run's network "
                        f"(its tensors: {', '.join(f'{k} {list(v.shape)}' for k, v in source.items())})")
    if algo.env_runner_group is not None:
        algo.env_runner_group.sync_weights(from_worker_or_learner_group=algo.learner_group, inference_only=True)
    return copied

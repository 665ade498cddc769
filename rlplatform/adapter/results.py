"""Our stable metric names, mapped from RLlib's result dict in this one place.

RLlib's result keys change between releases and number in the hundreds; runs log the
names below (TensorBoard, metrics.jsonl, progress lines), always against env steps sampled.
"""

from __future__ import annotations

import math
from collections import deque
from numbers import Number
from typing import Any, Optional, SupportsFloat, cast

from rlplatform.adapter.algorithm_config import EPISODE_LENGTHS, EPISODE_RETURNS, ILLEGAL_ACTIONS
from rlplatform.internals import GRADIENT_CPU_S, WEIGHTS_APPLY_S

ENV_STEPS = "env_steps"  # x axis of every curve
_LEARNER_RENAMES = {"default_optimizer_learning_rate": "lr", "mean_kl_loss": "kl"}
_LEARNER_SKIP_PREFIXES = ("num_", "weights_seq_no", "diff_num_grad_updates", "module_train_batch_size")


def _number(value: Any) -> Optional[float]:
    if isinstance(value, Number) and not isinstance(value, bool):
        value = float(cast(SupportsFloat, value))  # typeshed's Number declares no __float__
        return value if math.isfinite(value) else None
    try:  # numpy scalars and 0-d tensors
        return _number(value.item())
    except (AttributeError, ValueError):
        return None


def _get(tree: dict[str, Any], *path: str) -> Any:
    for part in path:
        if not isinstance(tree, dict) or part not in tree:
            return None
        tree = tree[part]
    return tree


def _as_list(series: Any) -> list:
    """RLlib's item series reduces a single item to the bare item."""
    if series is None:
        return []
    return list(series) if isinstance(series, (list, tuple, deque)) else [series]


def start_timers_afresh(algo) -> None:
    """Make the next result's timers that iteration's own.

    RLlib reduces its timers (sampling, learner update, weight sync, ...) as an exponential moving average
    with a coefficient of 0.01, so `timers` in a result is mostly the first iterations' times: a run whose
    first sample took 1.18 s and later ones 1.06 s still reported 1.18 s five iterations on. Dropping the
    timers after each result makes every `time/*` tag the iteration's own measurement. Nothing in RLlib
    reads its timers back.
    """
    from ray.rllib.utils.metrics import TIMERS

    algo.metrics.delete(TIMERS, key_error=False)


def from_rllib_result(result: dict[str, Any], epochs_per_batch: int = 1, offline: bool = False) -> dict[str, Any]:
    """Flatten one `Algorithm.train()` result into our names (runs inside the algorithm host).

    `epochs_per_batch`: RLlib counts a sample once per epoch it is trained in; we count it once.
    `offline`: the algorithm learns from recorded data (`data`): env steps are the recorded steps it has trained on,
    and the episodes are its evaluation's (greedy) ones.
    """
    if offline:
        return _offline_result(result)
    runners = result.get("env_runners") or {}
    timers = result.get("timers") or {}
    iteration_s = _number(result.get("time_this_iter_s")) or 0.0
    sampled = _number(runners.get("num_env_steps_sampled")) or 0.0
    trained = sum(
        _number(stats.get("num_module_steps_trained")) or 0.0
        for module, stats in (result.get("learners") or {}).items()
        if module != "__all_modules__" and isinstance(stats, dict)
    ) / max(1, epochs_per_batch)
    out: dict[str, Any] = {
        "iteration": int(result.get("training_iteration", 0)),
        ENV_STEPS: int(_number(result.get("num_env_steps_sampled_lifetime")) or _number(runners.get("num_env_steps_sampled_lifetime")) or 0),
        "episode_returns": [float(x) for x in _as_list(runners.get(EPISODE_RETURNS))],
        "episode_lengths": [int(x) for x in _as_list(runners.get(EPISODE_LENGTHS))],
        "throughput/env_steps_sampled_per_s": sampled / iteration_s if iteration_s else None,
        # Honest count: RLlib's num_env_steps_trained is inflated by minibatches x epochs,
        # its num_module_steps_trained by epochs.
        "throughput/env_steps_trained_per_s": trained / iteration_s if iteration_s else None,
        "env_steps_sampled_this_iter": sampled,
        "time/iteration_s": iteration_s,
        "time/sample_s": _number(timers.get("env_runner_sampling_timer")),
        "time/learn_s": _number(timers.get("learner_update_timer")),
        "time/sync_weights_s": _number(timers.get("synch_weights")),
        # The slowest runner's apply of the weights it last received (fetch included), set by the lean env runners.
        "time/weights_apply_s": _number(runners.get(WEIGHTS_APPLY_S)),
        # CPU seconds the learners spent in gradient steps so far (the lean learners only; bench ingest).
        "cpu/learner_gradient_s": _number(_get(result, "learners", "__all_modules__", GRADIENT_CPU_S)),
        # Sampled actions that their step's mask forbade, this iteration (model.action_mask; 0 by design).
        "actions/illegal": _number(runners.get(ILLEGAL_ACTIONS)),
        "faults/healthy_env_runners": _number(_get(result, "fault_tolerance", "num_healthy_workers")),
        "faults/env_runner_restarts": _number(_get(result, "fault_tolerance", "num_remote_worker_restarts")),
        "eval/return_mean": _number(_get(result, "evaluation", "env_runners", "episode_return_mean")),
        "eval/episode_length_mean": _number(_get(result, "evaluation", "env_runners", "episode_len_mean")),
    }
    # Per-policy returns (multi-agent runners say "returns", single-agent ones "return").
    per_module = runners.get("module_episode_returns_mean") or runners.get("module_episode_return_mean") or {}
    if isinstance(per_module, dict) and set(per_module) - {"default_policy"}:
        for module, value in per_module.items():
            out[f"return/{module}/mean"] = _number(value)
    out.update(_learner_metrics(result))
    return {k: v for k, v in out.items() if v is not None}


def _learner_metrics(result: dict[str, Any]) -> dict[str, float]:
    out: dict[str, float] = {}
    for module, stats in (result.get("learners") or {}).items():
        if module == "__all_modules__" or not isinstance(stats, dict):
            continue
        for name, value in stats.items():
            number = _number(value)
            if number is None or name.startswith(_LEARNER_SKIP_PREFIXES):
                continue
            out[f"learner/{module}/{_LEARNER_RENAMES.get(name, name)}"] = number
    return out


def _offline_result(result: dict[str, Any]) -> dict[str, Any]:
    """An offline algorithm's result: no env runners sample, so env steps count the recorded env steps trained on
    (RLlib's learner lifetime count), and the evaluation's episodes feed the return window."""
    timers = result.get("timers") or {}
    evaluation = _get(result, "evaluation", "env_runners") or {}
    iteration_s = _number(result.get("time_this_iter_s")) or 0.0
    trained = _number(_get(result, "learners", "__all_modules__", "num_env_steps_trained")) or 0.0
    out: dict[str, Any] = {
        "iteration": int(result.get("training_iteration", 0)),
        ENV_STEPS: int(_number(_get(result, "learners", "__all_modules__", "num_env_steps_trained_lifetime")) or 0),
        "episode_returns": [float(x) for x in _as_list(evaluation.get(EPISODE_RETURNS))],
        "episode_lengths": [int(x) for x in _as_list(evaluation.get(EPISODE_LENGTHS))],
        "throughput/env_steps_trained_per_s": trained / iteration_s if iteration_s else None,
        "time/iteration_s": iteration_s,
        "time/sample_s": _number(timers.get("offline_sampling_timer")),
        "time/learn_s": _number(timers.get("learner_update_timer")),
        "eval/return_mean": _number(evaluation.get("episode_return_mean")),
        "eval/episode_length_mean": _number(evaluation.get("episode_len_mean")),
        **_learner_metrics(result),
    }
    return {k: v for k, v in out.items() if v is not None}

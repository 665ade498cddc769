"""Our stable metric names, mapped from RLlib's result dict in this one place.

RLlib's result keys change between releases and number in the hundreds; runs log the
names below (TensorBoard, metrics.jsonl, progress lines), always against env steps sampled.
"""

from __future__ import annotations

import json
import math
from collections import deque
from numbers import Number
from pathlib import Path
from typing import Any, Iterable, Optional

from rlplatform.rllib_adapter import EPISODE_LENGTHS, EPISODE_RETURNS

RETURN_WINDOW = 100  # episodes in the smoothed return, as in Gym's "solved" criterion
ENV_STEPS = "env_steps"  # x axis of every curve
_LEARNER_RENAMES = {"default_optimizer_learning_rate": "lr", "mean_kl_loss": "kl"}
_LEARNER_SKIP_PREFIXES = ("num_", "weights_seq_no", "diff_num_grad_updates", "module_train_batch_size")


def _number(value: Any) -> Optional[float]:
    if isinstance(value, Number) and not isinstance(value, bool):
        value = float(value)
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


def from_rllib_result(result: dict[str, Any], epochs_per_batch: int = 1) -> dict[str, Any]:
    """Flatten one `Algorithm.train()` result into our names (runs inside the algorithm host).

    `epochs_per_batch`: RLlib counts a sample once per epoch it is trained in; we count it once.
    """
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
    for module, stats in (result.get("learners") or {}).items():
        if module == "__all_modules__" or not isinstance(stats, dict):
            continue
        for name, value in stats.items():
            number = _number(value)
            if number is None or name.startswith(_LEARNER_SKIP_PREFIXES):
                continue
            out[f"learner/{module}/{_LEARNER_RENAMES.get(name, name)}"] = number
    return {k: v for k, v in out.items() if v is not None}


class EpisodeWindow:
    """The last RETURN_WINDOW episodes: an exact moving mean, kept in checkpoints for resume."""

    def __init__(self, returns: Iterable[float] = (), lengths: Iterable[int] = (), episodes_total: int = 0):
        self.returns: deque[float] = deque(returns, maxlen=RETURN_WINDOW)
        self.lengths: deque[int] = deque(lengths, maxlen=RETURN_WINDOW)
        self.episodes_total = episodes_total

    def add(self, returns: list[float], lengths: list[int]) -> None:
        self.returns.extend(returns)
        self.lengths.extend(lengths)
        self.episodes_total += len(returns)

    @property
    def full(self) -> bool:
        return len(self.returns) == RETURN_WINDOW

    def summary(self) -> dict[str, float]:
        if not self.returns:
            return {"episodes/total": self.episodes_total}
        return {
            "return/mean": sum(self.returns) / len(self.returns),
            "return/min": min(self.returns),
            "return/max": max(self.returns),
            "episode/length_mean": sum(self.lengths) / max(1, len(self.lengths)),
            "episodes/total": self.episodes_total,
        }

    def state(self) -> dict[str, Any]:
        return {"returns": list(self.returns), "lengths": list(self.lengths), "episodes_total": self.episodes_total}

    @classmethod
    def from_state(cls, state: Optional[dict[str, Any]]) -> "EpisodeWindow":
        return cls(**state) if state else cls()


def scalars(metrics: dict[str, Any]) -> dict[str, float]:
    """The per-iteration numbers that go to TensorBoard and metrics.jsonl."""
    return {k: float(v) for k, v in metrics.items() if "/" in k and isinstance(v, (int, float))}


class RunLogger:
    """TensorBoard event files and metrics.jsonl in the run directory, both keyed by env steps.

    A fresh run also gets its HParams record at once and its dashboard layout after the first
    iteration (from the tags it really logs); a resumed run already has both.
    """

    def __init__(self, run_dir: Path, config=None, fresh: bool = True):
        from torch.utils.tensorboard import SummaryWriter

        from rlplatform import tb_layout

        self._tb_layout = tb_layout
        self.writer = SummaryWriter(log_dir=str(run_dir), flush_secs=10)
        self.jsonl = (run_dir / "metrics.jsonl").open("a")
        self._layout_pending = fresh
        if fresh and config is not None:
            tb_layout.write_hparams(self.writer, config)

    def log(self, metrics: dict[str, Any]) -> None:
        step = int(metrics[ENV_STEPS])
        values = scalars(metrics)
        if self._layout_pending:
            self._tb_layout.write_layout(self.writer, values)
            self._layout_pending = False
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, global_step=step, walltime=metrics.get("timestamp"))
        self.writer.add_scalar("progress/iteration", metrics["iteration"], global_step=step)
        record = {"iteration": metrics["iteration"], ENV_STEPS: step, "wall_time_s": metrics.get("wall_time_s"), **values}
        self.jsonl.write(json.dumps(record) + "\n")
        self.jsonl.flush()

    def close(self) -> None:
        self.writer.close()
        self.jsonl.close()

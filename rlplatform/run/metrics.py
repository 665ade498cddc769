"""A run's metrics: the exact 100-episode window, and the TensorBoard events and metrics.jsonl they go to.

The tag names come from `adapter.results` (RLlib's result dict mapped onto our stable names);
every curve is logged against env steps sampled.
"""

from __future__ import annotations

import json
from collections import deque
from pathlib import Path
from typing import Any, Iterable, Optional

from rlplatform.adapter.results import ENV_STEPS
from rlplatform.config.schema import ExperimentConfig

RETURN_WINDOW = 100  # episodes in the smoothed return, as in Gym's "solved" criterion
METRICS_FILE = "metrics.jsonl"
ROLLED_BACK_FILE = "metrics.rolled_back.jsonl"


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
    """TensorBoard event files and metrics.jsonl in the run directory, both keyed by env steps, and the
    same tags to MLflow / W&B where the config's `tracking` section names them (run/tracking.py).

    A fresh run also gets its HParams record at once and its dashboard layout after the first
    iteration (from the tags it really logs); a resumed run already has both.
    """

    def __init__(self, run_dir: Path, config: Optional[ExperimentConfig] = None, fresh: bool = True,
                 purge_step: Optional[int] = None, hparams: Optional[dict[str, Any]] = None) -> None:
        """`purge_step`: on resume, the first env step after the checkpoint's; TensorBoard hides the events
        the lost iterations wrote at or after it, so no curve runs back over the same env steps.
        `hparams`: values the HParams record holds besides the config's own (a sweep's searched keys)."""
        from torch.utils.tensorboard import SummaryWriter

        from rlplatform.dashboards import tb_layout

        self._tb_layout = tb_layout
        self.writer = SummaryWriter(log_dir=str(run_dir), flush_secs=10, purge_step=purge_step)
        self.jsonl = (run_dir / METRICS_FILE).open("a")
        self._layout_pending = fresh
        if fresh and config is not None:
            tb_layout.write_hparams(self.writer, config, hparams)
        self.tracking = None
        if config is not None and (config.tracking.mlflow or config.tracking.wandb):
            from rlplatform.run.tracking import Tracking

            self.tracking = Tracking(run_dir, config, resume=not fresh)
        self.run_dir = run_dir

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
        if self.tracking is not None:
            self.tracking.log({**values, "progress/iteration": float(metrics["iteration"])}, step, metrics.get("timestamp"))

    def finish(self, final_checkpoint: Optional[Path], failed: bool) -> None:
        """The run's end, for the trackers: its artefacts and final checkpoint, and whether it failed."""
        if self.tracking is None:
            return
        from rlplatform.run.tracking import run_artifacts

        tags = {"rlplatform.final_checkpoint": str(final_checkpoint.resolve())} if final_checkpoint else {}
        self.tracking.add_artifacts(run_artifacts(self.run_dir), tags=tags)
        self.tracking.end(failed)

    def close(self) -> None:
        if self.tracking is not None:
            self.tracking.end()
        self.writer.close()
        self.jsonl.close()


def rewind_record(run_dir: Path, iteration: int) -> int:
    """Resuming from `iteration`: the rows after it (iterations lost with a crash, or a torn last line)
    leave metrics.jsonl for metrics.rolled_back.jsonl, each with when and why. Returns how many."""
    import datetime as dt
    import os

    path = run_dir / METRICS_FILE
    if not path.is_file():
        return 0
    kept: list[str] = []
    dropped: list[str] = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:  # the process died mid-line
            dropped.append(line)
            continue
        (kept if isinstance(row, dict) and row.get("iteration", 0) <= iteration else dropped).append(line)
    if not dropped:
        return 0
    note = {"resumed_from_iteration": iteration, "at": dt.datetime.now().astimezone().isoformat(timespec="seconds")}
    with (run_dir / ROLLED_BACK_FILE).open("a") as f:
        for line in dropped:
            f.write(json.dumps({"rolled_back": note, "row": line}) + "\n")
    tmp = path.with_name(METRICS_FILE + ".tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    os.replace(tmp, path)
    return len(dropped)

"""Checkpoints that are written completely or not at all; keep the last K and the best.

A checkpoint is saved into `checkpoints/.partial-NNNNNN`, completed with our marker file,
then renamed to `checkpoints/checkpoint_NNNNNN` (rename is atomic). A crash mid-write leaves
only a `.partial-` directory, which is never taken for a checkpoint and is cleaned up later.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from rlplatform.errors import UserError
from rlplatform.adapter.policy import is_rllib_checkpoint

MARKER = "rlplatform_checkpoint.json"
PREFIX = "checkpoint_"
PARTIAL = ".partial-"


@dataclass
class CheckpointInfo:
    path: Path
    iteration: int
    env_steps: int
    score: Optional[float]
    meta: dict[str, Any]


def read_checkpoint(path: Path) -> CheckpointInfo:
    marker = path / MARKER
    if not marker.is_file() or not is_rllib_checkpoint(path):
        raise UserError(f"not a complete checkpoint: {path}")
    try:
        meta = json.loads(marker.read_text())
        return CheckpointInfo(path, int(meta["iteration"]), int(meta["env_steps"]), meta.get("score"), meta)
    except (ValueError, KeyError, TypeError):
        raise UserError(f"corrupt checkpoint (unreadable {MARKER}): {path}") from None


def list_checkpoints(directory: Path) -> list[CheckpointInfo]:
    found = []
    for path in sorted(directory.glob(f"{PREFIX}*")) if directory.is_dir() else []:
        try:
            found.append(read_checkpoint(path))
        except UserError:
            continue
    return sorted(found, key=lambda c: c.iteration)


class CheckpointManager:
    def __init__(self, directory: Path, keep_last: int, keep_best: bool):
        self.directory = directory
        self.keep_last = keep_last
        self.keep_best = keep_best
        directory.mkdir(parents=True, exist_ok=True)
        for partial in directory.glob(f"{PARTIAL}*"):
            shutil.rmtree(partial, ignore_errors=True)

    def save(self, write: Callable[[str], None], iteration: int, env_steps: int, score: Optional[float], meta: dict[str, Any]) -> Path:
        final = self.directory / f"{PREFIX}{iteration:06d}"
        if final.exists():
            return final
        partial = self.directory / f"{PARTIAL}{iteration:06d}"
        shutil.rmtree(partial, ignore_errors=True)
        write(str(partial.resolve()))
        marker = {"iteration": iteration, "env_steps": env_steps, "score": score, **meta}
        (partial / MARKER).write_text(json.dumps(marker, indent=1))
        os.replace(partial, final)
        self._prune()
        return final

    def _prune(self) -> None:
        checkpoints = list_checkpoints(self.directory)
        keep = {c.path for c in checkpoints[-self.keep_last :]}
        best = best_checkpoint(checkpoints)
        if self.keep_best and best is not None:
            keep.add(best.path)
        for c in checkpoints:
            if c.path not in keep:
                shutil.rmtree(c.path, ignore_errors=True)


def best_checkpoint(checkpoints: list[CheckpointInfo]) -> Optional[CheckpointInfo]:
    scored = [c for c in checkpoints if c.score is not None]
    return max(scored, key=lambda c: (c.score, c.iteration)) if scored else None


def latest_checkpoint(run_dir: Path) -> CheckpointInfo:
    checkpoints = list_checkpoints(run_dir / "checkpoints")
    if not checkpoints:
        raise UserError(f"no complete checkpoint in {run_dir / 'checkpoints'}")
    return checkpoints[-1]

"""Checkpoints that are written completely or not at all, prove they are whole, and keep the last K and the best.

A checkpoint is saved into `checkpoints/.partial-NNNNNN`; then every file's size and BLAKE2b hash,
and the Ray, torch and rlplatform versions, go into our marker file; then the directory is renamed
to `checkpoints/checkpoint_NNNNNN` (rename is atomic). A crash mid-write leaves only a `.partial-`
directory, which is never taken for a checkpoint and is cleaned up later; a checkpoint damaged after
it was written (a truncated file, a lost one) fails `verify` and is skipped by resume and evaluate.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

from rlplatform.adapter.policy import is_rllib_checkpoint
from rlplatform.errors import UserError
from rlplatform.run.run_dir import CONFIG_FILE, library_versions

MARKER = "rlplatform_checkpoint.json"
PREFIX = "checkpoint_"
PARTIAL = ".partial-"
ROLLED_BACK = "rolled_back"
HASH_CHUNK = 1 << 20
_warned_versions: set[str] = set()


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


# ----------------------------------------------------------------------------- proof of wholeness


def file_digest(path: Path) -> str:
    digest = hashlib.blake2b(digest_size=32)
    with path.open("rb") as f:
        while chunk := f.read(HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def inventory(directory: Path) -> dict[str, dict[str, Any]]:
    """Every file below `directory` but our marker: relative path -> size and BLAKE2b-256 hash."""
    files = sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MARKER)
    return {str(p.relative_to(directory)): {"size": p.stat().st_size, "blake2b": file_digest(p)} for p in files}


def verify(info: CheckpointInfo) -> Optional[str]:
    """Why the checkpoint is not whole (a missing, truncated or changed file), or None when it is.

    Checkpoints written before files were recorded carry no inventory: only loading can tell."""
    recorded = info.meta.get("files")
    if recorded is None:
        return None
    for name, expected in recorded.items():
        path = info.path / name
        if not path.is_file():
            return f"{name} is missing"
        size = path.stat().st_size
        if size != expected["size"]:
            return f"{name} has {size:,} bytes, {expected['size']:,} were written"
        if file_digest(path) != expected["blake2b"]:
            return f"{name} has changed since it was written (BLAKE2b differs)"
    return None


def warn_if_other_ray(info: CheckpointInfo) -> None:
    """RLlib checkpoints are not promised across Ray releases: say so, once per release, before loading."""
    written_with = (info.meta.get("versions") or {}).get("ray")
    installed = library_versions()["ray"]
    if written_with and written_with != installed and written_with not in _warned_versions:
        _warned_versions.add(written_with)
        print(f"warning: {info.path.name} was written by ray {written_with}, this is ray {installed}; if it fails to "
              f"load, install ray=={written_with} to use it (RLlib checkpoints are not promised across releases)",
              file=sys.stderr)


def first_usable(candidates: Iterable[CheckpointInfo], loads: Callable[[CheckpointInfo], None],
                 where: Path) -> CheckpointInfo:
    """The first of `candidates` (in order of preference) that verifies and loads (`loads` raises UserError
    when it does not); one line on stderr names those skipped and why. None usable: a UserError naming
    each checkpoint's fault."""
    skipped: list[str] = []
    for info in candidates:
        fault = verify(info)
        if fault is None:
            warn_if_other_ray(info)
            try:
                loads(info)
            except UserError as exc:
                fault = str(exc)
        if fault is None:
            if skipped:
                print(f"skipped {len(skipped)} checkpoint(s) that are not whole: {'; '.join(skipped)}", file=sys.stderr)
            return info
        skipped.append(f"{info.path.name}: {fault}")
    if not skipped:
        raise UserError(f"no complete checkpoint in {where}")
    raise UserError(f"no checkpoint in {where} verifies and loads: {'; '.join(skipped)}")


def newest_first(checkpoints: list[CheckpointInfo]) -> list[CheckpointInfo]:
    return sorted(checkpoints, key=lambda c: c.iteration, reverse=True)


def best_first(checkpoints: list[CheckpointInfo]) -> list[CheckpointInfo]:
    """By score (then iteration), best first; unscored ones after, newest first."""
    scored = sorted((c for c in checkpoints if c.score is not None), key=lambda c: (c.score, c.iteration), reverse=True)
    return scored + newest_first([c for c in checkpoints if c.score is None])


def checked(info: CheckpointInfo, loads: Callable[[CheckpointInfo], None]) -> CheckpointInfo:
    """An explicitly named checkpoint: whole and loadable, or a UserError saying why not."""
    fault = verify(info)
    if fault is not None:
        raise UserError(f"checkpoint {info.path} is not whole: {fault}")
    warn_if_other_ray(info)
    loads(info)
    return info


# ----------------------------------------------------------------------------- writing and retention


class CheckpointManager:
    def __init__(self, directory: Path, keep_last: int, keep_best: bool):
        self.directory = directory
        self.keep_last = keep_last
        self.keep_best = keep_best
        directory.mkdir(parents=True, exist_ok=True)
        for partial in directory.glob(f"{PARTIAL}*"):
            shutil.rmtree(partial, ignore_errors=True)

    def save(self, write: Callable[[str], None], iteration: int, env_steps: int, score: Optional[float], meta: dict[str, Any]) -> Path:
        """Write, record, rename. A failed write (disk full, quota, read-only) removes its partial directory
        and raises; every earlier checkpoint stays as it was."""
        final = self.directory / f"{PREFIX}{iteration:06d}"
        if final.exists():
            return final
        partial = self.directory / f"{PARTIAL}{iteration:06d}"
        shutil.rmtree(partial, ignore_errors=True)
        try:
            write(str(partial.resolve()))
            marker = {"iteration": iteration, "env_steps": env_steps, "score": score, **meta,
                      "versions": library_versions(), "files": inventory(partial)}
            (partial / MARKER).write_text(json.dumps(marker, indent=1))
            os.replace(partial, final)
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            raise
        self._prune()
        return final

    def roll_back_after(self, iteration: int) -> list[Path]:
        """Resuming from `iteration`: newer checkpoints belong to the lost iterations. They move to
        `checkpoints/rolled_back/` (never deleted), so the rerun iterations write their own."""
        moved = []
        for path in sorted(self.directory.glob(f"{PREFIX}*")):
            number = path.name[len(PREFIX):]
            if number.isdigit() and int(number) > iteration:
                target = self.directory / ROLLED_BACK / path.name
                suffix = 1
                while target.exists():
                    suffix += 1
                    target = target.with_name(f"{path.name}.{suffix}")
                target.parent.mkdir(exist_ok=True)
                os.replace(path, target)
                moved.append(target)
        return moved

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


def find_checkpoint(target: Path, which: str = "best", policy: Optional[str] = None) -> CheckpointInfo:
    """A named checkpoint, whole and loadable; or a run directory's best (or latest) checkpoint that
    verifies and loads, newer or better ones that do not skipped and named."""
    if not target.exists():
        raise UserError(f"no such run directory or checkpoint: {target}")

    def loads(info: CheckpointInfo) -> None:
        from rlplatform.adapter.policy import check_loads

        check_loads(info.path, policy)

    if (target / "rllib_checkpoint.json").exists() or target.name.startswith("checkpoint_"):
        return checked(read_checkpoint(target), loads)
    if not (target / CONFIG_FILE).is_file():
        raise UserError(f"not a run directory or checkpoint: {target}")
    checkpoints = list_checkpoints(target / "checkpoints")
    order = best_first(checkpoints) if which == "best" else newest_first(checkpoints)
    return first_usable(order, loads, target / "checkpoints")

"""Experiment tracking in MLflow and/or Weights & Biases, beside TensorBoard (the `tracking:` section).

The driver's RunLogger sends each iteration's metrics (the same stable tags as TensorBoard, against env
steps), and at the start the HParams (`tb_layout.hparams_of`: config and scale) and at the end the
artefacts (resolved config, manifest, final checkpoint path). `export` adds the exported policy to the
same tracked run. A tracker that cannot start or send (server down, refused, no W&B key, package
missing) says so in ONE warning line and is dropped: the run goes on with TensorBoard, never ends for it.

The tracked run's ids are kept in the run directory (tracking.json), so a resume or a restart after a
failed step goes on in the same MLflow / W&B run.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

from rlplatform.config.schema import ExperimentConfig

TRACKING_FILE = "tracking.json"
MLFLOW_BATCH = 1000  # MLflow's limit of metrics per log_batch request
EXTRA_HINT = 'pip install -e ".[tracking]"'


def warn(tracker: str, exc: BaseException, what: str = "is off for this run") -> None:
    """The one line a failing tracker gets; TensorBoard and metrics.jsonl carry on."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if len(text) > 300:
        text = text[:300] + "..."
    print(f"warning: {tracker} tracking {what}: {type(exc).__name__}: {text}; TensorBoard goes on", file=sys.stderr)


def _read_ids(run_dir: Path) -> dict[str, str]:
    try:
        ids = json.loads((run_dir / TRACKING_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return ids if isinstance(ids, dict) else {}


def _write_ids(run_dir: Path, ids: dict[str, str]) -> None:
    (run_dir / TRACKING_FILE).write_text(json.dumps(ids, indent=1) + "\n")


def _finite(values: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in values.items() if math.isfinite(v)}


class MlflowTracker:
    name = "MLflow"

    def __init__(self, run_dir: Path, config: ExperimentConfig, ids: dict[str, str], resume: bool):
        # A server that is down must not hold the run up: no retries with back-off, short timeouts.
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
        from mlflow.entities import Param, RunTag
        from mlflow.tracking import MlflowClient

        from rlplatform.dashboards.tb_layout import hparams_of

        section = config.tracking.mlflow
        if section is None:
            raise ValueError("no tracking.mlflow section")
        self.client = MlflowClient(tracking_uri=section.uri)
        self.run_id = ids.get("mlflow_run_id") if resume else None
        if self.run_id:
            self.client.update_run(self.run_id, status="RUNNING")
            return
        experiment_name = section.experiment or config.name
        experiment = self.client.get_experiment_by_name(experiment_name)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(experiment_name)
        tags = {"rlplatform.run_dir": str(run_dir.resolve()), "rlplatform.experiment": config.name,
                "rlplatform.algorithm": config.algorithm, "rlplatform.env": config.env}
        run = self.client.create_run(experiment_id, run_name=f"{config.name}/{run_dir.name}", tags=tags)
        self.run_id = ids["mlflow_run_id"] = run.info.run_id
        params = [Param(key, str(value)) for key, value in hparams_of(config).items()]
        self.client.log_batch(self.run_id, params=params, tags=[RunTag("rlplatform.seed", str(config.seed))])

    def log(self, values: dict[str, float], step: int, timestamp: float) -> None:
        from mlflow.entities import Metric

        metrics = [Metric(key, value, int(timestamp * 1000), step) for key, value in _finite(values).items()]
        for start in range(0, len(metrics), MLFLOW_BATCH):
            self.client.log_batch(self.run_id, metrics=metrics[start:start + MLFLOW_BATCH])

    def add_artifacts(self, files: list[Path], folder: Optional[str] = None, tags: Optional[dict[str, str]] = None) -> None:
        for name, value in (tags or {}).items():
            self.client.set_tag(self.run_id, name, value)
        for file in files:
            if file.is_dir():
                self.client.log_artifacts(self.run_id, str(file), artifact_path=folder)
            elif file.is_file():
                self.client.log_artifact(self.run_id, str(file), artifact_path=folder)

    def end(self, failed: bool) -> None:
        self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")


class WandbTracker:
    name = "W&B"

    def __init__(self, run_dir: Path, config: ExperimentConfig, ids: dict[str, str], resume: bool):
        os.environ.setdefault("WANDB_SILENT", "true")
        import wandb

        from rlplatform.dashboards.tb_layout import hparams_of

        section = config.tracking.wandb
        if section is None:
            raise ValueError("no tracking.wandb section")
        if section.mode == "online" and not os.environ.get("WANDB_API_KEY") and not _wandb_logged_in():
            raise RuntimeError("no W&B API key (`wandb login` or WANDB_API_KEY)")  # never a login prompt mid-run
        run_id = (ids.get("wandb_run_id") if resume else None) or secrets.token_hex(4)  # 8 of [0-9a-f], as W&B's ids
        self.run_dir = run_dir
        self.run = wandb.init(
            project=section.project, entity=section.entity, mode=section.mode, dir=str(run_dir), id=run_id,
            resume="allow", name=f"{config.name}/{run_dir.name}", config=hparams_of(config),
            tags=[config.algorithm, config.env.rpartition(":")[2][:64]],
            settings=wandb.Settings(console="off", init_timeout=60),
        )
        ids["wandb_run_id"] = run_id
        self.run.define_metric("env_steps")
        self.run.define_metric("*", step_metric="env_steps")  # our x axis, as in TensorBoard

    def log(self, values: dict[str, float], step: int, timestamp: float) -> None:
        self.run.log({**_finite(values), "env_steps": step})

    def add_artifacts(self, files: list[Path], folder: Optional[str] = None, tags: Optional[dict[str, str]] = None) -> None:
        for name, value in (tags or {}).items():
            self.run.summary[name] = value
        for file in files:
            for path in sorted(file.rglob("*")) if file.is_dir() else [file]:
                if path.is_file():  # a directory's files keep its name as their folder
                    self.run.save(str(path.resolve()), base_path=str(file.parent.resolve()), policy="now")

    def end(self, failed: bool) -> None:
        self.run.finish(exit_code=1 if failed else 0)


def _wandb_logged_in() -> bool:
    """A key stored by `wandb login` (netrc), without ever prompting."""
    import netrc

    try:
        return any("wandb" in host for host in netrc.netrc().hosts)
    except (OSError, netrc.NetrcParseError):
        return False


TRACKERS: dict[str, type[MlflowTracker] | type[WandbTracker]] = {"mlflow": MlflowTracker, "wandb": WandbTracker}
PACKAGES = {"mlflow": "mlflow", "wandb": "wandb"}


class Tracking:
    """The configured trackers of one run; any failure drops that tracker with one warning line."""

    def __init__(self, run_dir: Path, config: ExperimentConfig, resume: bool):
        self.run_dir = run_dir
        self.trackers: list[Any] = []
        ids = _read_ids(run_dir)
        for key, cls in TRACKERS.items():
            if getattr(config.tracking, key) is None:
                continue
            started = time.monotonic()
            try:
                __import__(PACKAGES[key])
            except ImportError as exc:
                warn(cls.name, ImportError(f"{exc} ({EXTRA_HINT})"))
                continue
            try:
                self.trackers.append(cls(run_dir, config, ids, resume))
            except Exception as exc:  # down, refused, bad URI, no key: whatever it is, the run goes on
                warn(cls.name, exc)
            else:
                self._note_slow(cls.name, started)
        if self.trackers:
            _write_ids(run_dir, ids)

    @staticmethod
    def _note_slow(name: str, started: float) -> None:
        elapsed = time.monotonic() - started
        if elapsed > 30:
            print(f"note: {name} tracking took {elapsed:.0f} s to start", file=sys.stderr)

    def _each(self, what: str, call: Callable[[Any], None]) -> None:
        for tracker in list(self.trackers):
            try:
                call(tracker)
            except Exception as exc:
                warn(tracker.name, exc, f"stopped ({what} failed)")
                self.trackers.remove(tracker)

    def log(self, values: dict[str, float], step: int, timestamp: Optional[float] = None) -> None:
        self._each("sending metrics", lambda t: t.log(values, step, timestamp or time.time()))

    def add_artifacts(self, files: list[Path], folder: Optional[str] = None, tags: Optional[dict[str, str]] = None) -> None:
        self._each("uploading artefacts", lambda t: t.add_artifacts(files, folder, tags))

    def end(self, failed: bool = False) -> None:
        self._each("ending the run", lambda t: t.end(failed))
        self.trackers = []


def run_artifacts(run_dir: Path) -> list[Path]:
    """The run's artefacts for the tracker: the resolved config and the manifest."""
    from rlplatform.run.run_dir import CONFIG_FILE, MANIFEST_FILE

    return [run_dir / CONFIG_FILE, run_dir / MANIFEST_FILE]


def log_export(checkpoint: Path, config: ExperimentConfig, out_dir: Path) -> None:
    """An exported policy joins the tracked run its checkpoint came from (where that run was tracked)."""
    run_dir = checkpoint.resolve().parent.parent  # <run_dir>/checkpoints/checkpoint_NNNNNN
    if not (config.tracking.mlflow or config.tracking.wandb) or not (run_dir / TRACKING_FILE).is_file():
        return
    tracking = Tracking(run_dir, config, resume=True)
    tracking.add_artifacts([out_dir], folder="export", tags={"rlplatform.export": str(out_dir.resolve())})
    tracking.end()

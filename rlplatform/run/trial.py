"""One trial of a sweep: the experiment with the trial's parameters applied through the `--set` machinery, run
as `train` runs it (`run.loop.RunSession`), one Tune step per iteration, in a run directory of its own:
`runs/<experiment>/<sweep>/<trial>/` holds config.yaml, manifest.json, TensorBoard events, metrics.jsonl and
checkpoints/, so `evaluate`, `report` and `dashboard` take a trial as any run.

The algorithm lives in the trial's actor, which Tune places in bundle 0 of the trial's placement group; the env
runners and learners it starts land in the other bundles. Tune's checkpoints are pointers to ours (one copy of
the weights): resuming this trial takes the newest checkpoint of its own run directory that verifies (a stop
writes one), a PBT exploit takes the other trial's checkpoint it points to.
"""

from __future__ import annotations

import copy
import datetime as dt
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from ray import tune

from rlplatform.config.files import apply_override, load_yaml_text
from rlplatform.config.schema import ExperimentConfig, validate
from rlplatform.config.sizing import Resources
from rlplatform.errors import TrainingFailed, UserError

if TYPE_CHECKING:
    from rlplatform.run.checkpoints import CheckpointInfo
    from rlplatform.run.loop import RunSession

CONFIG_HISTORY_FILE = "config_history.jsonl"  # one line per start of the trial: its parameters, where it resumed


def trial_dirname(trial_id: str) -> str:
    """`trial_00003` for Tune's `<sweep id>_00003`: the run directory's name under the sweep's."""
    return f"trial_{trial_id.rpartition('_')[2]}"


def tune_trial_dirname(trial: Any) -> str:  # Tune's trial_dirname_creator
    return trial_dirname(trial.trial_id)


def decode_params(params: dict[str, Any], yaml_keys: frozenset[str] | set[str]) -> dict[str, Any]:
    """Tune's values for the dotted keys; values of `yaml_keys` travel as YAML text (`[64, 64]`: searchers such as
    Optuna take only scalar choices) and are read as `--set` reads its values."""
    return {key: load_yaml_text(value) if key in yaml_keys and isinstance(value, str) else value
            for key, value in params.items()}


def trial_config(base: dict[str, Any], params: dict[str, Any], source: str = "trial") -> ExperimentConfig:
    """The experiment of one trial: `base` (the sweep's sized experiment) with `params` applied as `--set` would."""
    data = copy.deepcopy(base)
    data["search"] = None  # a trial is a plain run of the experiment
    for key, value in params.items():
        apply_override(data, key.split("."), value)
    return validate(data, source=source)


class RunTrial(tune.Trainable):
    """A Tune class trainable; `setup` gets the sweep's facts through `tune.with_parameters`."""

    def setup(self, config: dict[str, Any], base: Optional[dict[str, Any]] = None, sweep_dir: str = "",
              resources: Optional[dict[str, Any]] = None, yaml_keys: frozenset[str] = frozenset(),
              command: Optional[dict[str, Any]] = None) -> None:
        from rlplatform.run import run_dir as rundir
        from rlplatform.run.plan import Plan

        if base is None or resources is None:
            raise TypeError("RunTrial takes the sweep's base experiment and resources (tune.with_parameters)")
        self.params = decode_params(dict(config), yaml_keys)
        experiment = trial_config(base, self.params)
        self.run_dir = Path(sweep_dir) / trial_dirname(self.trial_id)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._lock = rundir.WriterLock(self.run_dir)
        self.plan = Plan(config=experiment, resources=Resources(**resources), bundles=[], run_dir=self.run_dir,
                         algorithm_in_driver=True)  # this actor is the algorithm's host
        self._resume_from: Optional[CheckpointInfo] = None
        self._session: Optional[RunSession] = None
        self._saved_iteration: Optional[int] = None
        self._command = command or {}  # the driver's command line, directory and checkout, for the manifest

    # -- Tune's hooks ---------------------------------------------------------------------------------------

    def step(self) -> dict[str, Any]:
        from rlplatform.run.algorithm_host import HostFailed

        if self._session is None:
            self._start()
            finished = self._finished_before_it_was_stopped()
            if finished is not None:
                return finished
        try:
            metrics = self._live_session().iterate()
        except HostFailed as exc:  # Tune's FailureConfig (max_failures) restarts the trial from its checkpoint
            raise TrainingFailed(str(exc)) from None
        result: dict[str, Any] = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        result["training_iteration"] = metrics["iteration"]  # ours, restored with the checkpoint, is the one to count
        reason = self._live_session().stop_reason(metrics)
        if reason is not None:
            result.update(done=True, stop_reason=reason)
        return result

    def save_checkpoint(self, checkpoint_dir: str) -> dict[str, str]:
        session = self._live_session()
        metrics = session.last
        if metrics is None:  # restored and not trained since (it had already met its stop): the checkpoint it came from
            if self._resume_from is None:
                raise TrainingFailed("no iteration trained and no checkpoint to point Tune to")
            return {"run_dir": str(self.run_dir), "checkpoint": str(self._resume_from.path)}
        path = session.save(metrics)
        self._saved_iteration = metrics["iteration"]
        return {"run_dir": str(self.run_dir), "checkpoint": str(path)}

    def load_checkpoint(self, checkpoint: dict[str, str]) -> None:
        from rlplatform.adapter.policy import check_loads
        from rlplatform.run.checkpoints import checked, read_checkpoint
        from rlplatform.run.plan import checkpoint_to_resume

        if Path(checkpoint["run_dir"]) == self.run_dir:
            self._resume_from = checkpoint_to_resume(self.run_dir)  # the newest: a stop may have written a later one
        elif Path(checkpoint["checkpoint"]).is_dir():  # PBT: another trial's weights, this trial's (perturbed) values
            self._resume_from = checked(read_checkpoint(Path(checkpoint["checkpoint"])), lambda info: check_loads(info.path))
        else:  # that trial has since pruned it (checkpoint.keep_last): its newest that verifies
            self._resume_from = checkpoint_to_resume(Path(checkpoint["run_dir"]))

    def cleanup(self) -> None:
        """Stopped (finished, by the scheduler, Ctrl-C, a PBT exploit): checkpoint the last iteration if it is not."""
        try:
            if self._session is not None:
                last = self._session.last
                if last is not None and last["iteration"] != self._saved_iteration:
                    self._session.save(last)
        finally:
            if self._session is not None:
                self._session.close()
            self._lock.release()

    # -- ours -----------------------------------------------------------------------------------------------

    def _live_session(self) -> RunSession:
        if self._session is None:
            raise TrainingFailed("the trial's run has not started")
        return self._session

    def _finished_before_it_was_stopped(self) -> Optional[dict[str, Any]]:
        """A trial stopped (Ctrl-C) after the iteration that met its `stop`, restored there: done, as it was."""
        from rlplatform.run.loop import stop_reason
        from rlplatform.run.metrics import METRICS_FILE

        if self._resume_from is None or not (self.run_dir / METRICS_FILE).is_file():
            return None
        rows = [json.loads(line) for line in (self.run_dir / METRICS_FILE).read_text().splitlines() if line.strip()]
        metrics = next((r for r in reversed(rows) if r.get("iteration") == self._resume_from.iteration), None)
        if metrics is None:
            return None
        reason = stop_reason(self.plan.config, metrics, window_full=False, wall_s=metrics.get("wall_time_s") or 0.0)
        if not reason:
            return None
        result = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        return {**result, "training_iteration": metrics["iteration"], "done": True, "stop_reason": reason}

    def _start(self) -> None:
        from rlplatform.adapter import speedups
        from rlplatform.run import run_dir as rundir
        from rlplatform.run.loop import RunSession

        if self._resume_from is None:  # restarted without a Tune checkpoint: its own newest, if any
            self._resume_from = _own_newest(self.run_dir)
        config = self.plan.config
        rundir.write_config(self.run_dir, config)
        rundir.write_manifest(self.run_dir, config, {
            **self._command, "sweep": str(self.run_dir.parent), "trial_id": self.trial_id, "params": self.params,
            "resources": vars(self.plan.resources), "bundles": self.trial_resources.bundles if self.trial_resources else None,
            "speedups": speedups.manifest_record(config.speedups, config, True),
            "resumed_from": str(self._resume_from.path) if self._resume_from else None,
        })
        _append_history(self.run_dir, self.params, self._resume_from)
        self._session = RunSession(self.plan, time.time(), self._resume_from, hparams=self.params)
        if self._resume_from is not None:
            self._saved_iteration = self._resume_from.iteration


def _own_newest(run_dir: Path) -> Optional[CheckpointInfo]:
    from rlplatform.run.checkpoints import list_checkpoints
    from rlplatform.run.plan import checkpoint_to_resume

    if not list_checkpoints(run_dir / "checkpoints"):
        return None
    try:
        return checkpoint_to_resume(run_dir)
    except UserError:
        return None


def _append_history(run_dir: Path, params: dict[str, Any], resume_from: Optional[CheckpointInfo]) -> None:
    record = {"at": dt.datetime.now().astimezone().isoformat(timespec="seconds"), "params": params,
              "from_iteration": resume_from.iteration if resume_from else 0,
              "from_checkpoint": str(resume_from.path) if resume_from else None}
    with (run_dir / CONFIG_HISTORY_FILE).open("a") as f:
        f.write(json.dumps(record, default=str) + "\n")

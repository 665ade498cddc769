"""A sweep on Ray Tune: the experiment's `search:` section turned into Tune's search space, searcher and scheduler
(Tune's own: random/grid variants, OptunaSearch, ASHAScheduler, PopulationBasedTraining), one `run/trial.py`
trial per sample, placed by Tune in a placement group of the experiment's own bundles.

Before Ray starts, `plan_sweep` checks every searched key by applying its values to the experiment as `--set`
would, sizes one trial and says how many trials the cluster holds at once. The sweep directory
`runs/<experiment>/<timestamp>/` is Tune's experiment directory; it also gets `search.yaml` (the resolved
experiment with its search) and the results table (`results.csv`, `results.json`).
"""

from __future__ import annotations

import csv
import importlib.util
import json
import math
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from ray import tune
from rich.markup import escape

from rlplatform import console
from rlplatform.config.experiment import ResolvedExperiment
from rlplatform.config.files import to_yaml
from rlplatform.config.schema import ExperimentConfig
from rlplatform.config.search import SearchSection
from rlplatform.config.sizing import Resources
from rlplatform.errors import UserError
from rlplatform.run import run_dir as rundir
from rlplatform.run.plan import Plan, make_plan

SEARCH_FILE = "search.yaml"
RESULTS_CSV = "results.csv"
RESULTS_JSON = "results.json"


@dataclass
class SweepPlan:
    plan: Plan  # one trial's: the sized experiment, its bundles (pre-flight checked)
    search: SearchSection
    fit_at_once: int
    concurrent: int
    yaml_keys: frozenset[str]  # searched keys whose values travel as YAML text (lists, mappings)


def plan_sweep(resolved: ResolvedExperiment, resources: Resources, samples: Optional[int] = None,
               resize: bool = True) -> SweepPlan:
    """Everything that can fail on bad input, before Ray starts. `resize`: False for a resumed sweep, which
    keeps the size it started with."""
    from rlplatform.adapter import algorithm_config
    from rlplatform.run.trial import trial_config

    source = str(resolved.source)
    search = resolved.config.search
    if search is None:
        raise UserError(f"{source}: no search section; add one (docs/tuning.md) or run it with `train`")
    if samples is not None:
        if samples < 1:
            raise UserError(f"--samples {samples}: must be at least 1")
        search = search.model_copy(update={"samples": samples})
    # Trials go where Tune places them: nothing is pinned to the driver's node (joined_cluster=False).
    if resolved.config.record is not None:
        raise UserError(f"{source}: record: a sweep's trials do not record their episodes; record one run with `train`")
    plan = make_plan(resolved, resources, joined_cluster=False, resize=resize)
    plan.config = plan.config.model_copy(update={"search": search})
    base = plan.config.model_dump()
    for key in _all_distributions(search):
        if key == "init_from" or key.startswith("data.") or key == "data":
            raise UserError(f"{source}: search.space.{key}: the data and init_from are resolved and checked once for the "
                            "whole sweep; not searched")
    for key, dist in _all_distributions(search).items():
        for value in _representatives(dist):
            try:
                config = trial_config(base, {key: value}, source=f"{source}: search.space.{key}")
                algorithm_config.check(config)
            except UserError as exc:
                message = str(exc)
                prefix = f"{source}: search.space.{key}"
                if message.startswith(prefix):
                    raise
                if message.startswith(f"{key} = "):  # the type check names the key and value itself
                    message = message.split(": ", 1)[1]
                (name, _), = dist.items()
                if name != "choice" and isinstance(value, float) and "an integer" in message:
                    message += f"; {name} draws floats, use randint for an integer"
                raise UserError(f"{prefix} = {value!r}: {message}") from None
    if search.searcher == "optuna" and importlib.util.find_spec("optuna") is None:
        raise UserError(f'{source}: search.searcher optuna needs Optuna: pip install -e ".[tune]"')
    fit = trials_that_fit(plan.bundles, resources)
    concurrent = fit if search.concurrent == "auto" else search.concurrent
    yaml_keys = frozenset(k for k, d in _all_distributions(search).items()
                          if "choice" in d and any(isinstance(v, (list, dict)) for v in d["choice"]))
    return SweepPlan(plan=plan, search=search, fit_at_once=fit, concurrent=max(1, concurrent), yaml_keys=yaml_keys)


def _all_distributions(search: SearchSection) -> dict[str, dict[str, Any]]:
    mutations = search.pbt.mutations if search.scheduler == "pbt" else {}
    return {**mutations, **search.space}


def _representatives(dist: dict[str, Any]) -> list[Any]:
    """Values that stand for the whole distribution when checking a key: every choice, both ends of a range."""
    (name, args), = dist.items()
    if name == "choice":
        return list(args)
    # uniform and loguniform draw floats whatever their bounds are written as
    return [args[0], args[1] - 1] if name == "randint" else [float(a) for a in args]


def trials_that_fit(bundles: list[dict[str, float]], resources: Resources) -> int:
    """How many trials' placement groups the cluster holds at once: bundles placed first-fit on the nodes' CPUs and
    GPUs, trial after trial, until one does not fit (an estimate: Ray's placement decides)."""
    free = [{"CPU": n.get("CPU", 0.0), "GPU": n.get("GPU", 0.0)} for n in resources.nodes] or \
        [{"CPU": resources.cpus, "GPU": resources.gpus}]
    if not any(b.get("CPU", 0) or b.get("GPU", 0) for b in bundles):
        return 1_000
    count = 0
    while count < 1_000:
        trial_free = [dict(n) for n in free]
        for bundle in bundles:
            node = next((n for n in trial_free if all(n[k] + 1e-9 >= bundle.get(k, 0.0) for k in ("CPU", "GPU"))), None)
            if node is None:
                return count
            for k in ("CPU", "GPU"):
                node[k] -= bundle.get(k, 0.0)
        free = trial_free
        count += 1
    return count


# ----------------------------------------------------------------------------- Tune's objects


def tune_domain(dist: dict[str, Any], as_yaml: bool) -> Any:

    (name, args), = dist.items()
    if name == "choice":
        return tune.choice([to_yaml_text(v) for v in args] if as_yaml else list(args))
    return getattr(tune, name)(*args)


def to_yaml_text(value: Any) -> str:
    import yaml

    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()


def param_space(sweep_plan: SweepPlan) -> dict[str, Any]:

    space = {}
    for key, dist in {**(sweep_plan.search.pbt.mutations if sweep_plan.search.scheduler == "pbt" else {}), **sweep_plan.search.space}.items():
        as_yaml = key in sweep_plan.yaml_keys
        if sweep_plan.search.searcher == "grid":
            values = dist["choice"]
            space[key] = tune.grid_search([to_yaml_text(v) for v in values] if as_yaml else list(values))
        else:
            space[key] = tune_domain(dist, as_yaml)
    return space


def scheduler(sweep_plan: SweepPlan) -> Any:
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler, PopulationBasedTraining

    search, config = sweep_plan.search, sweep_plan.plan.config
    if search.scheduler == "asha":
        max_t = search.asha.max_t or config.stop.iterations or 1000
        return ASHAScheduler(time_attr="training_iteration", max_t=max_t, grace_period=search.asha.grace_period,
                             reduction_factor=search.asha.reduction_factor)
    if search.scheduler == "pbt":
        pbt = search.pbt
        mutations = {key: tune_domain(dist, key in sweep_plan.yaml_keys) for key, dist in pbt.mutations.items()}
        return PopulationBasedTraining(time_attr="training_iteration", perturbation_interval=pbt.interval,
                                       hyperparam_mutations=mutations, quantile_fraction=pbt.quantile_fraction,
                                       resample_probability=pbt.resample_probability, synch=pbt.synchronous)
    return FIFOScheduler()


def searcher(sweep_plan: SweepPlan) -> Any:
    if sweep_plan.search.searcher != "optuna":  # random samples and grid points, seeded: a sweep draws the same trials again
        from ray.tune.search import BasicVariantGenerator

        return BasicVariantGenerator(random_state=sweep_plan.plan.config.seed)
    from ray.tune.search.optuna import OptunaSearch

    return OptunaSearch(seed=sweep_plan.plan.config.seed)


def trainable(sweep_plan: SweepPlan, sweep_dir: Path) -> Any:
    """`run/trial.py`'s RunTrial with the sweep's facts and a placement group of the experiment's bundles."""

    from rlplatform.run.trial import RunTrial

    with_facts = tune.with_parameters(RunTrial, base=sweep_plan.plan.config.model_dump(), sweep_dir=str(sweep_dir),
                                      resources=vars(sweep_plan.plan.resources), yaml_keys=sweep_plan.yaml_keys,
                                      command=rundir.command_facts())
    return tune.with_resources(with_facts, TrialResources(sweep_plan.plan.config.model_dump(), sweep_plan.yaml_keys))


class TrialResources:
    """A trial's placement group: the bundles RLlib asks for with the trial's own parameters (a searched
    `scale.env_runners` changes them), with the experiment's `scale.placement`."""

    def __init__(self, base: dict[str, Any], yaml_keys: frozenset[str]):
        self.base, self.yaml_keys = base, yaml_keys

    def __call__(self, params: dict[str, Any]) -> Any:

        from rlplatform.adapter import algorithm_config
        from rlplatform.run.trial import decode_params, trial_config

        config = trial_config(self.base, decode_params(params, self.yaml_keys))
        bundles = algorithm_config.resource_bundles(algorithm_config.build_algorithm_config(config))
        return tune.PlacementGroupFactory(bundles, strategy=config.scale.placement.upper())


def run_config(sweep_plan: SweepPlan, sweep_dir: Path) -> Any:

    config = sweep_plan.plan.config
    return tune.RunConfig(
        name=sweep_dir.name, storage_path=str(sweep_dir.parent.resolve()), verbose=0,
        checkpoint_config=tune.CheckpointConfig(checkpoint_frequency=config.checkpoint.every, checkpoint_at_end=True),
        failure_config=tune.FailureConfig(max_failures=config.max_failures),
        callbacks=[SweepConsole(sweep_plan.search.metric, sweep_plan.search.scheduler)],
    )


def tune_config(sweep_plan: SweepPlan) -> Any:

    from rlplatform.run.trial import tune_trial_dirname

    search = sweep_plan.search
    return tune.TuneConfig(metric=search.metric, mode=search.mode, num_samples=search.samples,
                           max_concurrent_trials=sweep_plan.concurrent, scheduler=scheduler(sweep_plan), search_alg=searcher(sweep_plan),
                           reuse_actors=False, trial_dirname_creator=tune_trial_dirname)


def quiet_tune() -> None:
    """Our console lines and run directories instead of Tune's progress table and its own logger files; the
    metric is checked by our schema, and iterations before the first finished episode have no return yet."""
    os.environ.setdefault("TUNE_DISABLE_AUTO_CALLBACK_LOGGERS", "1")
    os.environ.setdefault("TUNE_DISABLE_STRICT_METRIC_CHECKING", "1")
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")
    os.environ.setdefault("TUNE_MAX_PENDING_TRIALS_PG", "1")
    # A trial's Algorithm cannot take new values in place (RLlib's Algorithm has no reset_config): PBT restarts it.
    warnings.filterwarnings("ignore", message="Consider boosting PBT performance")


# ----------------------------------------------------------------------------- console and results


class SweepConsole(tune.Callback):
    """One line per trial that finishes, is stopped early by the scheduler or fails."""

    def __init__(self, metric: str, scheduler_name: str):
        self.metric, self.scheduler_name = metric, scheduler_name

    def on_trial_complete(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        self._say(trial, stop_reason(trial, self.scheduler_name, status="TERMINATED"))  # Tune sets it after this

    def on_trial_error(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        self._say(trial, stop_reason(trial, self.scheduler_name, status="ERROR"))

    def _say(self, trial: Any, reason: str) -> None:
        from rlplatform.run.trial import trial_dirname

        result = trial.last_result or {}
        params = "  ".join(f"{_short_key(k)}={_fmt_param(v)}" for k, v in trial.config.items())
        console.stdout.print(
            f"[bold]{trial_dirname(trial.trial_id)}[/]  it {result.get('training_iteration', 0):>4}  "
            f"steps {int(result.get('env_steps', 0)):>9,}  {self.metric} [cyan]{console.fmt(result.get(self.metric), '.2f')}[/]  "
            f"{escape(params)}  [dim]{escape(reason)}[/]")


def stop_reason(trial: Any, scheduler_name: str, status: Optional[str] = None) -> str:
    """Why a trial stopped, from Tune's record of it: its own stop criterion, the scheduler, an error, or not yet."""
    result, status = trial.last_result or {}, status or trial.status
    if status == "ERROR":
        return f"error: {_error_line(trial)}"
    if status != "TERMINATED":
        return "interrupted (resume with tune --resume)"
    return result.get("stop_reason") or f"stopped early by {scheduler_name.upper()}"


def _error_line(trial: Any) -> str:
    text = ""
    if trial.error_file and Path(trial.error_file).is_file():
        text = Path(trial.error_file).read_text()
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1][:300] if lines else "the trial failed"


def _short_key(key: str) -> str:
    return key.rpartition(".")[2]


def _fmt_param(value: Any) -> str:
    return "-" if value is None else f"{value:.3g}" if isinstance(value, float) else str(value)


def results_table(sweep_dir: Path, search: SearchSection, yaml_keys: frozenset[str]) -> list[dict[str, Any]]:
    """One row per trial, best first: its run directory, parameters, the metric (its last value), env steps,
    wall time and why it stopped, from the sweep's experiment state (Tune's ExperimentAnalysis)."""
    from rlplatform.run.trial import decode_params, trial_dirname

    rows = []
    for trial in tune.ExperimentAnalysis(str(sweep_dir)).trials:
        metrics = trial.last_result or {}
        name = trial_dirname(trial.trial_id)
        rows.append({"trial": name, "run_dir": str(sweep_dir / name),
                     "params": decode_params(dict(trial.config or {}), yaml_keys),
                     search.metric: metrics.get(search.metric), "iterations": metrics.get("training_iteration"),
                     "env_steps": metrics.get("env_steps"), "wall_time_s": metrics.get("wall_time_s"),
                     "stopped": stop_reason(trial, search.scheduler),
                     "error_file": trial.error_file if trial.status == "ERROR" else None})
    sign = 1 if search.mode == "max" else -1
    return sorted(rows, key=lambda r: (r[search.metric] is None or math.isnan(r[search.metric]),
                                       -sign * (r[search.metric] or 0.0), r["trial"]))


def write_results(rows: list[dict[str, Any]], sweep_dir: Path, metric: str) -> None:
    (sweep_dir / RESULTS_JSON).write_text(json.dumps(rows, indent=1, default=str))
    keys = sorted({k for r in rows for k in r["params"]})
    columns = ["trial", *keys, metric, "iterations", "env_steps", "wall_time_s", "stopped", "run_dir"]
    with (sweep_dir / RESULTS_CSV).open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(columns)
        for r in rows:
            writer.writerow([r["trial"], *[json.dumps(r["params"].get(k)) for k in keys], r[metric], r["iterations"],
                             r["env_steps"], r["wall_time_s"], r["stopped"], r["run_dir"]])


def print_results(rows: list[dict[str, Any]], sweep_dir: Path, metric: str) -> None:
    from rich.table import Table

    console.stdout.rule("sweep done")
    keys = sorted({k for r in rows for k in r["params"]})
    table = Table(show_edge=False, pad_edge=False, box=None)
    for column in ["trial", *[_short_key(k) for k in keys], metric, "iters", "env steps", "wall s", "stopped"]:
        table.add_column(column, justify="right" if column not in ("trial", "stopped") else "left")
    for r in rows:
        table.add_row(r["trial"], *[_fmt_param(r["params"].get(k)) for k in keys], console.fmt(r[metric], ".2f"),
                      str(r["iterations"] or "-"), f"{int(r['env_steps'] or 0):,}", console.fmt(r["wall_time_s"], ".0f"),
                      escape(r["stopped"]))
    from rich.console import Console
    from rich.measure import Measurement

    width = Measurement.get(console.stdout, console.stdout.options.update_width(1_000), table).maximum
    # As wide as the table: a row per trial, never wrapped (a piped console is 80 columns).
    Console(width=max(width, console.stdout.width), highlight=False, soft_wrap=True).print(table)
    best = next((r for r in rows if r[metric] is not None), None)
    if best is not None:
        console.say(f"best trial: {best['trial']} ({metric} {best[metric]:.2f}): {best['run_dir']}")
        console.say(f"evaluate it: python -m rlplatform evaluate {best['run_dir']}")
    console.say(f"results: {sweep_dir / RESULTS_CSV}, {sweep_dir / RESULTS_JSON}")
    console.say(f"TensorBoard (HParams compares the trials): tensorboard --logdir {sweep_dir}")


def write_search_config(sweep_dir: Path, config: ExperimentConfig) -> None:
    (sweep_dir / SEARCH_FILE).write_text(to_yaml(config))

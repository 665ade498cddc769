"""`rlplatform tune EXPERIMENT.yaml`: search the experiment's hyper-parameters with Ray Tune (its `search:` section).

Read top to bottom: resolve the experiment as `train` does (file < profile < --set), plan the sweep before Ray
starts (`run.sweep.plan_sweep`: every searched key checked, one trial sized, how many fit at once), make the
sweep directory, start Ray, run Tune's Tuner, print and write the results table. `--resume SWEEP_DIR` continues an
interrupted sweep with Tune's restore; finished trials are kept.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlplatform import console
from rlplatform.config.experiment import ResolvedExperiment, resolve_experiment
from rlplatform.config.files import read_yaml, to_yaml
from rlplatform.config.schema import validate
from rlplatform.errors import TrainingFailed, UserError
from rlplatform.infra import local_ray
from rlplatform.run import run_dir as rundir

if TYPE_CHECKING:
    from rlplatform.config.sizing import Resources
    from rlplatform.run import sweep


def add_parser(subparsers: Any) -> None:  # argparse's sub-parsers action
    p = subparsers.add_parser("tune", help="search hyper-parameters with Ray Tune (the experiment's search: section)")
    p.add_argument("experiment", nargs="?", type=Path,
                   help="experiment YAML with a search: section, e.g. experiments/cartpole_ppo_tune.yaml (default: "
                        "experiments/cartpole_ppo.yaml, as for train, which has none and is refused)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override any key, e.g. --set search.samples=4 or --set training.gamma=0.99")
    p.add_argument("--profile", help="scale/hardware profile of each trial: auto, laptop, ... or a YAML path (default: the experiment's, else auto)")
    p.add_argument("--address", help="run on an existing Ray cluster (auto or HOST:PORT); default: a private local instance")
    p.add_argument("--samples", type=int, metavar="N", help="trials to run (search.samples)")
    p.add_argument("--resume", type=Path, metavar="SWEEP_DIR",
                   help="continue an interrupted sweep as it was started (no experiment, --profile, --set or "
                        "--samples); finished trials are kept")
    p.add_argument("--runs-dir", type=Path, default=Path("runs"), help="root of run directories (default: runs)")
    p.add_argument("--print-config", action="store_true", help="print the resolved experiment and search, and exit")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rlplatform.run import sweep

    resolved = _resolve(args)
    if not args.resume:
        rundir.check_writable(args.runs_dir)
    started_ray = False
    try:
        resources = local_ray.connect(args.address) if args.address else _resources_here()
        sweep_plan = sweep.plan_sweep(resolved, resources, args.samples, resize=not args.resume)
        if args.print_config:
            print(to_yaml(sweep_plan.plan.config), end="")
            return 0
        sweep_dir = args.resume.resolve() if args.resume else rundir.new_run_dir(args.runs_dir, sweep_plan.plan.config.name).resolve()
        sweep.write_search_config(sweep_dir, sweep_plan.plan.config)
        _say_plan(sweep_plan, sweep_dir)
        if not args.address and not _ray_running():
            local_ray.connect(None, resources, speedups=sweep_plan.plan.config.speedups)
            started_ray = True
        return _fit(sweep_plan, sweep_dir, resumed=bool(args.resume))
    finally:
        if started_ray or args.address:
            local_ray.shutdown()


def _fit(sweep_plan: sweep.SweepPlan, sweep_dir: Path, resumed: bool) -> int:
    from ray import tune

    from rlplatform.run import sweep

    sweep.quiet_tune()
    started = time.time()
    trainable = sweep.trainable(sweep_plan, sweep_dir)
    if resumed:
        tuner = tune.Tuner.restore(str(sweep_dir), trainable=trainable, resume_unfinished=True, resume_errored=True)
    else:
        tuner = tune.Tuner(trainable, param_space=sweep.param_space(sweep_plan), tune_config=sweep.tune_config(sweep_plan),
                           run_config=sweep.run_config(sweep_plan, sweep_dir))
    tuner.fit()
    rows = sweep.results_table(sweep_dir, sweep_plan.search, sweep_plan.yaml_keys)
    sweep.write_results(rows, sweep_dir, sweep_plan.search.metric)
    sweep.print_results(rows, sweep_dir, sweep_plan.search.metric)
    unfinished = [r for r in rows if r["stopped"].startswith("interrupted")]
    failed = [r for r in rows if r["error_file"] or r["stopped"].startswith("error")]
    finished = len(rows) - len(unfinished) - len(failed)
    console.say(f"sweep of {len(rows)} trial(s) took {time.time() - started:.0f} s")
    if unfinished:
        console.say(f"interrupted with {len(unfinished)} trial(s) unfinished; continue with: "
                     f"python -m rlplatform tune --resume {sweep_dir}")
    if failed and not finished:  # nothing to compare: the sweep failed (exit 1), the errors stay in the trials
        raise TrainingFailed(f"no trial of the sweep finished: {len(failed)} of {len(rows)} trial(s) failed; "
                             f"their errors: {_error_files(failed, sweep_dir)}")
    if failed:
        console.say(f"{len(failed)} of {len(rows)} trial(s) failed; their errors: {_error_files(failed, sweep_dir)}")
    return 0


def _error_files(failed: list[dict], sweep_dir: Path) -> str:
    files = [r["error_file"] or str(Path(r["run_dir"]) / "error.txt") for r in failed]
    if len(files) > 3:  # one line: the common pattern, not every path
        return f"{sweep_dir}/trial_*/error.txt"
    return ", ".join(files)


def _say_plan(sweep_plan: sweep.SweepPlan, sweep_dir: Path) -> None:
    config, search = sweep_plan.plan.config, sweep_plan.search
    bundles = " + ".join(", ".join(f"{v:g} {k}" for k, v in b.items()) for b in sweep_plan.plan.bundles)
    console.stdout.print(
        f"[bold]rlplatform tune[/] {config.algorithm} on {config.env}: {search.samples} sample(s), "
        f"searcher {search.searcher}, scheduler {search.scheduler}, {search.mode} {search.metric}")
    console.say(f"each trial: {config.scale.env_runners} env runner(s), {config.scale.learners} remote learner(s); "
                 f"placement group [{bundles}]; the cluster ({sweep_plan.plan.resources.describe()}) holds {sweep_plan.fit_at_once} "
                 f"trial(s) at once; running {sweep_plan.concurrent} at once")
    console.say(f"sweep directory: {sweep_dir}")


def _resources_here() -> Resources:
    """A Ray instance this process already runs (a notebook, a test) is used as it is; else this machine's."""
    return local_ray.cluster_resources() if _ray_running() else local_ray.local_resources()


def _ray_running() -> bool:
    import sys

    return "ray" in sys.modules and sys.modules["ray"].is_initialized()


def _resolve(args: argparse.Namespace) -> ResolvedExperiment:
    if not args.resume:
        return resolve_experiment(args.experiment, args.overrides, args.profile)
    if args.experiment is not None or args.profile is not None or args.overrides or args.samples is not None:
        # Unlike `train --resume --set`: Tune restores the searcher, the scheduler and every trial's state as they were,
        # so a changed config would reach only the trials still to run, and the sweep's trials would not compare.
        raise UserError("--resume continues the sweep as it was started (Tune restores its searcher, scheduler and "
                        "trials; a changed config would reach only the unfinished trials): give no experiment, --profile, "
                        "--set or --samples; start a new sweep to change it")
    path = args.resume / "search.yaml"
    if not args.resume.is_dir() or not path.is_file():
        raise UserError(f"not a sweep directory (no search.yaml): {args.resume}")
    return ResolvedExperiment(config=validate(read_yaml(path, what="sweep config"), source=str(path)), source=path)

"""`rlplatform train`: resolve, check, size, start Ray, train, log, checkpoint, stop.

Read top to bottom: `run` prepares everything that can fail on bad input before Ray starts
(`run.plan`), then `run.loop.train_loop` drives the Algorithm (in the driver on a private local
instance, else in an actor of the run's placement group: `scale.algorithm_in`, `run.plan`, `run.algorithm_host`).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from rlplatform import console
from rlplatform.adapter import speedups
from rlplatform.config.experiment import ResolvedExperiment, resolve_experiment
from rlplatform.config.files import apply_override, parse_override, read_yaml, to_yaml
from rlplatform.config.schema import validate
from rlplatform.errors import UserError
from rlplatform.infra import local_ray
from rlplatform.run import run_dir as rundir
from rlplatform.run.loop import train_loop
from rlplatform.run.plan import Plan, checkpoint_to_resume, make_plan, with_record_directory


def add_parser(subparsers: Any) -> None:  # argparse's sub-parsers action
    p = subparsers.add_parser("train", help="train an experiment file on Ray RLlib")
    p.add_argument("experiment", nargs="?", type=Path, help="experiment YAML (default: experiments/cartpole_ppo.yaml)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override any key, e.g. --set training.lr=1e-3 (value parsed as YAML)")
    p.add_argument("--profile", help="scale/hardware profile: auto, laptop, workstation-1gpu, multi-gpu, cluster, or a YAML path (default: the experiment file's profile, else auto)")
    p.add_argument("--address", help="run on an existing Ray cluster (auto or HOST:PORT); default: a private local instance")
    p.add_argument("--resume", type=Path, metavar="RUN_DIR", help="continue a run from its newest complete checkpoint")
    p.add_argument("--max-failures", type=int, metavar="N",
                   help="rebuild the algorithm from its newest verified checkpoint when a training step fails, up to N times")
    p.add_argument("--runs-dir", type=Path, default=Path("runs"), help="root of run directories (default: runs)")
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    p.add_argument("--dashboard", action="store_true", help="start TensorBoard on the run beside the training")
    p.add_argument("--dashboard-port", type=int, default=6006, metavar="PORT")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    resolved = _resolve(args)
    if not args.resume:
        rundir.check_writable(args.runs_dir)
    connected, lock = False, None
    try:
        if args.resume and not args.print_config:
            lock = rundir.WriterLock(args.resume)  # before anything of the run is read for resuming
        if args.address:
            resources = local_ray.connect(args.address)
            connected = True
        else:
            resources = local_ray.local_resources()
        plan = make_plan(resolved, resources, joined_cluster=bool(args.address), resize=not args.resume)
        if args.resume:
            plan.run_dir = args.resume
            plan.resume_from = checkpoint_to_resume(args.resume)
        if args.print_config:
            print(to_yaml(plan.config), end="")
            return 0
        if plan.run_dir is None:
            plan.run_dir = rundir.new_run_dir(args.runs_dir, plan.config.name)
            lock = rundir.WriterLock(plan.run_dir)
        plan.config = with_record_directory(plan.config, plan.run_dir)
        rundir.write_config(plan.run_dir, plan.config)
        rundir.write_manifest(plan.run_dir, plan.config, _manifest_facts(args, resolved, plan))
        rundir.write_external(plan.run_dir, plan.config)
        if args.dashboard:
            from rlplatform.dashboards import tensorboard

            url = tensorboard.start(plan.run_dir, port=args.dashboard_port)
            console.say(f"TensorBoard: {url}")
        if not connected:
            local_ray.connect(None, plan.resources, prestart_workers=len(plan.bundles) > 1 or not plan.algorithm_in_driver,
                              speedups=plan.config.speedups)
            connected = True
        plan.ray_ready_at = time.time()
        try:
            return train_loop(plan)
        finally:
            _describe_recording(plan)
    finally:
        if connected:
            local_ray.shutdown()
        if lock is not None:
            lock.release()


def _describe_recording(plan: Plan) -> None:
    """`dataset.json` beside the episodes a run recorded (all of them, a resumed run's earlier ones included)."""
    record = plan.config.record
    if record is None or record.path is None or not Path(record.path).is_dir():
        return
    from rlplatform.adapter.offline_data import summarize, write_dataset_json
    from rlplatform.export.spec import space_to_json

    try:
        summary = summarize(Path(record.path))
    except UserError as exc:  # no episode finished, or a file that does not read back: say so, keep the run's outcome
        console.say(f"record: {exc}", style="yellow")
        return
    source = {"run": str(plan.require_run_dir().absolute()), "algorithm": plan.config.algorithm,
              "actions": "the training runners' (exploring)", "seed": plan.config.seed}
    write_dataset_json(Path(record.path), summary, plan.config.env, dict(plan.config.env_config), source, space_to_json)
    console.say(f"recorded {summary.episodes:,} episodes, {summary.env_steps:,} env steps, return {summary.return_mean:.2f} "
                f"(min {summary.return_min:.2f}, max {summary.return_max:.2f}): {record.path}")


def _manifest_facts(args: argparse.Namespace, resolved: ResolvedExperiment, plan: Plan) -> dict[str, Any]:
    return {"resources": vars(plan.resources), "bundles": plan.bundles, "address": args.address,
            "layout_from_bench": plan.layout_note,
            "envs_per_runner": plan.envs_choice,
            "speedups": speedups.manifest_record(resolved.config.speedups, plan.config, not args.address),
            "resumed_from": str(plan.resume_from.path) if plan.resume_from else None}


def _resolve(args: argparse.Namespace) -> ResolvedExperiment:
    if args.max_failures is not None:
        args.overrides = [*args.overrides, f"max_failures={args.max_failures}"]
    if not args.resume:
        return resolve_experiment(args.experiment, args.overrides, args.profile)
    if args.experiment is not None or args.profile is not None:
        raise UserError("--resume takes its config from the run directory; give --set to change it, not an experiment or --profile")
    config_path = args.resume / rundir.CONFIG_FILE
    if not args.resume.is_dir():
        raise UserError(f"run directory not found: {args.resume}")
    data = read_yaml(config_path, what="run config")
    for text in args.overrides:
        apply_override(data, *parse_override(text))
    return ResolvedExperiment(config=validate(data, source=str(config_path)), source=config_path)

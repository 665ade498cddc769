"""`rlplatform train`: resolve, check, size, start Ray, train, log, checkpoint, stop.

Read top to bottom: `run` prepares everything that can fail on bad input before Ray starts,
then `train_loop` drives the Algorithm (in the driver when a local run is one CPU process, else in
an actor of the run's placement group: see algorithm_host).
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from rlplatform import cluster, progress, rundir
from rlplatform.checkpoints import CheckpointInfo, CheckpointManager, latest_checkpoint
from rlplatform.config import ExperimentConfig, apply_override, parse_override, read_yaml, to_yaml, validate
from rlplatform.errors import TrainingFailed, UserError
from rlplatform.experiment import ResolvedExperiment, resolve_experiment

STALL_TIMEOUT_S = 300.0
# A process that a shell exec'd keeps the shell's creation time (`bash -c 'pip install ... && python -m
# rlplatform train'` runs its last command in bash's own process), while Python reaches this package
# within tens of milliseconds of its start: a creation time older than that by more is the shell's.
EXEC_GRACE_S = 1.0


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("train", help="train an experiment file on Ray RLlib")
    p.add_argument("experiment", nargs="?", type=Path, help="experiment YAML (default: experiments/cartpole_ppo.yaml)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override any key, e.g. --set training.lr=1e-3 (value parsed as YAML)")
    p.add_argument("--profile", help="scale/hardware profile: auto (default), laptop, workstation-1gpu, multi-gpu, cluster, or a YAML path")
    p.add_argument("--address", help="run on an existing Ray cluster (auto or HOST:PORT); default: a private local instance")
    p.add_argument("--resume", type=Path, metavar="RUN_DIR", help="continue a run from its newest complete checkpoint")
    p.add_argument("--runs-dir", type=Path, default=Path("runs"), help="root of run directories (default: runs)")
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    p.add_argument("--dashboard", action="store_true", help="start TensorBoard on the run beside the training")
    p.add_argument("--dashboard-port", type=int, default=6006, metavar="PORT")
    p.set_defaults(func=run)


@dataclass
class Plan:
    """Everything decided before training starts."""

    config: ExperimentConfig
    resources: cluster.Resources
    bundles: list[dict[str, float]]
    main_process_resources: dict[str, float] = field(default_factory=dict)
    resume_from: Optional[CheckpointInfo] = None
    run_dir: Optional[Path] = None
    layout_note: Optional[str] = None  # where `--profile auto` took a measured layout from
    ray_ready_at: Optional[float] = None  # time.time() when Ray was up
    algorithm_in_driver: bool = False  # see algorithm_host: a local run in one process, without GPUs


def run(args: argparse.Namespace) -> int:
    resolved = _resolve(args)
    if not args.resume:
        rundir.check_writable(args.runs_dir)
    connected = False
    try:
        if args.address:
            resources = cluster.connect(args.address)
            connected = True
        else:
            resources = cluster.local_resources()
        plan = _plan(resolved, resources, joined_cluster=bool(args.address), resize=not args.resume)
        if args.resume:
            plan.run_dir = args.resume
            plan.resume_from = _checkpoint_to_resume(args.resume)
        if args.print_config:
            print(to_yaml(plan.config), end="")
            return 0
        if plan.run_dir is None:
            plan.run_dir = rundir.new_run_dir(args.runs_dir, plan.config.name)
        rundir.write_config(plan.run_dir, plan.config)
        rundir.write_manifest(plan.run_dir, plan.config, {"resources": vars(plan.resources), "bundles": plan.bundles,
                                                         "address": args.address, "layout_from_bench": plan.layout_note,
                                                         "resumed_from": str(plan.resume_from.path) if plan.resume_from else None})
        if args.dashboard:
            from rlplatform import dashboard

            url = dashboard.start(plan.run_dir, port=args.dashboard_port)
            progress.console.print(f"TensorBoard: {url}")
        if not connected:
            cluster.connect(None, plan.resources, prestart_workers=not plan.algorithm_in_driver)
            connected = True
        plan.ray_ready_at = time.time()
        return train_loop(plan)
    finally:
        if connected:
            cluster.shutdown()


def _resolve(args: argparse.Namespace) -> ResolvedExperiment:
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


def _plan(resolved: ResolvedExperiment, resources: cluster.Resources, joined_cluster: bool, resize: bool) -> Plan:
    from rlplatform import layout_cache, rllib_adapter

    config = resolved.config
    rllib_adapter.check(config)
    layout_note = None
    if config.profile == "auto" and resize:  # a resumed run keeps the size it was started with
        config = cluster.size_to_cluster(config, resources, resolved.explicit_keys)
        config, layout_note = layout_cache.apply_best_layout(config, resources.cpus, resources.gpus, resolved.given_keys)
    main_resources = _driver_node_resource() if joined_cluster else {}
    bundles = rllib_adapter.resource_bundles(rllib_adapter.build_algorithm_config(config, main_resources))
    cluster.preflight(bundles, resources)
    one_cpu_process = len(bundles) == 1 and not bundles[0].get("GPU", 0)  # no runner or learner actors, no GPU
    return Plan(config=config, resources=resources, bundles=bundles, main_process_resources=main_resources,
                layout_note=layout_note, algorithm_in_driver=one_cpu_process and not joined_cluster)


def _driver_node_resource() -> dict[str, float]:
    """Pin the algorithm (and its checkpoints) to the driver's node, when the driver is a cluster node."""
    import ray

    key = f"node:{ray.util.get_node_ip_address()}"
    return {key: 0.001} if key in ray.cluster_resources() else {}


def _checkpoint_to_resume(run_dir: Path) -> CheckpointInfo:
    from rlplatform.rllib_adapter import load_inference_module

    info = latest_checkpoint(run_dir)
    load_inference_module(info.path)  # a torn or corrupt checkpoint fails here, before Ray starts
    return info


# ----------------------------------------------------------------------------- the loop


class StopFlag:
    """SIGINT/SIGTERM: finish the iteration, checkpoint, exit 0. A second Ctrl-C aborts."""

    def __init__(self) -> None:
        self.reason: Optional[str] = None
        self._previous = {s: signal.signal(s, self._handle) for s in (signal.SIGINT, signal.SIGTERM)}

    def _handle(self, signum, _frame) -> None:
        if self.reason is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.reason = signal.Signals(signum).name
        progress.console.print(f"[yellow]{self.reason}: finishing this iteration, then checkpointing[/]")

    def restore(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)


def _stop_reason(config: ExperimentConfig, m: dict[str, Any], window_full: bool, wall_s: float) -> Optional[str]:
    stop = config.stop
    if stop.return_mean is not None and window_full and m.get("return/mean", float("-inf")) >= stop.return_mean:
        return f"return/mean {m['return/mean']:.2f} >= {stop.return_mean:g}"
    if stop.env_steps is not None and m["env_steps"] >= stop.env_steps:
        return f"env steps {m['env_steps']:,} >= {stop.env_steps:,}"
    if stop.iterations is not None and m["iteration"] >= stop.iterations:
        return f"iterations {m['iteration']} >= {stop.iterations}"
    if stop.wall_time_s is not None and wall_s >= stop.wall_time_s:
        return f"wall time {wall_s:.0f} s >= {stop.wall_time_s:g} s"
    return None


def train_loop(plan: Plan) -> int:
    from rlplatform import algorithm_host
    from rlplatform.algorithm_host import HostFailed
    from rlplatform.metrics import EpisodeWindow, RunLogger
    from rlplatform.system_monitor import SystemMonitor

    config, run_dir = plan.config, plan.run_dir
    started = command_start_time()  # wall time counts from the command's start, Ray start-up included
    progress.print_start(run_dir, config, plan.resources.describe())
    if plan.layout_note:
        progress.console.print(plan.layout_note)
    host = None
    try:
        host = algorithm_host.start(config, plan.bundles, plan.main_process_resources, plan.resources.describe(),
                                    in_driver=plan.algorithm_in_driver)
        rundir.record_start(run_dir, "placement", {"algorithm_node": host.call("node_id"), "algorithm_in": host.where,
                                                   "env_runner_nodes": host.call("env_runner_nodes")})
        if plan.resume_from:
            host.call("restore", str(plan.resume_from.path.resolve()))
    except HostFailed as exc:
        if host is not None:
            host.close()
        raise TrainingFailed(f"the algorithm could not be built: {exc}") from None
    stop_flag = StopFlag()
    window, wall_before = EpisodeWindow(), 0.0
    if plan.resume_from:
        window = EpisodeWindow.from_state(plan.resume_from.meta.get("episode_window"))
        wall_before = float(plan.resume_from.meta.get("wall_time_s", 0.0))
        progress.console.print(f"resumed from {plan.resume_from.path} (iteration {plan.resume_from.iteration})")
    checkpoints = CheckpointManager(run_dir / "checkpoints", config.checkpoint.keep_last, config.checkpoint.keep_best)
    logger = RunLogger(run_dir, config, fresh=plan.resume_from is None)
    monitor = SystemMonitor()
    startup = {"ray_ready_s": (plan.ray_ready_at or started) - started, "algorithm_ready_s": time.time() - started}
    last: Optional[dict[str, Any]] = None
    saved: Optional[Path] = None
    stall = StallGuard()
    reason = None
    try:
        while reason is None:
            try:
                m = host.call("train")
            except HostFailed as exc:
                raise TrainingFailed(str(exc)) from None
            window.add(m.pop("episode_returns"), m.pop("episode_lengths"))
            wall_s = wall_before + time.time() - started
            m.update(window.summary(), **monitor.sample(), wall_time_s=wall_s, timestamp=time.time())
            logger.log(m)
            progress.print_iteration(m, config.scale.env_runners)
            if last is None:
                _record_startup(run_dir, startup, m, time.time() - started)
            last = m
            stall.update(m)
            reason = _stop_reason(config, m, window.full, wall_s) or stop_flag.reason
            every = config.checkpoint.every
            if reason is not None or (every and m["iteration"] % every == 0):
                saved = checkpoints.save(
                    lambda path: host.call("save", path),
                    iteration=m["iteration"], env_steps=m["env_steps"], score=_score(m),
                    meta={"wall_time_s": wall_s, "episode_window": window.state(), "config": config.model_dump()},
                )
    finally:
        stop_flag.restore()
        logger.close()
        monitor.stop()
        host.close()
    progress.print_summary(run_dir, reason, last, saved, time.time() - started)
    return 0


def _record_startup(run_dir: Path, startup: dict[str, float], first: dict[str, Any], now_s: float) -> None:
    """Where the time before training went, from the command's start (read by `bench solve`)."""
    startup = {**startup, "first_sample_s": startup["algorithm_ready_s"] + (first.get("time/sample_s") or 0.0),
               "first_iteration_s": now_s}
    rundir.record_start(run_dir, "startup", startup)
    progress.console.print(
        f"start-up: Ray ready {startup['ray_ready_s']:.1f} s, algorithm built {startup['algorithm_ready_s']:.1f} s, "
        f"first batch sampled {startup['first_sample_s']:.1f} s after the command started", style="dim")


class StallGuard:
    """Fail a run whose env runners keep dying before they sample anything, instead of looping forever."""

    def __init__(self, timeout_s: float = STALL_TIMEOUT_S):
        self.timeout_s = timeout_s
        self._steps = -1
        self._since = time.time()

    def update(self, m: dict[str, Any]) -> None:
        if m["env_steps"] > self._steps:
            self._steps, self._since = m["env_steps"], time.time()
        elif time.time() - self._since > self.timeout_s:
            healthy = m.get("faults/healthy_env_runners")
            raise TrainingFailed(
                f"no env steps sampled for {self.timeout_s:.0f} s (healthy env runners: {healthy}); "
                "the env or its runners keep failing - see the worker logs under Ray's session directory"
            )


def command_start_time() -> float:
    """time.time() when this command started, the interpreter's own start-up included."""
    import rlplatform

    created = _process_creation_time()
    return created if rlplatform.IMPORTED_AT - created < EXEC_GRACE_S else rlplatform.IMPORTED_AT


def _process_creation_time() -> float:
    # psutil adds the start tick to /proc/stat's boot time, a whole second: up to 1 s early (0.65 s on
    # this machine). The process's age on the boot clock is exact to the tick (10 ms).
    try:
        start_ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - start_ticks / os.sysconf("SC_CLK_TCK")
        return time.time() - age
    except (OSError, AttributeError, ValueError, IndexError):  # no /proc or no boot clock: not Linux
        import psutil

        return psutil.Process().create_time()


def _score(m: dict[str, Any]) -> Optional[float]:
    return m.get("eval/return_mean", m.get("return/mean"))

"""Benchmarks that measure training run `python -m rlplatform train` itself, in its own process.

So the numbers are what a user gets from the command line: interpreter start, imports, Ray
start-up, building, training, checkpoints. The run directory (config, metrics.jsonl, manifest)
is kept beside the benchmark's JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from rlplatform.config.files import read_yaml
from rlplatform.run.run_dir import CONFIG_FILE


def add_training_arguments(q: Any, default_experiment: str = "experiments/cartpole_ppo.yaml", address: bool = True,
                           default_profile: Optional[str] = None) -> None:
    """The arguments of a benchmark that trains: the experiment, `--set`, `--profile`, `--address` (left out, with
    `address=False`, where the benchmark reads every process of its run on this machine) and `-o`."""
    q.add_argument("experiment", nargs="?", type=Path, help=f"experiment YAML (default: {default_experiment})")
    q.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help="as for train")
    q.add_argument("--profile", default=default_profile,
                   help=f"as for train (default: {default_profile or 'the experiment file, else auto'})")
    if address:
        q.add_argument("--address", help="train on this Ray cluster (default: a private local instance)")
    else:
        q.set_defaults(address=None)  # the training run's: the loopback cluster's address when --nodes starts one
    q.add_argument("-o", "--output", type=Path, default=Path("bench"), help="directory for the results (default: bench)")


@dataclass
class TrainingRun:
    """A finished `train` process and what it wrote."""

    run_dir: Path
    returncode: int
    command_s: float  # the whole command, start to exit
    stdout: str
    stderr: str
    metrics: list[dict[str, Any]] = field(default_factory=list)
    manifest: dict[str, Any] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)  # as the run wrote it, after --profile auto sized it

    @property
    def layout(self) -> Optional[str]:
        """Env runners x envs per runner x vectorisation, as the run ran them."""
        scale = self.config.get("scale")
        return f"{scale.get('env_runners')}x{scale.get('envs_per_runner')}x{scale.get('vectorize')}" if scale else None

    @property
    def stop_line(self) -> str:
        return next((line for line in self.stdout.splitlines() if line.startswith("stopped: ")), "")

    def failure(self) -> str:
        tail = (self.stderr.strip().splitlines() or self.stdout.strip().splitlines() or ["no output"])[-1]
        return f"train exited with {self.returncode}: {tail}"


def train_command(args: Any, runs_dir: Path, extra_overrides: Sequence[str] = ()) -> list[str]:
    cmd = [sys.executable, "-m", "rlplatform", "train", "--runs-dir", str(runs_dir)]
    if args.experiment is not None:
        cmd.append(str(args.experiment))
    for text in [*args.overrides, *extra_overrides]:
        cmd += ["--set", text]
    if args.profile:
        cmd += ["--profile", args.profile]
    if args.address:
        cmd += ["--address", args.address]
    return cmd


def wall_clock_only(minutes: float) -> list[str]:
    """Overrides that leave the clock as a run's only stop criterion."""
    return [f"stop.wall_time_s={60 * minutes:g}", "stop.return_mean=null", "stop.env_steps=null", "stop.iterations=null"]


def check_experiment(args) -> Any:
    """Resolve the experiment here first, so bad input fails before any training process starts."""
    from rlplatform.adapter.algorithm_config import check
    from rlplatform.config.experiment import resolve_experiment

    config = resolve_experiment(args.experiment, args.overrides, args.profile).config
    check(config)
    return config


def start(cmd: list[str], log_dir: Path, env: Optional[dict[str, str]] = None) -> tuple[subprocess.Popen, float]:
    log_dir.mkdir(parents=True, exist_ok=True)
    started = time.time()
    proc = subprocess.Popen(cmd, stdout=(log_dir / "stdout.txt").open("w"), stderr=(log_dir / "stderr.txt").open("w"),
                            env={**(env or os.environ), "PYTHONUNBUFFERED": "1"})
    return proc, started


def finish(proc: subprocess.Popen, started: float, runs_dir: Path, log_dir: Path, timeout_s: Optional[float] = None) -> TrainingRun:
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.terminate()  # SIGTERM: train checkpoints and stops cleanly
        proc.wait(timeout=120)
    command_s = time.time() - started
    stdout, stderr = (log_dir / "stdout.txt").read_text(), (log_dir / "stderr.txt").read_text()
    manifests = sorted(runs_dir.glob("*/*/manifest.json"))
    run_dir = manifests[-1].parent if manifests else runs_dir
    run = TrainingRun(run_dir=run_dir, returncode=proc.returncode, command_s=command_s, stdout=stdout, stderr=stderr)
    if manifests:
        run.manifest = json.loads(manifests[-1].read_text())
        if (run_dir / CONFIG_FILE).is_file():
            run.config = read_yaml(run_dir / CONFIG_FILE, "run config")
        metrics_file = run_dir / "metrics.jsonl"
        if metrics_file.is_file():
            run.metrics = [json.loads(line) for line in metrics_file.read_text().splitlines() if line.strip()]
    return run


def run_training(args: Any, runs_dir: Path, extra_overrides: Sequence[str] = (),
                 timeout_s: Optional[float] = None) -> TrainingRun:
    proc, started = start(train_command(args, runs_dir, extra_overrides), runs_dir)
    return finish(proc, started, runs_dir, runs_dir, timeout_s)


def bench_dir(output: Path, kind: str, name: str) -> Path:
    """`bench/solve-cartpole-ppo-20261203-142501/`: each benchmark keeps its runs beside its JSON."""
    path = output / f"{kind}-{name}-{time.strftime('%Y%m%d-%H%M%S')}"
    path.mkdir(parents=True, exist_ok=False)
    return path


def median(values: list[float]) -> Optional[float]:
    import statistics

    return statistics.median(values) if values else None


def write_json(path: Path, data: dict[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")
    return path

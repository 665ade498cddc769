"""One compact line per iteration, and a summary at the end (rich)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from rich.markup import escape

from rlplatform.config.schema import ExperimentConfig
from rlplatform.console import fmt, say, stdout


def iteration_line(m: dict[str, Any], expected_runners: int) -> str:
    healthy = m.get("faults/healthy_env_runners")
    runners = f"{int(healthy)}/{expected_runners}" if healthy is not None and expected_runners else "local"
    return (
        f"[bold]it {m['iteration']:>4}[/]  steps {m['env_steps']:>9,}  "
        f"return [cyan]{fmt(m.get('return/mean'), '8.2f', '       -')}[/]  "
        f"{fmt(m.get('throughput/env_steps_sampled_per_s', m.get('throughput/env_steps_trained_per_s')), '7,.0f')} steps/s  "
        f"sample {fmt(m.get('time/sample_s'), '5.2f')}s learn {fmt(m.get('time/learn_s'), '5.2f')}s  "
        f"runners {runners}"
        + (f"  eval {fmt(m.get('eval/return_mean'), '.2f')}" if "eval/return_mean" in m else "")
    )


def print_iteration(m: dict[str, Any], expected_runners: int) -> None:
    stdout.print(iteration_line(m, expected_runners))


def print_start(run_dir: Path, config: ExperimentConfig, resources: str) -> None:
    scale = config.scale
    learners = f"{scale.learners} remote learner(s)" if scale.learners else "learner in the main process"
    gpu = f" on {config.hardware.gpus_per_learner:g} GPU each" if config.hardware.gpus_per_learner else ""
    sampling = (f"{scale.env_runners} env runner(s) x {scale.envs_per_runner} envs ({scale.vectorize})" if scale.env_runners
                else f"sampling in the main process, {scale.envs_per_runner} envs ({scale.vectorize})")
    if config.external is not None:
        sampling = f"{scale.env_runners} simulator(s) outside Ray"
    if config.data is not None:
        sampling = f"learning from {', '.join(config.data.paths or [str(config.data.minari)])} (the env evaluates)"
    stdout.print(f"[bold]rlplatform[/] {escape(f'{config.algorithm} on {config.env}: {sampling}, {learners}{gpu}; cluster: {resources}')}")
    say(f"run directory: {run_dir}")
    if config.external is not None:
        ports = ", ".join(map(str, config.external.ports or []))
        say(f"simulators connect to {config.external.host} on port(s) {ports} (one each; {run_dir / 'external.json'})")


def print_summary(run_dir: Path, reason: str, last: Optional[dict[str, Any]], checkpoint: Optional[Path], wall_s: float) -> None:
    stdout.rule("done")
    say(f"stopped: {reason} after {wall_s:.1f} s")
    if last:
        stdout.print(
            f"iterations {last['iteration']}, env steps {last['env_steps']:,}, "
            f"return (last 100 episodes) {fmt(last.get('return/mean'), '.2f')}"
        )
    if checkpoint:
        say(f"checkpoint: {checkpoint}")
    say(f"run directory: {run_dir}")
    say(f"TensorBoard: tensorboard --logdir {run_dir}")

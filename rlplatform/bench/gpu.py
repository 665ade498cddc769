"""`rlplatform bench gpu`: the GPU learner preset, Atari Pong APPO, ready for the day a GPU is at hand.

Trains `experiments/pong_appo.yaml` (or the experiment given) with the `workstation-1gpu` profile
(learner on the GPU in the main process, env runners on the spare cores) for `--minutes`, as a real
`train` process, then reads its metrics: env steps the learner trained per second (each sample
counted once), env steps sampled per second and GPU utilisation (nvidia-smi, measured once a
second; each iteration's row has the latest), as medians over the iterations after the warm-up.
Refuses to start without a GPU, unless a profile with no GPU learner is asked for (`--profile
laptop`, or `auto` on a machine without one): then it measures the same learner on the CPU, the
baseline for the GPU's number.
Results: `<output>/gpu-<name>-<time>/gpu.json`.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from rlplatform import console
from rlplatform.bench.training_runs import (
    add_training_arguments,
    bench_dir,
    check_experiment,
    median,
    run_training,
    wall_clock_only,
    write_json,
)
from rlplatform.errors import TrainingFailed, UserError

PRESET = Path("experiments/pong_appo.yaml")
PROFILE = "workstation-1gpu"


def add_verb(verbs: Any) -> None:  # argparse's sub-parsers action
    q = verbs.add_parser("gpu", help=f"GPU learner throughput and utilisation: {PRESET.stem} on the {PROFILE} profile")
    add_training_arguments(q, default_experiment=str(PRESET), default_profile=PROFILE)
    q.add_argument("--minutes", type=float, default=5.0, help="how long to train (default: 5)")
    q.add_argument("--warmup-minutes", type=float, default=1.0, help="iterations before this are left out (default: 1)")
    q.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rlplatform.infra.local_ray import local_resources

    if args.minutes <= 0 or not 0 <= args.warmup_minutes < args.minutes:
        raise UserError("--minutes must be > 0 and --warmup-minutes between 0 and --minutes")
    args.experiment = args.experiment or _preset_path()
    config = check_experiment(args)
    wants_gpu = config.profile != "auto" and config.hardware.gpus_per_learner > 0  # auto takes a GPU where there is one
    if wants_gpu and not args.address and local_resources().gpus < 1:
        raise UserError("bench gpu needs a GPU: torch sees no CUDA device on this machine (give --address for a GPU "
                        "cluster, or --profile laptop to measure the same learner on the CPU)")
    root = bench_dir(args.output, "gpu", config.name)
    console.say(f"bench gpu: training {config.name} ({args.profile}) for {args.minutes:g} min")
    run_ = run_training(args, root / "run", wall_clock_only(args.minutes), timeout_s=60 * args.minutes + 600)
    if run_.returncode != 0:
        raise TrainingFailed(run_.failure())
    summary = summarize(run_.metrics, 60 * args.warmup_minutes)
    result = {"experiment": config.name, "profile": args.profile, "minutes": args.minutes, "layout": run_.layout,
              "learner_device": learner_device(run_.config), **summary, "run_dir": str(run_.run_dir)}
    path = write_json(root / "gpu.json", result)
    console.say(
        f"learner on the {result['learner_device']}: {console.fmt(summary['env_steps_trained_per_s'], ',.0f')} env steps trained/s, "
        f"sampling {console.fmt(summary['env_steps_sampled_per_s'], ',.0f')}/s ({result['layout']}), GPU utilisation "
        f"{console.fmt(summary['gpu_util_percent'], ',.0f')} % (medians over {summary['iterations_measured']} iterations after warm-up)")
    console.say(f"written: {path}")
    return 0


def learner_device(run_config: dict[str, Any]) -> str:
    """Where the run's learners were, from the config it wrote: "GPU" or "CPU"."""
    return "GPU" if run_config.get("hardware", {}).get("gpus_per_learner", 0) > 0 else "CPU"


def summarize(metrics: list[dict[str, Any]], warmup_s: float) -> dict[str, Any]:
    measured = [m for m in metrics if m.get("wall_time_s", 0) >= warmup_s] or metrics[-1:]
    gpu_util = [v for m in measured for k, v in m.items() if k.startswith("system/gpu") and k.endswith("/util_percent")]
    return {
        "iterations_measured": len(measured),
        "env_steps_trained_per_s": median([m["throughput/env_steps_trained_per_s"] for m in measured if "throughput/env_steps_trained_per_s" in m]),
        "env_steps_sampled_per_s": median([m["throughput/env_steps_sampled_per_s"] for m in measured if "throughput/env_steps_sampled_per_s" in m]),
        "gpu_util_percent": median(gpu_util),
        "final_return_mean": metrics[-1].get("return/mean") if metrics else None,
        "env_steps": metrics[-1].get("env_steps") if metrics else None,
    }


def _preset_path() -> Path:
    from rlplatform.config.experiment import PROJECT_ROOT

    return PRESET if PRESET.is_file() else PROJECT_ROOT / PRESET

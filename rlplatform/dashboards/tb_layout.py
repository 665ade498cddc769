"""What a run's TensorBoard opens on: the Custom Scalars layout and the HParams record.

The layout is written after the first iteration, from the tags that run really logs, so that
every chart has data (no GPU chart on a CPU run, no eval line without evaluation).
"""

from __future__ import annotations

import re
from typing import Any, Iterable, Optional

from rlplatform.config.schema import ExperimentConfig

# section -> chart title -> tag regexes (TensorBoard's Custom Scalars plugin matches tags by regex)
LAYOUT: dict[str, dict[str, list[str]]] = {
    "Overview": {
        "Return (last 100 episodes) and eval return": [r"return/mean", r"return/min", r"return/max", r"eval/return_mean"],
        "Env steps per second: sampled and trained": [r"throughput/env_steps_sampled_per_s", r"throughput/env_steps_trained_per_s"],
        "Iteration time: sample / learn / sync": [r"time/iteration_s", r"time/sample_s", r"time/learn_s", r"time/sync_weights_s"],
        "Return per policy (multi-agent)": [r"return/[^/]+/mean"],
        "Episode length": [r"episode/length_mean", r"eval/episode_length_mean"],
        "Illegal actions (model.action_mask; 0)": [r"actions/illegal"],
    },
    "Learner": {
        "Losses": [r"learner/.*loss$"],
        "Entropy": [r"learner/.*/entropy$"],
        "KL": [r"learner/.*/kl$"],
        "Learning rate": [r"learner/.*/lr$", r"learner/.*_lr$"],
        "Gradient norm": [r"learner/.*grad.*norm.*"],
    },
    "Cluster": {
        "Env runners: healthy and restarts": [r"faults/healthy_env_runners", r"faults/env_runner_restarts"],
        "Run restarts from checkpoints (--max-failures)": [r"faults/run_restarts"],
        "CPU % per node": [r"system/[^/]+/cpu_percent"],
        "RAM % per node": [r"system/[^/]+/ram_percent"],
        "GPU utilisation %": [r"system/gpu\d+/util_percent"],
        "GPU memory used (GB)": [r"system/gpu\d+/mem_used_gb"],
        "Object store used (GB)": [r"ray/object_store_used_gb"],
    },
}


def layout_for(tags: Iterable[str]) -> dict[str, dict[str, list[Any]]]:
    """The layout restricted to charts (and lines) that match at least one logged tag."""
    tags = list(tags)
    layout: dict[str, dict[str, list[Any]]] = {}
    for section, charts in LAYOUT.items():
        for title, patterns in charts.items():
            present = [p for p in patterns if any(re.fullmatch(p, t) for t in tags)]
            if present:
                layout.setdefault(section, {})[title] = ["Multiline", present]
    return layout


def write_layout(writer, tags: Iterable[str]) -> None:
    writer.add_custom_scalars(layout_for(tags))


HPARAM_METRICS = ("return/mean", "eval/return_mean", "throughput/env_steps_sampled_per_s", "time/iteration_s")


def hparams_of(config: ExperimentConfig) -> dict[str, Any]:
    """Hyper-parameters and scale, flattened to the scalar values the HParams plugin compares."""
    values: dict[str, Any] = {
        "algorithm": config.algorithm,
        "env": config.env,
        "profile": config.profile,
        "seed": config.seed if config.seed is not None else -1,
        "scale.env_runners": config.scale.env_runners,
        "scale.envs_per_runner": config.scale.envs_per_runner,
        "scale.vectorize": config.scale.vectorize,
        "scale.learners": config.scale.learners,
        "hardware.gpus_per_learner": config.hardware.gpus_per_learner,
        "model.hidden": str(config.model.hidden),
    }
    for key, value in config.training.items():
        if isinstance(value, (bool, int, float, str)):
            values[f"training.{key}"] = value
    return values


def write_hparams(writer, config: ExperimentConfig, extra: Optional[dict[str, Any]] = None) -> None:
    """The run's HParams record; its metrics are the run's own scalars under HPARAM_METRICS. `extra`: more values
    (a sweep trial's searched keys), lists shown as text as `model.hidden` is."""
    from torch.utils.tensorboard.summary import hparams

    values = hparams_of(config)
    for key, value in (extra or {}).items():
        values[key] = value if isinstance(value, (bool, int, float, str)) else str(value)
    experiment, session_start, session_end = hparams(values, {m: 0.0 for m in HPARAM_METRICS})
    for summary in (experiment, session_start, session_end):
        writer.file_writer.add_summary(summary)

"""PNG plots of one or several runs, overlaid: return against env steps and wall time, throughput, time split."""

from __future__ import annotations

import json
from pathlib import Path

from rlplatform.errors import UserError

PANELS = ("Return vs env steps", "Return vs wall time", "Env steps/s sampled", "Time per iteration: sample / learn / sync")


def load_rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise UserError(f"not a run directory (no metrics.jsonl): {run_dir}")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not rows:
        raise UserError(f"run has no iterations yet: {run_dir}")
    return rows


def expand_sweeps(run_dirs: list[Path]) -> list[Path]:
    """A sweep directory (it holds the sweep's search.yaml, `rlplatform tune`) stands for its trials' run directories."""
    expanded = []
    for d in run_dirs:
        trials = sorted(t for t in d.glob("trial_*") if (t / "metrics.jsonl").is_file()) if (d / "search.yaml").is_file() else []
        expanded.extend(trials or [d])
    return expanded


def run_label(run_dir: Path) -> str:
    return f"{run_dir.resolve().parent.name}/{run_dir.resolve().name}"


def _series(rows: list[dict], x: str, y: str) -> tuple[list[float], list[float]]:
    points = [(r[x], r[y]) for r in rows if r.get(x) is not None and r.get(y) is not None]
    return [p[0] for p in points], [p[1] for p in points]


def plot(runs: dict[str, list[dict]], output: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(13, 8.5))
    ret_steps, ret_wall, throughput, split = axes.flat
    for label, rows in runs.items():
        ret_steps.plot(*_series(rows, "env_steps", "return/mean"), label=label)
        ret_wall.plot(*_series(rows, "wall_time_s", "return/mean"), label=label)
        throughput.plot(*_series(rows, "env_steps", "throughput/env_steps_sampled_per_s"), label=label)
    _time_split(split, runs)
    for ax, title, xlabel, ylabel in (
        (ret_steps, PANELS[0], "env steps sampled", "return (mean of last 100 episodes)"),
        (ret_wall, PANELS[1], "wall time from command start (s)", "return (mean of last 100 episodes)"),
        (throughput, PANELS[2], "env steps sampled", "env steps / s"),
    ):
        ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(output, dpi=100)
    plt.close(fig)


def _time_split(ax, runs: dict[str, list[dict]]) -> None:
    """Mean seconds per iteration spent sampling, learning, syncing weights and elsewhere, per run."""
    labels = list(runs)
    parts = {"sample": "time/sample_s", "learn": "time/learn_s", "sync weights": "time/sync_weights_s"}
    bottoms = [0.0] * len(labels)
    for name, key in parts.items():
        means = [_mean(rows, key) for rows in runs.values()]
        ax.bar(range(len(labels)), means, bottom=bottoms, label=name)
        bottoms = [b + m for b, m in zip(bottoms, means)]
    other = [max(0.0, _mean(rows, "time/iteration_s") - b) for rows, b in zip(runs.values(), bottoms)]
    ax.bar(range(len(labels)), other, bottom=bottoms, label="other")
    ax.set_xticks(range(len(labels)), [label.replace("/", "\n") for label in labels], fontsize=7)
    ax.set(title=PANELS[3], ylabel="seconds per iteration (mean)")
    ax.legend(fontsize=8)


def _mean(rows: list[dict], key: str) -> float:
    values = [r[key] for r in rows if r.get(key) is not None]
    return sum(values) / len(values) if values else 0.0

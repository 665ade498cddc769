"""`rlplatform bench soak EXPERIMENT --minutes M`: does any process's memory grow while training?

One real `train` process runs for M minutes (its stop criteria replaced by a wall-time limit).
Every `--interval` seconds the resident memory (RSS) of the driver (on a local CPU run it holds the
Algorithm and its local learner) and of every process below it is read with psutil: the
algorithm-host actor where there is one, each env runner, each remote learner, the system
monitor, and Ray's own (GCS, raylet, its agents). Growth per process is measured from the end of
the warm-up (default: the first two minutes, as long runs allocate their buffers early) to the end
of the run, on the median of the last few samples of each span, so that one garbage-collection
spike does not decide it.
With `--nodes N` the run trains on a cluster of N Ray nodes on loopback addresses started for it
(`infra/loopback.py`: a head with the dashboard, as `ray up` starts one, and N-1 workers, with the Ray
settings of our cluster configs), and every process of every node is read as well: GCS, raylets,
dashboard, agents, monitors, workers and actors, each with the node it runs on.
Results: `<output>/soak-<name>-<time>/soak.json` and `soak.png`.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Optional

from rlplatform import console
from rlplatform.bench.processes import add_node_arguments, check_nodes, loopback_cluster, run_processes, sample_processes
from rlplatform.bench.training_runs import (
    add_training_arguments,
    bench_dir,
    check_experiment,
    finish,
    median,
    start,
    train_command,
    wall_clock_only,
    write_json,
)
from rlplatform.errors import TrainingFailed, UserError
from rlplatform.infra.loopback import CLUSTER_RAY_ENV

GROWTH_TARGET = 0.05
SPAN_SAMPLES = 3  # samples whose median stands for "RSS at the end of the warm-up" and "RSS at the end"



def add_verb(verbs: Any) -> None:  # argparse's sub-parsers action
    q = verbs.add_parser("soak", help="resident memory of every process of a run (driver, runners, learners, Ray's own) over a long run")
    add_training_arguments(q, default_experiment="experiments/cartpole_ppo.yaml", address=False)  # the processes are read here
    q.add_argument("--minutes", type=float, default=20.0, help="how long to train (default: 20)")
    q.add_argument("--warmup-minutes", type=float, help="growth is measured after this (default: 2, or a tenth of short runs)")
    q.add_argument("--interval", type=float, default=10.0, help="seconds between memory samples (default: 10)")
    add_node_arguments(q)
    q.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.minutes <= 0 or args.interval <= 0:
        raise UserError("--minutes and --interval must be > 0")
    check_nodes(args)
    warmup_s = 60 * (args.warmup_minutes if args.warmup_minutes is not None else min(2.0, args.minutes / 10))
    if warmup_s >= 60 * args.minutes:
        raise UserError(f"--warmup-minutes ({warmup_s / 60:g}) must be shorter than --minutes ({args.minutes:g})")
    config = check_experiment(args)
    root = bench_dir(args.output, "soak", config.name)
    with loopback_cluster(args.nodes, args.node_cpus) as cluster:
        if cluster is not None:
            args.address = cluster.address
            console.say(f"soak: a cluster of {args.nodes} loopback nodes at {cluster.address} "
                         f"({args.node_cpus:g} CPUs each, {', '.join(f'{k}={v}' for k, v in CLUSTER_RAY_ENV.items())})")
        # Only the clock stops this run; checkpoints and everything else stay as the experiment has them.
        proc, started = start(train_command(args, root / "run", wall_clock_only(args.minutes)), root / "run",
                              env=cluster.head.env if cluster else None)
        console.say(f"soak: training {config.name} for {args.minutes:g} min, memory every {args.interval:g} s "
                     f"(growth measured after {warmup_s / 60:g} min)")
        samples = sample_processes(lambda: run_processes(proc.pid, cluster), read_rss, started, args.interval, poll=proc.poll)
        run_ = finish(proc, started, root / "run", root / "run", timeout_s=120)
    if run_.returncode != 0:
        raise TrainingFailed(run_.failure())
    processes = growth_per_process(samples, warmup_s)
    worst = max((p["growth"] for p in processes if p["growth"] is not None), default=None)
    result = {"experiment": config.name, "minutes": args.minutes, "warmup_s": warmup_s, "interval_s": args.interval,
              "nodes": args.nodes, "cluster_ray_env": CLUSTER_RAY_ENV if cluster else None,
              "growth_target": GROWTH_TARGET, "worst_growth": worst, "within_target": worst is not None and worst < GROWTH_TARGET,
              "env_steps": (run_.metrics[-1]["env_steps"] if run_.metrics else None), "processes": processes,
              "samples": samples, "run_dir": str(run_.run_dir)}
    path = write_json(root / "soak.json", result)
    plot(samples, processes, warmup_s, root / "soak.png")
    _print_table(processes, worst)
    console.say(f"written: {path}, {root / 'soak.png'}")
    return 0


def read_rss(proc, role: str) -> dict[str, Any]:
    return {"rss": proc.memory_info().rss}


def growth_per_process(samples: list[dict[str, Any]], warmup_s: float) -> list[dict[str, Any]]:
    pids = {pid: (info["role"], info.get("node", "driver")) for s in samples for pid, info in s["processes"].items()}
    rows = []
    for pid, (role, node) in sorted(pids.items(), key=lambda kv: (kv[1], int(kv[0]))):
        series = [(s["t"], s["processes"][pid]["rss"]) for s in samples if pid in s["processes"]]
        after = [rss for t, rss in series if t >= warmup_s]
        baseline = median(after[:SPAN_SAMPLES]) if len(after) >= 2 * SPAN_SAMPLES else None
        end = median(after[-SPAN_SAMPLES:]) if baseline is not None else None
        rows.append({"pid": int(pid), "role": role, "node": node, "first_s": series[0][0], "last_s": series[-1][0],
                     "rss_after_warmup_mb": baseline / 2**20 if baseline else None, "rss_end_mb": end / 2**20 if end else None,
                     "rss_max_mb": max(r for _, r in series) / 2**20,
                     "growth": (end - baseline) / baseline if baseline and end is not None else None})
    return rows


def _print_table(processes: list[dict[str, Any]], worst: Optional[float]) -> None:
    from rich.table import Table

    table = Table(title=f"resident memory after warm-up (target: < {GROWTH_TARGET:.0%} growth)")
    for column in ("process", "node", "pid", "after warm-up MB", "end MB", "max MB", "growth"):
        table.add_column(column, justify="right")
    for p in processes:
        table.add_row(p["role"], p["node"], str(p["pid"]), _mb(p["rss_after_warmup_mb"]), _mb(p["rss_end_mb"]), _mb(p["rss_max_mb"]),
                      "-" if p["growth"] is None else f"{p['growth']:+.1%}")
    console.stdout.print(table)
    if worst is None:
        console.say("too few samples after the warm-up to measure growth; run longer or sample more often")
    else:
        console.say(f"worst growth: {worst:+.1%} ({'within' if worst < GROWTH_TARGET else 'OVER'} the {GROWTH_TARGET:.0%} target)")


def _mb(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:,.0f}"


def plot(samples: list[dict[str, Any]], processes: list[dict[str, Any]], warmup_s: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5))
    for p in processes:
        pid = str(p["pid"])
        series = [(s["t"] / 60, s["processes"][pid]["rss"] / 2**20) for s in samples if pid in s["processes"]]
        ax.plot(*zip(*series), label=f"{p['role']}, {p['node']} ({pid})")
    ax.axvline(warmup_s / 60, color="grey", linestyle="--", label="end of warm-up")
    ax.set_xlabel("minutes since the command started")
    ax.set_ylabel("resident memory (MB)")
    ax.set_title("Memory soak: RSS per process")
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)

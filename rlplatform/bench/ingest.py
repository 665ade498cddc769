"""`rlplatform bench ingest [EXPERIMENT]`: what each role of the training pipeline costs per env step.

The env runners step `rlplatform/Firehose-v0`, an env of ours whose step costs next to nothing (a few
microseconds), with `--episode-lens` steps per episode and `--obs-size` floats per observation, many envs
per runner. Whatever CPU the run then spends is the pipeline's own: for each point (algorithm x episode
length x fragment x aggregators per learner x remote learners) one real `train` process trains (learning
on) for `--seconds`, and every process of the run is sampled (`/proc` CPU times, every `--interval`
seconds). Over the measured window (first iteration's end to the last's) each role's CPU is divided by the
env steps sampled in it: CPU microseconds per env step, and per fragment (one runner's sample: envs per
runner x fragment steps). A role's ceiling is the cores it has (one per process) over its cost per step;
the lowest ceiling caps the pipeline. Where two points differ only in the fragment, each role's cost is
split into a part per env step and a part per fragment (`fit`). The learner's own cost is split too: its
gradient steps (forward, loss, backward, optimizer: the CPU time the lean learners log for them) and its host
side (the rest of its process: connectors, batch assembly, copies to the device, metrics).

Results: `<output>/ingest-<name>-<time>/ingest.json`, `ingest.png`, and the tables.
"""

from __future__ import annotations

import argparse
import itertools
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from rlplatform import console
from rlplatform.bench.processes import (
    LoopbackCluster,
    add_node_arguments,
    check_nodes,
    node_cluster,
    read_cpu,
    run_processes,
    sample_processes,
)
from rlplatform.bench.training_runs import add_training_arguments, bench_dir, finish, start, train_command, write_json
from rlplatform.config.schema import AGGREGATOR_ALGORITHMS
from rlplatform.errors import UserError

INGEST_ENV = "rlplatform/Firehose-v0"
DEFAULT_EXPERIMENT = Path("experiments/cartpole_ppo.yaml")  # its model; the bench sets the algorithm and batch
# Roles that are the pipeline's own; Ray's daemons and agents are summed as "ray".
PIPELINE_ROLES = ("driver", "algorithm + local learner", "env runner", "aggregator", "learner")
GRADIENT_KEY = "cpu/learner_gradient_s"  # the learners' CPU seconds in gradient steps so far (run metrics)
MIN_ITERATION_S = 2.0  # APPO/IMPALA iterate at least 10 s by default: shorter, so that a point has several
WARMUP_ITERATIONS = 2  # an asynchronous algorithm's first iteration may return before any sample arrives


@dataclass(frozen=True)
class Point:
    algorithm: str
    episode_len: int
    fragment: int
    aggregators: int
    learners: int

    def __str__(self) -> str:
        return (f"{self.algorithm}, episodes of {self.episode_len}, fragment {self.fragment}, "
                f"{self.aggregators} aggregator(s) per learner, {self.learners} remote learner(s)")

    @property
    def key(self) -> str:
        return f"{self.algorithm}-e{self.episode_len}-f{self.fragment}-a{self.aggregators}-l{self.learners}"


def add_verb(verbs: Any) -> None:  # argparse's sub-parsers action
    q = verbs.add_parser("ingest", help="CPU per env step of each role (runners, driver, aggregators, learners) on an "
                                        "env that costs nothing; each role's ceiling")
    add_training_arguments(q, default_experiment=str(DEFAULT_EXPERIMENT), address=False)  # the processes are read here
    q.add_argument("--algorithms", nargs="+", choices=("PPO", "APPO", "IMPALA"), default=["PPO", "APPO"],
                   help="algorithms to measure (default: PPO APPO)")
    q.add_argument("--episode-lens", nargs="+", type=int, default=[10, 1000], metavar="STEPS",
                   help="env steps per episode (default: 10 1000)")
    q.add_argument("--fragments", nargs="+", type=int, default=[50, 500], metavar="STEPS",
                   help="rollout fragment length: env steps per env per sample (default: 50 500)")
    q.add_argument("--aggregators", nargs="+", type=int, default=[0], metavar="N",
                   help="aggregator actors per learner, APPO/IMPALA only (default: 0)")
    q.add_argument("--learners", nargs="+", type=int, default=[0], metavar="N",
                   help="remote learners; 0: the learner in the algorithm's process (default: 0)")
    q.add_argument("--runners", type=int, default=1, help="env runners (default: 1)")
    q.add_argument("--envs-per-runner", type=int, default=32, help="envs per runner (default: 32)")
    q.add_argument("--obs-size", type=int, default=4, help="floats per observation (default: 4)")
    q.add_argument("--seconds", type=float, default=40.0,
                   help=f"measured training time per point, start-up and {WARMUP_ITERATIONS} warm-up iterations apart (default: 40)")
    q.add_argument("--interval", type=float, default=0.5, help="seconds between CPU samples (default: 0.5)")
    q.add_argument("--cpus", type=float, default=0.5,
                   help="CPUs reserved for the driver and each runner and learner, so that points fit on small "
                        "machines; processes use what they can get (default: 0.5)")
    add_node_arguments(q)  # RLlib gives each aggregator actor 1 CPU: more than 2 need more CPUs than this machine has
    q.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    points = _points(args)
    if args.experiment is None:
        args.experiment = DEFAULT_EXPERIMENT
    from rlplatform.adapter.algorithm_config import check
    from rlplatform.config.experiment import resolve_experiment

    base = resolve_experiment(args.experiment, args.overrides, args.profile).config
    for point in points:  # every point's experiment as it will run, checked before any run starts
        check(resolve_experiment(args.experiment, [*args.overrides, *point_overrides(args, point)], args.profile).config)
    root = bench_dir(args.output, "ingest", base.name)
    rows = []
    with node_cluster(args, "ingest") as cluster:
        for point in points:
            console.say(f"ingest: {point} ...")
            row = measure_point(args, point, root / point.key, cluster)
            rows.append(row)
            console.say(_row_line(row))
    result = {"experiment": base.name, "env": INGEST_ENV, "runners": args.runners, "envs_per_runner": args.envs_per_runner,
              "obs_size": args.obs_size, "seconds": args.seconds, "cpus": args.cpus, "overrides": args.overrides,
              "nodes": args.nodes, "node_cpus": args.node_cpus if args.nodes else None,
              "points": rows, "fit": fit_fragment_costs(rows), "timestamp": time.time()}
    path = write_json(root / "ingest.json", result)
    plot(result, root / "ingest.png")
    print_tables(result)
    console.say(f"written: {path}, {root / 'ingest.png'}")
    return 1 if any(r.get("error") for r in rows) else 0


def _points(args: argparse.Namespace) -> list[Point]:
    if min(args.episode_lens + args.fragments) < 1 or args.runners < 1 or args.envs_per_runner < 1 or args.obs_size < 1:
        raise UserError("--episode-lens, --fragments, --runners, --envs-per-runner and --obs-size take counts >= 1")
    if min(args.aggregators + args.learners) < 0:
        raise UserError("--aggregators and --learners take counts >= 0")
    if args.seconds <= 0 or args.interval <= 0 or args.cpus <= 0:
        raise UserError("--seconds, --interval and --cpus must be > 0")
    check_nodes(args)
    points = []
    for algorithm, episode_len, fragment, aggregators, learners in itertools.product(
            args.algorithms, args.episode_lens, args.fragments, sorted(set(args.aggregators)), sorted(set(args.learners))):
        if aggregators and algorithm not in AGGREGATOR_ALGORITHMS:
            continue  # aggregator actors are APPO's and IMPALA's
        points.append(Point(algorithm, episode_len, fragment, aggregators, learners))
    if not points:
        raise UserError("no point to measure: aggregators > 0 need APPO or IMPALA")
    return points


def point_overrides(args: argparse.Namespace, point: Point) -> list[str]:
    """One sample of every env per learner's batch (RLlib hands each learner whole samples), one epoch over it in one
    minibatch: the pipeline's cost, not SGD's."""
    batch = args.runners * args.envs_per_runner * point.fragment
    training = f"{{train_batch_size_per_learner: {batch}, minibatch_size: {batch}, num_epochs: 1}}"
    return [
        f"algorithm={point.algorithm}", f"env={INGEST_ENV}",
        f"env_config={{episode_len: {point.episode_len}, obs_size: {args.obs_size}}}", f"training={training}",
        f"scale.env_runners={args.runners}", f"scale.envs_per_runner={args.envs_per_runner}",
        f"scale.rollout_fragment_length={point.fragment}", f"scale.learners={point.learners}",
        f"scale.aggregators_per_learner={point.aggregators}",
        f"hardware.driver_cpus={args.cpus:g}", f"hardware.cpus_per_env_runner={args.cpus:g}",
        f"hardware.cpus_per_learner={args.cpus:g}",
        f"rllib.reporting={{min_time_s_per_iteration: {MIN_ITERATION_S:g}}}",
        # iterations, not wall time: start-up (5-15 s on 2 cores) is not measured and must not eat the measured time
        f"stop.iterations={WARMUP_ITERATIONS + math.ceil(args.seconds / MIN_ITERATION_S)}", "stop.wall_time_s=null",
        "stop.return_mean=null", "stop.env_steps=null",
        "checkpoint.every=0", "evaluation.interval=0",
        "scale.algorithm_in=actor",  # its own process: the driver's CPU and training_step's are read apart
    ]


def measure_point(args: argparse.Namespace, point: Point, run_root: Path,
                  cluster: Optional[LoopbackCluster] = None) -> dict[str, Any]:
    proc, started = start(train_command(args, run_root, point_overrides(args, point)), run_root,
                          env=cluster.head.env if cluster else None)
    samples = sample_processes(lambda: run_processes(proc.pid, cluster), read_cpu, started, args.interval, poll=proc.poll,
                               machine=machine_cpu)
    run_ = finish(proc, started, run_root, run_root, timeout_s=args.seconds + 300)
    steps_per_fragment = args.envs_per_runner * point.fragment
    row: dict[str, Any] = {**vars(point), "steps_per_fragment": steps_per_fragment, "run_dir": str(run_.run_dir)}
    if run_.returncode != 0:
        return {**row, "error": run_.failure()}
    figures = role_costs(samples, run_.metrics, steps_per_fragment)
    if figures is None:
        return {**row, "error": "fewer than two iterations inside the sampled window: raise --seconds"}
    processes = figures.pop("processes")
    row.update(figures)
    row["learner_host_us_per_step"] = learner_host_cost(row, point)
    row["ceilings"] = ceilings(row["us_per_step"], processes)
    row["processes"] = processes
    capped = min(row["ceilings"].items(), key=lambda kv: kv[1]) if row["ceilings"] else None
    row["capped_by"], row["ceiling_env_steps_per_s"] = capped if capped else (None, None)
    return row


def learner_host_cost(row: dict[str, Any], point: Point) -> Optional[float]:
    """The learner's CPU per env step outside its gradient steps (connectors, batch assembly, copies, metrics): its
    process's cost less the gradient steps' CPU. With the learner in the algorithm's process, that process's
    training_step work is in it too."""
    role = "learner" if point.learners else "algorithm + local learner"
    gradient = row.get("gradient_us_per_step")
    return None if gradient is None or role not in row["us_per_step"] else row["us_per_step"][role] - gradient


def machine_cpu() -> dict[str, Any]:
    """The whole machine's busy CPU seconds (every process's, ours or not), for comparison with the roles' sum."""
    import psutil

    times = psutil.cpu_times()
    return {"machine_busy_s": sum(times) - times.idle - getattr(times, "iowait", 0.0)}


def role_of_sample(role: str) -> str:
    return role if role in PIPELINE_ROLES else "ray"


def _steps_at(metrics: list[dict[str, Any]], t: float, key: str = "env_steps") -> float:
    """Env steps sampled (or another running total) by time `t` (seconds since the command started), linear
    between the iterations' rows."""
    points = [(m["wall_time_s"], float(m[key])) for m in metrics]
    for (t0, s0), (t1, s1) in zip(points, points[1:]):
        if t0 <= t <= t1:
            return s0 + (s1 - s0) * (t - t0) / (t1 - t0) if t1 > t0 else s1
    raise ValueError(f"{t:.1f} s is outside the iterations ({points[0][0]:.1f}-{points[-1][0]:.1f} s)")


def _gradient_cpu(metrics: list[dict[str, Any]], start: float, end: float) -> Optional[float]:
    """The learners' CPU seconds in gradient steps between two times (the lean learners log a running total; an
    iteration without a learner result carries the last one); None where it is not logged over the whole window."""
    rows, last = [], None
    for m in metrics:
        last = m.get(GRADIENT_KEY, last)
        if last is not None:
            rows.append({"wall_time_s": m["wall_time_s"], GRADIENT_KEY: last})
    try:
        return _steps_at(rows, end, GRADIENT_KEY) - _steps_at(rows, start, GRADIENT_KEY) if len(rows) >= 2 else None
    except ValueError:  # the window starts before the first logged total
        return None


def role_costs(samples: list[dict[str, Any]], metrics: list[dict[str, Any]],
               steps_per_fragment: int) -> Optional[dict[str, Any]]:
    """Each role's CPU over the window from the first iteration's end (start-up and warm-up before it) to the last's:
    microseconds per env step sampled and per fragment, percent of a core, and the processes of each role."""
    flowing = [m for m in metrics if m["env_steps"] > 0]  # from the first iteration that sampled
    if len(flowing) < 2:
        return None
    start, end = flowing[0]["wall_time_s"], flowing[-1]["wall_time_s"]
    inside = [s for s in samples if start <= s["t"] <= end]
    if len(inside) < 2:
        return None
    first, last = inside[0], inside[-1]
    steps = _steps_at(flowing, last["t"]) - _steps_at(flowing, first["t"])
    seconds = last["t"] - first["t"]
    if steps <= 0 or seconds <= 0:
        return None
    cpu: dict[str, float] = {}
    processes: dict[str, int] = {}
    for pid, entry in last["processes"].items():
        before = first["processes"].get(pid)
        if before is None:  # started inside the window: all of its CPU is the window's
            before = {"cpu_s": 0.0}
        role = role_of_sample(entry["role"])
        cpu[role] = cpu.get(role, 0.0) + entry["cpu_s"] - before["cpu_s"]
        processes[role] = processes.get(role, 0) + 1
    total = sum(cpu.values())
    machine = (last["machine_busy_s"] - first["machine_busy_s"]) if "machine_busy_s" in first else None
    gradient = _gradient_cpu(flowing, first["t"], last["t"])
    return {
        "window_s": seconds, "env_steps": steps, "env_steps_per_s": steps / seconds,
        "gradient_us_per_step": None if gradient is None else 1e6 * gradient / steps,
        "us_per_step": {role: 1e6 * c / steps for role, c in cpu.items()},
        "ms_per_fragment": {role: 1e3 * c * steps_per_fragment / steps for role, c in cpu.items()},
        "cpu_percent": {role: 100 * c / seconds for role, c in cpu.items()},
        "cpu_s": cpu, "cpu_s_total": total, "machine_busy_s": machine, "processes": processes,
    }


def ceilings(us_per_step: dict[str, float], processes: dict[str, int]) -> dict[str, float]:
    """Env steps/s each pipeline role could carry with one core per process: cores / cost per step."""
    return {role: processes[role] * 1e6 / cost for role, cost in us_per_step.items()
            if role in PIPELINE_ROLES and cost > 0}


def fit_fragment_costs(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Where two points differ only in the fragment: each role's cost = per step x steps + per fragment, solved from the
    two (CPU per fragment against steps per fragment; the shortest and longest fragment where there are more)."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in rows:
        if not r.get("error"):
            groups.setdefault((r["algorithm"], r["episode_len"], r["aggregators"], r["learners"]), []).append(r)
    fits = []
    for (algorithm, episode_len, aggregators, learners), members in groups.items():
        members = sorted(members, key=lambda r: r["fragment"])
        if len(members) < 2 or members[0]["fragment"] == members[-1]["fragment"]:
            continue
        short, long_ = members[0], members[-1]
        steps_short, steps_long = short["steps_per_fragment"], long_["steps_per_fragment"]
        per_role = {}
        for role in set(short["ms_per_fragment"]) & set(long_["ms_per_fragment"]):
            c_short, c_long = short["ms_per_fragment"][role] / 1e3, long_["ms_per_fragment"][role] / 1e3
            per_step = (c_long - c_short) / (steps_long - steps_short)
            per_role[role] = {"us_per_step": 1e6 * per_step, "ms_per_fragment": 1e3 * (c_short - per_step * steps_short)}
        fits.append({"algorithm": algorithm, "episode_len": episode_len, "aggregators": aggregators, "learners": learners,
                     "fragments": [short["fragment"], long_["fragment"]], "roles": per_role})
    return fits


def _row_line(row: dict[str, Any]) -> str:
    if row.get("error"):
        return f"  failed: {row['error']}"
    costs = ", ".join(f"{role} {row['us_per_step'][role]:.1f}" for role in PIPELINE_ROLES if role in row["us_per_step"])
    if row.get("gradient_us_per_step") is not None:
        costs += f" (gradient steps {row['gradient_us_per_step']:.1f}, learner host side {row['learner_host_us_per_step']:.1f})"
    return (f"  {row['env_steps_per_s']:,.0f} env steps/s; CPU us per env step: {costs}; "
            f"capped by {row['capped_by']} at {row['ceiling_env_steps_per_s']:,.0f} env steps/s")


def _fmt(value: Optional[float], spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_tables(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    roles = [*PIPELINE_ROLES, "ray"]
    table = Table(title=f"bench ingest: CPU us per env step by role ({result['runners']} runner(s) x "
                        f"{result['envs_per_runner']} envs, Firehose, obs {result['obs_size']})")
    for column in ("algorithm", "episode", "fragment", "agg/learner", "learners", "env steps/s", *roles,
                   "gradient", "learner host", "capped by", "ceiling"):
        table.add_column(column, justify="right")
    for r in result["points"]:
        name = (r["algorithm"], str(r["episode_len"]), str(r["fragment"]), str(r["aggregators"]), str(r["learners"]))
        if r.get("error"):
            table.add_row(*name, "failed", *[""] * (len(roles) + 4))
            continue
        table.add_row(*name, f"{r['env_steps_per_s']:,.0f}", *(_fmt(r["us_per_step"].get(k), ".1f") for k in roles),
                      _fmt(r.get("gradient_us_per_step"), ".1f"), _fmt(r.get("learner_host_us_per_step"), ".1f"),
                      str(r["capped_by"]), _fmt(r["ceiling_env_steps_per_s"], ",.0f"))
    fits = Table(title="per env step (us) + per fragment (ms), from two fragment lengths")
    for column in ("algorithm", "episode", "agg/learner", "learners", *PIPELINE_ROLES):
        fits.add_column(column, justify="right")
    for f in result["fit"]:
        fits.add_row(f["algorithm"], str(f["episode_len"]), str(f["aggregators"]), str(f["learners"]),
                     *(f"{f['roles'][k]['us_per_step']:.1f} + {f['roles'][k]['ms_per_fragment']:.2f}"
                       if k in f["roles"] else "-" for k in PIPELINE_ROLES))
    out = console.stdout if console.stdout.is_terminal else Console(highlight=False, width=170)
    out.print(table)
    if result["fit"]:
        out.print(fits)


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["points"] if not r.get("error")]
    fig, ax = plt.subplots(figsize=(10, 1.5 + 0.45 * max(1, len(rows))))
    labels = [f"{r['algorithm']} e{r['episode_len']} f{r['fragment']} a{r['aggregators']} l{r['learners']}" for r in rows]
    left = [0.0] * len(rows)
    for role in [*PIPELINE_ROLES, "ray"]:
        values = [r["us_per_step"].get(role, 0.0) for r in rows]
        if any(values):
            ax.barh(labels, values, left=left, label=role)
            left = [a + b for a, b in zip(left, values)]
    ax.set_xlabel("CPU microseconds per env step sampled")
    ax.set_title("bench ingest: where an env step's CPU goes (Firehose: the env itself costs next to nothing)")
    ax.invert_yaxis()
    ax.legend(fontsize="small", loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)

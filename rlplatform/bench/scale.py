"""`rlplatform bench scale [EXPERIMENT] --runners 1 2 4 8 16 32 [--nodes N] [--model small large]`: what
coordinating many env runners costs.

The env runners step `rlplatform/CostlySim-v0` with `wait_ms` of sleeping and no CPU work per step, like an
external simulator, a robot or a game server: a runner then costs almost no CPU, dozens fit on two cores, and
whatever keeps a run from the ideal throughput (runners x envs x 1000 / wait_ms env steps/s) is the platform's
coordination. For each runner count (and model, and fragment length) one real `train` process trains the
experiment (learning on) for a few iterations, each of `--fragment` env steps per env, so every iteration
waits the same time in the envs whatever the runner count. Per iteration, from the run's metrics: sampling
throughput against the ideal, the time to gather the samples beyond the envs' own, the learner's time, the
weight broadcast (the driver's part, and the slowest runner's applying them), the rest of RLlib's iteration, and
the bytes moved through Ray's object stores. From the processes, sampled every `--interval` seconds: CPU of
the driver, the algorithm's process and all runners, and each runner's resident and private memory (USS:
private clean + private dirty pages). From the run's manifest: when the first batch was sampled. With `--nodes
N` the runners spread over N Ray nodes on loopback addresses, a head and N-1 workers (`infra/loopback.py`), as
`bench soak --nodes N` counts them.

`bench scale --fit FILE [FILE ...]` fits the cost model (docs/scale.md) to the points of earlier runs and
extrapolates it. Results: `<output>/scale-<name>-<time>/scale.json`, `scale.png`, and a table.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from rlplatform import console
from rlplatform.bench.processes import (
    add_node_arguments,
    check_nodes,
    node_cluster,
    read_cpu,
    run_processes,
    sample_processes,
)
from rlplatform.bench.training_runs import (
    add_training_arguments,
    bench_dir,
    finish,
    median,
    start,
    train_command,
    write_json,
)
from rlplatform.config.experiment import resolve_experiment
from rlplatform.config.schema import ASYNCHRONOUS_ALGORITHMS
from rlplatform.errors import UserError

DEFAULT_EXPERIMENT = Path("experiments/costly_sim_ppo.yaml")
SCALE_ENV = "rlplatform/CostlySim-v0"
LARGE_HIDDEN = [1536, 1536]  # the policy path alone (encoder + logits) is 2.4M parameters, 9.5 MB of float32
OBS_DIM, N_ACTIONS = 3, 3  # CostlySim's observation and action sizes
SAMPLED_ROLES = ("driver", "algorithm + local learner", "env runner", "learner", "relay")


@dataclass(frozen=True)
class Point:
    runners: int
    model: str
    fragment: int

    def __str__(self) -> str:
        return f"{self.runners} runner(s), {self.model} model, fragment {self.fragment}"


def add_verb(verbs: Any) -> None:  # argparse's sub-parsers action
    q = verbs.add_parser("scale", help="the coordination cost of many env runners (and nodes): throughput against the ideal, "
                                       "time split, broadcast, CPU, memory per runner; --fit: the cost model")
    add_training_arguments(q, default_experiment=str(DEFAULT_EXPERIMENT), address=False)  # the processes are read here
    q.add_argument("--runners", nargs="+", type=int, default=[1, 2, 4, 8, 16, 32], metavar="N",
                   help="env runner counts to measure (default: 1 2 4 8 16 32)")
    q.add_argument("--model", nargs="+", choices=("small", "large"), default=["small"],
                   help="small: the experiment's model; large: hidden [1536, 1536], 2.4M parameters to broadcast "
                        "(trained one epoch per batch) (default: small)")
    q.add_argument("--fragments", nargs="+", type=int, default=[40], metavar="STEPS",
                   help="env steps per env per iteration (default: 40, 2 s of waiting at 50 ms)")
    q.add_argument("--wait-ms", type=float, default=50.0, help="sleep per env step (default: 50)")
    q.add_argument("--envs-per-runner", type=int, default=1, help="envs per runner (default: 1)")
    q.add_argument("--runner-cpus", type=float,
                   help="CPUs reserved per runner (default: what lets the largest count fit beside the driver)")
    q.add_argument("--iterations", type=int, default=5, help="measured iterations per point, after one warm-up (default: 5)")
    add_node_arguments(q)
    q.add_argument("--interval", type=float, default=2.0, help="seconds between CPU and memory samples (default: 2)")
    q.add_argument("--fit", nargs="+", type=Path, metavar="SCALE_JSON",
                   help="fit the cost model to the points of these scale.json files and extrapolate (no runs)")
    q.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.fit:
        from rlplatform.bench import scale_model

        return scale_model.run_fit(args.fit, args.output)
    _check_arguments(args)
    if args.experiment is None:
        args.experiment = DEFAULT_EXPERIMENT
    from rlplatform.adapter.algorithm_config import check

    base = resolve_experiment(args.experiment, args.overrides, args.profile).config
    nodes = [args.node_cpus] * args.nodes if args.nodes else [float(_host_cpus())]  # head first
    total_cpus = sum(nodes)
    runner_cpus = args.runner_cpus or _runner_cpus(base, nodes, max(args.runners))
    points = [Point(n, m, f) for m in args.model for f in args.fragments for n in sorted(set(args.runners))]
    for point in points:  # every point's experiment as it will run, checked before any run starts
        check(resolve_experiment(args.experiment, [*args.overrides, *point_overrides(args, base, point, runner_cpus)],
                                 args.profile).config)
    root = bench_dir(args.output, "scale", base.name)
    rows: list[dict[str, Any]] = []
    with node_cluster(args, "scale") as cluster:
        for point in points:
            console.say(f"scale: {point}, {runner_cpus:g} CPU each, {args.wait_ms:g} ms per env step ...")
            row = measure_point(args, base, point, runner_cpus, root / f"{point.model}-f{point.fragment}-r{point.runners}", cluster)
            rows.append(row)
            console.say(_row_line(row))
    result = {"experiment": base.name, "algorithm": base.algorithm, "env": SCALE_ENV, "wait_ms": args.wait_ms,
              "envs_per_runner": args.envs_per_runner, "runner_cpus": runner_cpus, "nodes": args.nodes,
              "cluster_cpus": total_cpus, "host_cpus": _host_cpus(), "iterations": args.iterations,
              "overrides": args.overrides, "points": rows, "timestamp": time.time()}
    path = write_json(root / "scale.json", result)
    plot(result, root / "scale.png")
    print_table(result)
    console.say(f"written: {path}, {root / 'scale.png'}")
    return 1 if any(r.get("error") for r in rows) else 0


def _check_arguments(args: argparse.Namespace) -> None:
    if any(n < 1 for n in args.runners) or any(f < 1 for f in args.fragments):
        raise UserError("--runners and --fragments take counts >= 1")
    if args.wait_ms <= 0 or args.envs_per_runner < 1 or args.iterations < 1 or args.interval <= 0:
        raise UserError("--wait-ms and --interval must be > 0, --envs-per-runner and --iterations >= 1")
    if args.runner_cpus is not None and not 0 < args.runner_cpus <= 64:
        raise UserError(f"--runner-cpus must be > 0, not {args.runner_cpus:g}")
    check_nodes(args)


def _host_cpus() -> int:
    import os

    return len(os.sched_getaffinity(0))


def _runner_cpus(config, node_cpus: list[float], runners: int) -> float:
    """The largest share, in hundredths of a CPU, that lets `runners` fit on the nodes (the first one, the
    head, also holds the driver and the learners): every runner's bundle must fit whole on one node."""
    import math

    from rlplatform.config.sizing import learner_cpu_demand

    hw = config.hardware
    free = [node_cpus[0] - learner_cpu_demand(config.scale.learners, hw.cpus_per_learner, hw.gpus_per_learner, hw.driver_cpus),
            *node_cpus[1:]]
    share = min(1.0, math.floor(100 * sum(free) / runners) / 100)
    while share >= 0.01 and sum(math.floor(f / share + 1e-9) for f in free if f > 0) < runners:
        share = round(share - 0.01, 2)
    if share < 0.01:
        raise UserError(f"{runners} runners do not fit in {sum(free):g} free CPUs (the driver and learners take the rest); "
                        "use fewer runners, more --nodes, or --runner-cpus")
    return share


def point_overrides(args: argparse.Namespace, base, point: Point, runner_cpus: float) -> list[str]:
    batch = point.runners * args.envs_per_runner * point.fragment
    overrides = [
        f"env={SCALE_ENV}", f"env_config={{work_ms: 0, wait_ms: {args.wait_ms:g}}}",
        f"scale.env_runners={point.runners}", f"scale.envs_per_runner={args.envs_per_runner}",
        f"scale.rollout_fragment_length={point.fragment}", f"hardware.cpus_per_env_runner={runner_cpus:g}",
        f"training.train_batch_size_per_learner={batch}",
        f"stop.iterations={args.iterations + 1}", "stop.return_mean=null", "stop.env_steps=null", "stop.wall_time_s=null",
        "checkpoint.every=0", "evaluation.interval=0",
        "scale.algorithm_in=actor",  # its own process: the driver's CPU and the algorithm's are read apart
    ]
    minibatch = base.training.get("minibatch_size")
    if point.model == "large":
        overrides += [f"model.hidden=[{', '.join(map(str, LARGE_HIDDEN))}]", "training.num_epochs=1", f"training.minibatch_size={batch}"]
    elif minibatch is not None and minibatch > batch:
        overrides.append(f"training.minibatch_size={batch}")
    if args.nodes:
        overrides.append("scale.placement=spread")
    return overrides


def measure_point(args: argparse.Namespace, base, point: Point, runner_cpus: float, run_root: Path, cluster) -> dict[str, Any]:
    overrides = point_overrides(args, base, point, runner_cpus)
    proc, started = start(train_command(args, run_root, overrides), run_root, env=cluster.head.env if cluster else None)
    samples = sample_processes(lambda: run_processes(proc.pid, cluster), read_usage, started, args.interval, poll=proc.poll)
    run_ = finish(proc, started, run_root, run_root, timeout_s=600)
    row: dict[str, Any] = {"runners": point.runners, "model": point.model, "fragment": point.fragment,
                           "envs_per_runner": args.envs_per_runner, "run_dir": str(run_.run_dir),
                           "policy_mb": policy_megabytes(LARGE_HIDDEN if point.model == "large" else base.model.hidden)}
    if run_.returncode != 0:
        return {**row, "error": run_.failure()}
    # Each row's env steps of its own iteration; the first iteration (envs built, first weights) is the warm-up.
    measured = [{**m, "steps": m["env_steps"] - before["env_steps"]}
                for before, m in zip(run_.metrics, run_.metrics[1:]) if m["iteration"] == before["iteration"] + 1]
    if not measured:
        return {**row, "error": "no iteration after the warm-up was recorded"}
    ideal = point.runners * args.envs_per_runner * 1000.0 / args.wait_ms
    row.update(iteration_figures(measured, point.fragment * args.wait_ms / 1000.0, ideal,
                                 asynchronous=base.algorithm in ASYNCHRONOUS_ALGORITHMS))
    window = (run_.metrics[0]["wall_time_s"], measured[-1]["wall_time_s"])
    row.update(process_figures(samples, window, args.interval))
    row["cpu_s_per_iteration"] = {role: pct / 100 * (window[1] - window[0]) / len(measured)
                                  for role, pct in (row["cpu_percent"] or {}).items()}
    config = resolve_experiment(args.experiment, [*args.overrides, *overrides], args.profile).config
    row.update(learners=config.scale.learners, runners_per_relay=config.scale.runners_per_relay,
               relays=relay_count(config, row["runner_memory"]))
    row.update({f"startup_{k}": v for k, v in (run_.manifest.get("startup") or {}).items()})
    return row


def relay_count(config, runners: list[dict[str, Any]]) -> int:
    """The relays `LeanPPO` builds (internals/lean_ppo.py): where the run uses them, one per group of at most
    `runners_per_relay` runners on a node (the runners' nodes as read from their processes)."""
    import math

    from rlplatform.adapter import speedups

    gated = speedups.gated(config)
    if "sample_relays" not in speedups.manifest_record(gated.speedups, gated, local_instance=True)["active"]:
        return 0
    per_node: dict[str, int] = {}
    for runner in runners:
        per_node[runner["node"]] = per_node.get(runner["node"], 0) + 1
    return sum(math.ceil(n / config.scale.runners_per_relay) for n in per_node.values())


def iteration_figures(measured: list[dict[str, Any]], env_time_s: float, ideal: float, asynchronous: bool = False) -> dict[str, Any]:
    """Throughput and the split of an iteration's time, over the measured iterations (medians per iteration).

    An asynchronous algorithm (APPO, IMPALA) samples all the time and its sampling timer only collects what
    is ready: its sampling throughput is the env steps of the iteration over its wall time, and its
    iteration has no split into the envs' time and the rest.
    """

    def med(key: str) -> Optional[float]:
        return median([m[key] for m in measured if m.get(key) is not None])

    steps = sum(m["steps"] for m in measured)
    sample_s = sum(m["time/iteration_s"] if asynchronous else m["time/sample_s"] for m in measured)
    sampling = steps / sample_s if sample_s else None
    figures = {"iterations": len(measured), "env_steps_per_iteration": steps / len(measured), "ideal_env_steps_per_s": ideal,
               "sampling_env_steps_per_s": sampling, "of_ideal": sampling / ideal if sampling else None,
               "training_env_steps_per_s": steps / sum(m["time/iteration_s"] for m in measured),
               "iteration_s": med("time/iteration_s"), "sample_s": med("time/sample_s"), "env_time_s": env_time_s,
               "learn_s": med("time/learn_s"), "sync_weights_s": med("time/sync_weights_s"),
               "weights_apply_s": med("time/weights_apply_s")}
    figures["asynchronous"] = asynchronous
    figures["gather_s"] = None if asynchronous else figures["sample_s"] - env_time_s  # beyond the envs' own waiting
    known = sum(figures[k] or 0.0 for k in ("sample_s", "learn_s", "sync_weights_s"))
    figures["other_s"] = None if asynchronous else figures["iteration_s"] - known
    figures["broadcast_s"] = (figures["sync_weights_s"] or 0.0) + (figures["weights_apply_s"] or 0.0)
    created = [m["ray/object_store_created_gb"] for m in measured if m.get("ray/object_store_created_gb") is not None]
    figures["object_store_mb_per_iteration"] = (1024 * (created[-1] - created[0]) / (len(created) - 1)
                                                if len(created) >= 2 else None)
    return figures


def read_usage(proc, role: str) -> dict[str, Any]:
    """CPU seconds of every process of the run; RSS and USS of the driver, the algorithm's process, runners and learners."""
    entry = read_cpu(proc, role)
    if role in SAMPLED_ROLES:
        mem = proc.memory_full_info()
        entry.update(rss=mem.rss, uss=mem.uss)
    return entry


def process_figures(samples: list[dict[str, Any]], window: tuple[float, float], interval_s: float) -> dict[str, Any]:
    """CPU per role over the measured window (percent of one core: each process from its first to its last
    sample in the window, widened by one interval so that short windows still hold two samples) and the
    runners' memory at the window's end."""
    inside = [s for s in samples if window[0] - interval_s <= s["t"] <= window[1] + interval_s]
    seen: dict[str, list[tuple[float, dict[str, Any]]]] = {}
    for sample in inside:
        for pid, entry in sample["processes"].items():
            seen.setdefault(pid, []).append((sample["t"], entry))
    cpu: dict[str, float] = {}
    for series in seen.values():
        (t0, first), (t1, last) = series[0], series[-1]
        if t1 > t0:
            role = last["role"] if last["role"] in SAMPLED_ROLES else "ray"
            cpu[role] = cpu.get(role, 0.0) + 100 * (last["cpu_s"] - first["cpu_s"]) / (t1 - t0)
    # Each runner's last reading in the window that has its memory (on a loaded host one sample may miss it).
    last = {pid: next((e for _, e in reversed(series) if e["role"] == "env runner" and "uss" in e), series[-1][1])
            for pid, series in seen.items()}
    runners = [e for e in last.values() if e["role"] == "env runner" and "uss" in e]
    mb = 2**20
    return {"cpu_percent": cpu or None, "runner_processes": len(runners),
            "runner_memory": [{"pid": int(pid), "node": e["node"], "rss_mb": e["rss"] / mb, "uss_mb": e["uss"] / mb}
                              for pid, e in last.items() if e in runners],
            "runner_rss_mb": median([e["rss"] / mb for e in runners]), "runner_uss_mb": median([e["uss"] / mb for e in runners]),
            "runner_uss_max_mb": max((e["uss"] / mb for e in runners), default=None),
            "runner_nodes": sorted({e["node"] for e in runners})}


def policy_megabytes(hidden: list[int]) -> float:
    """float32 weights of the policy path an env runner receives (encoder layers and the logits layer)."""
    sizes = [OBS_DIM, *hidden, N_ACTIONS]
    return sum((a + 1) * b for a, b in zip(sizes, sizes[1:])) * 4 / 2**20


def _row_line(row: dict[str, Any]) -> str:
    if row.get("error"):
        return f"  {row['runners']} runners: failed: {row['error']}"
    return (f"  {row['runners']} runners: {row['sampling_env_steps_per_s']:,.0f} env steps/s sampling "
            f"({row['of_ideal']:.0%} of ideal), {row['training_env_steps_per_s']:,.0f} training; iteration "
            f"{row['iteration_s']:.2f} s; runner USS {_fmt(row.get('runner_uss_mb'), '.0f')} MB")


def _fmt(value: Optional[float], spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_table(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"bench scale: {result['algorithm']} on CostlySim, {result['wait_ms']:g} ms per step, "
                        f"{result['envs_per_runner']} env(s) per runner, "
                        + (f"{result['nodes']} loopback nodes" if result["nodes"] else "a private local instance"))
    time_columns = ("runners", "model", "sampling steps/s", "of ideal", "training steps/s", "iteration s", "gather s",
                    "learn s", "weights: sync s", "apply s", "other s")
    for column in time_columns:
        table.add_column(column, justify="right")
    usage = Table(title="per iteration: object-store traffic; CPU (% of a core) over the measured iterations; runner memory")
    usage_columns = ("runners", "model", "store MB", "CPU driver", "algorithm", "runners", "relays", "learner", "ray",
                     "runner RSS MB", "runner USS MB", "first batch s")
    for column in usage_columns:
        usage.add_column(column, justify="right")
    for r in result["points"]:
        name = (str(r["runners"]), f"{r['model']} f{r['fragment']}")
        if r.get("error"):
            table.add_row(*name, "failed", *[""] * (len(time_columns) - 3))
            continue
        table.add_row(
            *name, f"{r['sampling_env_steps_per_s']:,.0f}", f"{r['of_ideal']:.0%}", f"{r['training_env_steps_per_s']:,.0f}",
            f"{r['iteration_s']:.2f}", _fmt(r["gather_s"], ".2f"), _fmt(r["learn_s"], ".2f"), _fmt(r["sync_weights_s"], ".3f"),
            _fmt(r["weights_apply_s"], ".3f"), _fmt(r["other_s"], ".2f"))
        cpu = r.get("cpu_percent") or {}
        usage.add_row(*name, _fmt(r["object_store_mb_per_iteration"], ".2f"),
                      *(_fmt(cpu.get(k), ".0f") for k in ("driver", "algorithm + local learner", "env runner", "relay", "learner", "ray")),
                      _fmt(r.get("runner_rss_mb"), ".0f"), _fmt(r.get("runner_uss_mb"), ".0f"),
                      _fmt(r.get("startup_first_sample_s"), ".1f"))
    # Piped into a file, rich would squeeze the columns into 80 characters.
    out = console.stdout if console.stdout.is_terminal else Console(highlight=False, width=150)
    out.print(table)
    out.print(usage)


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
    parts = (("env_time_s", "envs' own waiting"), ("gather_s", "gather beyond it"), ("learn_s", "learn"),
             ("sync_weights_s", "weights: driver"), ("other_s", "rest of the iteration"))
    series = sorted({(r["model"], r["fragment"]) for r in result["points"] if not r.get("error")})
    for model, fragment in series:
        rows = sorted((r for r in result["points"] if (r["model"], r["fragment"]) == (model, fragment) and not r.get("error")),
                      key=lambda r: r["runners"])
        n = [r["runners"] for r in rows]
        left.plot(n, [r["sampling_env_steps_per_s"] for r in rows], "o-", label=f"sampling, {model} model, fragment {fragment}")
        left.plot(n, [r["training_env_steps_per_s"] for r in rows], "s--", label=f"training, {model} model, fragment {fragment}")
    ideal = sorted({(r["runners"], r["ideal_env_steps_per_s"]) for r in result["points"] if not r.get("error")})
    if ideal:
        left.plot(*zip(*ideal), "k:", label="ideal (runners x envs x 1000 / wait_ms)")
    left.set_xscale("log", base=2)
    left.set_yscale("log")
    left.set_xlabel("env runners")
    left.set_ylabel("env steps/s")
    left.set_title("Throughput against the ideal")
    left.legend(fontsize="small")
    if series:
        model, fragment = series[0]
        rows = sorted((r for r in result["points"] if (r["model"], r["fragment"]) == (model, fragment) and not r.get("error")),
                      key=lambda r: r["runners"])
        labels = [str(r["runners"]) for r in rows]
        bottom = [0.0] * len(rows)
        for key, label in parts:
            values = [max(0.0, r.get(key) or 0.0) for r in rows]
            right.bar(labels, values, bottom=bottom, label=label)
            bottom = [b + v for b, v in zip(bottom, values)]
        right.set_title(f"Where an iteration's time goes ({model} model, fragment {fragment})")
    right.set_xlabel("env runners")
    right.set_ylabel("seconds per iteration")
    right.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)

"""`rlplatform bench throughput [EXPERIMENT]`: where does sampling time go?

First the raw limit: the experiment's env stepped with random actions in one process (a gymnasium
SyncVectorEnv), no Ray, no policy. Then the platform: for each layout (env runners x envs per runner
x sync/async vectorisation) real RLlib EnvRunner actors, built from the experiment exactly as
training builds them, sample with the policy in the loop and learning off. The table gives env
steps/s and the ratio to the raw limit per env-runner core, and the runners' own CPU time per env
step (each runner process's CPU, read inside it) with the ratio to the raw limit per second of that
CPU: on a machine where the runners share cores with the driver, the second ratio is the runner's cost.
A third ratio takes the raw step's CPU cost inside each runner's own process (as many sub-envs in one
SyncVectorEnv as the runner has), just before and just after its sampling window: the host's speed moves
within minutes, and this one compares like with like. It is left out (n/a) for async layouts, whose envs
step in subprocesses that the runner's own CPU time does not count.
JSON and a PNG plot are written too.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

from rlplatform import console
from rlplatform.errors import UserError

LAYOUT = re.compile(r"^(\d+)x(\d+)(?:x(sync|async))?$")
DEFAULT_LAYOUTS = ["1x1", "1x8", "1x16", "1x64", "1x8xasync", "2x8", "2x32"]
RAW_ENVS = 16


@dataclass(frozen=True)
class Layout:
    env_runners: int
    envs_per_runner: int
    vectorize: str = "sync"

    @classmethod
    def parse(cls, text: str) -> "Layout":
        match = LAYOUT.match(text)
        if not match or int(match.group(1)) < 1 or int(match.group(2)) < 1:
            raise UserError(f"--layouts: {text!r} is not RUNNERSxENVS[xsync|xasync], e.g. 2x8 or 1x4xasync")
        return cls(int(match.group(1)), int(match.group(2)), match.group(3) or "sync")

    def __str__(self) -> str:
        return f"{self.env_runners}x{self.envs_per_runner}x{self.vectorize}"


def add_verb(verbs: Any) -> None:  # argparse's sub-parsers action
    q = verbs.add_parser("throughput", help="raw env steps/s, then RLlib sampling throughput per layout (learning off)")
    q.add_argument("experiment", nargs="?", type=Path, help="experiment YAML (default: experiments/cartpole_ppo.yaml)")
    q.add_argument("--layouts", nargs="+", default=DEFAULT_LAYOUTS, metavar="RxE[xMODE]",
                   help=f"env runners x envs per runner [x sync|async] (default: {' '.join(DEFAULT_LAYOUTS)})")
    q.add_argument("--seconds", type=float, default=10.0, help="measuring time per layout, after a warm-up (default: 10)")
    q.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help="as for train")
    q.add_argument("--address", help="measure on this Ray cluster (default: a private local instance)")
    q.add_argument("-o", "--output", type=Path, default=Path("bench"), help="directory for the JSON and PNG (default: bench)")
    q.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rlplatform.adapter.algorithm_config import check, is_multi_agent_env
    from rlplatform.config.experiment import resolve_experiment
    from rlplatform.config.layouts import record as record_layouts
    from rlplatform.infra import local_ray
    from rlplatform.infra.local_ray import local_resources

    if args.seconds <= 0:
        raise UserError(f"--seconds must be > 0, not {args.seconds:g}")
    layouts = [Layout.parse(text) for text in args.layouts]
    base = resolve_experiment(args.experiment, args.overrides, "laptop").config
    check(base)
    if is_multi_agent_env(base.env):
        raise UserError(f"bench throughput measures single-agent envs; {base.env!r} is multi-agent")
    args.output.mkdir(parents=True, exist_ok=True)

    raw = raw_steps_per_second(base.env, dict(base.env_config), args.seconds)
    console.say(f"raw limit: {raw:,.0f} env steps/s ({base.env}, {RAW_ENVS} envs in one SyncVectorEnv, one process)")
    resources = local_ray.connect(args.address, None if args.address else local_resources(), speedups=base.speedups)
    rows: list[dict[str, Any]] = []
    try:
        for layout in layouts:
            cpus = layout.env_runners * base.hardware.cpus_per_env_runner
            if cpus > resources.cpus:
                console.say(f"{layout}: skipped, needs {cpus:g} CPUs and the cluster has {resources.cpus:g}")
                continue
            config = resolve_experiment(args.experiment, [*args.overrides, *_layout_overrides(layout)], "laptop").config
            sampled = sample_runners(config, args.seconds)
            sps = sampled.steps / sampled.seconds
            cpu_us = 1e6 * sampled.runner_cpu_s / sampled.steps
            rows.append({**asdict(layout), "layout": str(layout), "env_steps_per_s": sps,
                         "ratio_to_raw_per_runner": sps / (raw * layout.env_runners),
                         "runner_cpu_us_per_step": cpu_us, "ratio_to_raw_per_runner_cpu": 1e6 / cpu_us / raw,
                         "raw_cpu_us_per_step_in_runner": sampled.raw_cpu_us,
                         # An async runner's envs step in subprocesses whose CPU its own process time leaves out.
                         "ratio_to_raw_in_runner": None if layout.vectorize == "async" else sampled.raw_cpu_us / cpu_us})
            console.say(f"{layout}: {sps:,.0f} env steps/s ({rows[-1]['ratio_to_raw_per_runner']:.0%} of raw per runner); "
                        f"runner CPU {cpu_us:.1f} us per env step ({rows[-1]['ratio_to_raw_per_runner_cpu']:.0%} of raw "
                        f"per runner CPU second; raw: {1e6 / raw:.1f} us); raw stepping in the runner's process "
                        f"{sampled.raw_cpu_us:.1f} us = {_percent(rows[-1]['ratio_to_raw_in_runner'])}")
    finally:
        local_ray.shutdown()
    _print_table(rows)
    result = {"env": base.env, "env_config": dict(base.env_config), "algorithm": base.algorithm, "host": platform.node(),
              "cpus": resources.cpus, "raw_env_steps_per_s": raw, "seconds_per_layout": args.seconds, "layouts": rows,
              "timestamp": time.time()}
    stem = args.output / f"throughput-{_slug(base.env)}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, stem.with_suffix(".png"))
    console.say(f"written: {stem.with_suffix('.json')}, {stem.with_suffix('.png')}")
    if rows:
        cache = record_layouts(resources.cpus, resources.gpus, base.env, dict(base.env_config), rows, stem.with_suffix(".json"))
        best = max(rows, key=lambda r: r["env_steps_per_s"] / r["env_runners"])
        console.say(f"best per runner: {best['layout']}; `train --profile auto` on this machine uses its envs per "
                               f"runner and vectorisation for {base.env} where an experiment leaves them open (cache: {cache})")
    return 0


def _layout_overrides(layout: Layout) -> list[str]:
    return [f"scale.env_runners={layout.env_runners}", f"scale.envs_per_runner={layout.envs_per_runner}",
            f"scale.vectorize={layout.vectorize}"]


def _slug(env: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", env.rpartition(":")[2])


def raw_steps_per_second(env: str, env_config: dict[str, Any], seconds: float) -> float:
    """Random actions through a SyncVectorEnv in this process: what the env itself can do on one core."""
    steps, wall_s, _ = step_randomly(env, env_config, seconds)
    return steps / wall_s


def step_randomly(env: str, env_config: dict[str, Any], seconds: float, num_envs: int = RAW_ENVS) -> tuple[int, float, float]:
    """Random actions through a SyncVectorEnv of `num_envs` envs in the calling process for about `seconds`:
    (env steps, wall seconds, this process's CPU seconds)."""
    import gymnasium as gym

    from rlplatform.config.env_ids import runner_env_id

    vec = gym.make_vec(runner_env_id(env), num_envs=num_envs, vectorization_mode="sync", **env_config)
    try:
        vec.reset(seed=0)
        vec.action_space.seed(0)
        for _ in range(20):  # warm-up
            vec.step(vec.action_space.sample())
        steps, start, cpu_start = 0, time.perf_counter(), time.process_time()
        while time.perf_counter() - start < seconds:
            for _ in range(50):
                vec.step(vec.action_space.sample())
            steps += 50 * num_envs
        return steps, time.perf_counter() - start, time.process_time() - cpu_start
    finally:
        vec.close()


@dataclass(frozen=True)
class Sampled:
    steps: int
    seconds: float
    runner_cpu_s: float  # all runner processes together, over the same window
    raw_cpu_us: float  # raw stepping's CPU per env step inside the runners' processes, just before and just after,
    # with as many sub-envs in one SyncVectorEnv as each runner has


def sample_runners(config, seconds: float) -> Sampled:
    """All env runners of the layout sample in parallel, policy in the loop, no learner.

    Two requests stay in flight per runner, so a runner samples the next fragment while the
    driver receives the last one (as an asynchronous algorithm keeps its runners busy). The window
    ends when the fragments in flight are back, so the runners' CPU time covers exactly the steps counted.
    """
    import ray

    from rlplatform.adapter.env_runners import remote_env_runners

    runners = remote_env_runners(config, config.scale.env_runners)
    raw_seconds = max(1.0, seconds / 4)
    try:
        fragment = 50 * config.scale.envs_per_runner
        ray.get([r.sample.remote(num_timesteps=fragment) for r in runners])  # warm-up: envs and module built
        raw_before = _raw_cpu_us_in(runners, config, raw_seconds)
        cpu_before = _runner_cpu_s(runners)
        in_flight = {r.sample.remote(num_timesteps=fragment): r for r in runners for _ in range(2)}
        steps, start = 0, time.perf_counter()
        while in_flight:
            (ready,), _ = ray.wait(list(in_flight))
            runner = in_flight.pop(ready)
            steps += sum(e.env_steps() for e in ray.get(ready))
            if time.perf_counter() - start < seconds:
                in_flight[runner.sample.remote(num_timesteps=fragment)] = runner
        elapsed = time.perf_counter() - start
        runner_cpu_s = _runner_cpu_s(runners) - cpu_before
        raw_after = _raw_cpu_us_in(runners, config, raw_seconds)
        return Sampled(steps=steps, seconds=elapsed, runner_cpu_s=runner_cpu_s, raw_cpu_us=(raw_before + raw_after) / 2)
    finally:
        for runner in runners:
            ray.kill(runner)


def _runner_cpu_s(runners: list) -> float:
    """The CPU seconds the runners' processes have used, each read in its own process (on any node)."""
    import ray

    return sum(ray.get([r.__ray_call__.remote(_process_cpu_s) for r in runners]))


def _process_cpu_s(_actor: Any) -> float:
    return time.process_time()


def _raw_cpu_us_in(runners: list, config: Any, seconds: float) -> float:
    """Raw stepping's CPU per env step measured in each runner's own process (its core, its moment), averaged: the
    host's speed moves by 20-30 % within minutes, so a raw figure taken elsewhere or earlier misjudges the ratio."""
    import ray

    costs = ray.get([r.__ray_call__.remote(_raw_cpu_us_per_step, config.env, dict(config.env_config), seconds,
                                           config.scale.envs_per_runner) for r in runners])
    return sum(costs) / len(costs)


def _raw_cpu_us_per_step(_actor: Any, env: str, env_config: dict[str, Any], seconds: float, num_envs: int) -> float:
    """CPU microseconds per env step of random actions through a SyncVectorEnv, in the calling process."""
    steps, _, cpu_s = step_randomly(env, env_config, seconds, num_envs)
    return 1e6 * cpu_s / steps


def _percent(ratio: Optional[float]) -> str:
    return "n/a" if ratio is None else f"{ratio:.0%}"


def _print_table(rows: list[dict[str, Any]]) -> None:
    from rich.table import Table

    table = Table(title="sampling throughput (learning off)")
    for column in ("layout", "env steps/s", "per runner", "of raw, per runner", "runner CPU us/step", "of raw, per runner CPU",
                   "raw in the runner, us/step", "of raw in the runner"):
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(row["layout"], f"{row['env_steps_per_s']:,.0f}", f"{row['env_steps_per_s'] / row['env_runners']:,.0f}",
                      f"{row['ratio_to_raw_per_runner']:.0%}", f"{row['runner_cpu_us_per_step']:.1f}",
                      f"{row['ratio_to_raw_per_runner_cpu']:.0%}", f"{row['raw_cpu_us_per_step_in_runner']:.1f}",
                      _percent(row["ratio_to_raw_in_runner"]))
    console.stdout.print(table)


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["layouts"]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(rows) + 2), 4.5))
    bars = ax.bar([r["layout"] for r in rows], [r["env_steps_per_s"] for r in rows], color="tab:blue", label="RLlib env runners")
    ax.bar_label(bars, labels=[f"{r['env_steps_per_s']:,.0f}\n{r['ratio_to_raw_per_runner']:.0%}/runner" for r in rows])
    ax.axhline(result["raw_env_steps_per_s"], color="tab:red", linestyle="--", label="raw env, one core")
    ax.set_ylabel("env steps/s")
    ax.set_xlabel("env runners x envs per runner x vectorisation")
    ax.set_title(f"Sampling throughput: {result['env']} ({result['cpus']:g} CPUs)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


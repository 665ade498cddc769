"""`bench offline`: an offline algorithm's training throughput (recorded env steps through the learner per second),
the way `train` sets it up against the way RLlib's own tuned examples do, on the same data, batch and network.

- `ours`: the algorithm exactly as `train` builds it (adapter/algorithm_config.py `_offline`: PreLearner and read
  tasks at 0 CPUs, about one train batch read per read batch, one training step per iteration).
- `rllib`: RLlib 2.60's tuned examples' offline settings (`tuned_examples/bc/cartpole_bc.py`, `iql/pendulum_iql.py`,
  `cql/pendulum_cql.py`): `map_batches_kwargs={"concurrency": 2, "num_cpus": 1}` (IQL and CQL: 2 CPUs each),
  `iter_batches_kwargs={"prefetch_batches": 1}`, RLlib's default read batch and read tasks (1 CPU each). Their
  PreLearner actors ask for more CPUs than a small machine has beside the learner; there they get what is left after
  the learner and one read task, split between the two (said in the result as `prelearner_cpus`).

Both take the experiment's batch, network and `data.updates_per_iteration`.

Each way runs in its own process with its own private Ray instance, one after the other, evaluation off; the
first iteration (the Ray Data pipeline's start) is not counted.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from rlplatform import console
from rlplatform.bench.training_runs import bench_dir, write_json
from rlplatform.errors import UserError

WAYS = ("ours", "rllib")
EXAMPLE_PRELEARNER_CPUS = {"BC": 1.0, "MARWIL": 1.0, "IQL": 2.0, "CQL": 2.0}
EXAMPLE_CONCURRENCY = 2
RESULT_PREFIX = "bench-offline-result: "


def add_verb(verbs: Any) -> None:  # argparse's sub-parsers action
    q = verbs.add_parser("offline", help="offline training throughput: ours against RLlib's tuned examples' settings")
    q.add_argument("experiment", type=Path, help="an offline experiment (BC, MARWIL, CQL, IQL with a data section)")
    q.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help="as for train")
    q.add_argument("--iterations", type=int, default=5, help="measured iterations per way, after one to warm up (default: 5)")
    q.add_argument("--ways", nargs="+", default=list(WAYS), choices=WAYS, help="default: ours rllib")
    q.add_argument("-o", "--output", type=Path, default=Path("bench"), help="directory for the results (default: bench)")
    q.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rlplatform.config.experiment import resolve_experiment
    from rlplatform.infra import local_ray
    from rlplatform.run.plan import make_plan

    if args.iterations < 1:
        raise UserError(f"--iterations must be at least 1, not {args.iterations}")
    resolved = resolve_experiment(args.experiment, args.overrides, None)
    if resolved.config.data is None:
        raise UserError(f"bench offline measures offline algorithms; {resolved.config.name} is {resolved.config.algorithm}")
    plan = make_plan(resolved, local_ray.local_resources(), joined_cluster=False, resize=False)
    config = plan.config.model_copy(update={"evaluation": plan.config.evaluation.model_copy(update={"interval": 0}),
                                            "stop": plan.config.stop.model_copy(update={"return_mean": None})})
    paths = (config.data.paths if config.data else None) or []
    rows = []
    for way in dict.fromkeys(args.ways):
        console.say(f"{way}: {config.algorithm} on {', '.join(paths)} ...")
        rows.append(_measure_in_process(way, config.model_dump(mode="json"), args.iterations))
        console.say(_line(rows[-1]))
    ours = next((r for r in rows if r["way"] == "ours"), None)
    for r in rows:
        r["of_ours"] = r["samples_per_s"] / ours["samples_per_s"] if ours and ours["samples_per_s"] else None
    result = {"experiment": config.name, "algorithm": config.algorithm, "env": config.env, "data": paths,
              "train_batch_size_per_learner": config.training.get("train_batch_size_per_learner"),
              "hidden": list(config.model.hidden), "overrides": args.overrides, "iterations": args.iterations,
              "cpus": plan.resources.cpus, "results": rows}
    path = write_json(bench_dir(args.output, "offline", config.name) / "offline.json", result)
    console.say(f"written: {path}")
    return 0


def _line(row: dict[str, Any]) -> str:
    return (f"{row['way']}: {row['samples_per_s']:,.0f} samples/s through the learner, {row['s_per_update']:.3f} s per "
            f"update ({row['updates']} updates of {row['batch']}; PreLearner actors {row['prelearner_actors']} x "
            f"{row['prelearner_cpus']:g} CPU)")


def _measure_in_process(way: str, config: dict[str, Any], iterations: int) -> dict[str, Any]:
    """One way in a fresh Python process (its own Ray instance); its result line."""
    proc = subprocess.run([sys.executable, "-m", "rlplatform.bench.offline", way, json.dumps(config), str(iterations)],
                          capture_output=True, text=True, timeout=3600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        raise UserError(f"bench offline: the {way} way failed: {tail[0][:300]}")
    return json.loads(lines[-1][len(RESULT_PREFIX):])


def measure(way: str, config_data: dict[str, Any], iterations: int) -> dict[str, Any]:
    from ray.rllib.utils.metrics import ALL_MODULES, LEARNER_RESULTS, NUM_ENV_STEPS_TRAINED_LIFETIME

    from rlplatform.adapter.algorithm_config import build_algorithm_config
    from rlplatform.config.schema import validate
    from rlplatform.infra import local_ray

    config = validate(config_data)
    resources = local_ray.connect(None, speedups=config.speedups)
    algo_config = build_algorithm_config(config)
    actors, cpus = max(1, config.scale.learners), 0.0
    if way == "rllib":
        actors, cpus = _as_rllib_examples(algo_config, config, resources.cpus)
    algo = algo_config.build_algo()

    def trained(result: dict[str, Any]) -> int:
        return int(result[LEARNER_RESULTS][ALL_MODULES][NUM_ENV_STEPS_TRAINED_LIFETIME])

    try:
        before = trained(algo.train())  # the pipeline's start
        start = time.perf_counter()
        for _ in range(iterations):
            result = algo.train()
        seconds = time.perf_counter() - start
        samples = trained(result) - before
    finally:
        algo.stop()
    batch = int(algo_config.train_batch_size_per_learner)
    return {"way": way, "samples": int(samples), "seconds": seconds, "samples_per_s": samples / seconds,
            "updates": int(samples // batch), "batch": batch, "s_per_update": seconds / max(1, samples // batch),
            "prelearner_actors": actors, "prelearner_cpus": cpus,
            "read_batch_episodes": algo_config.input_read_batch_size,
            "updates_per_iteration": algo_config.dataset_num_iters_per_learner}


def _as_rllib_examples(algo_config: Any, config: Any, cpus: float) -> tuple[int, float]:
    """The tuned examples' offline settings (module docstring); PreLearner CPUs cut to what the machine has left."""
    wanted = EXAMPLE_PRELEARNER_CPUS.get(config.algorithm, 1.0)
    left = max(0.0, cpus - float(algo_config.num_cpus_for_main_process) - 1.0)  # the learner, one read task
    each = min(wanted, left / EXAMPLE_CONCURRENCY) if left else 0.0
    algo_config.offline_data(map_batches_kwargs={"concurrency": EXAMPLE_CONCURRENCY, "num_cpus": each},
                             iter_batches_kwargs={"prefetch_batches": 1}, input_read_method_kwargs={},
                             input_read_batch_size=None)
    return EXAMPLE_CONCURRENCY, each


if __name__ == "__main__":
    way_arg, config_arg, iterations_arg = sys.argv[1:4]
    print(RESULT_PREFIX + json.dumps(measure(way_arg, json.loads(config_arg), int(iterations_arg))), flush=True)

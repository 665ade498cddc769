"""`rlplatform bench solve EXPERIMENT --seeds 3`: how long until the experiment's stop return?

Each seed is one real `python -m rlplatform train` process. Per seed: wall time from the command's
start to the iteration that reached `stop.return_mean` (the 100-episode mean), env steps by then,
and the start-up apart (Ray ready, algorithm built, first batch sampled, all from the command's
start). Then the medians. Results: `<output>/solve-<name>-<time>/solve.json`, runs beside it.
"""

from __future__ import annotations

import argparse
from typing import Any, Optional

from rlplatform import console
from rlplatform.bench.training_runs import (
    TrainingRun,
    add_training_arguments,
    bench_dir,
    check_experiment,
    median,
    run_training,
    write_json,
)
from rlplatform.errors import TrainingFailed, UserError


def add_verb(verbs: Any) -> None:  # argparse's sub-parsers action
    q = verbs.add_parser("solve", help="wall time and env steps to the experiment's stop return, per seed and median")
    add_training_arguments(q)
    q.add_argument("--seeds", type=int, default=3, help="number of seeds: the experiment's seed, +1, +2, ... (default: 3)")
    q.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.seeds < 1:
        raise UserError(f"--seeds must be >= 1, not {args.seeds}")
    config = check_experiment(args)
    if config.stop.return_mean is None:
        raise UserError(f"{config.name} has no stop.return_mean to solve to; add one or give --set stop.return_mean=...")
    root = bench_dir(args.output, "solve", config.name)
    base_seed = config.seed or 0
    rows = []
    for i in range(args.seeds):
        seed = base_seed + i
        console.say(f"seed {seed}: training {config.name} ...")
        run_ = run_training(args, root / f"seed-{seed}", [f"seed={seed}"])
        if run_.returncode != 0:
            raise TrainingFailed(f"seed {seed}: {run_.failure()}")
        rows.append(seed_result(seed, run_))
        console.say(_row_line(rows[-1]))
    summary = summarize(rows)
    result = {"experiment": config.name, "env": config.env, "algorithm": config.algorithm, "target_return": config.stop.return_mean,
              "env_step_limit": config.stop.env_steps, "overrides": args.overrides, "profile": args.profile, "seeds": rows,
              "median": summary}
    path = write_json(root / "solve.json", result)
    _print_table(rows, summary)
    console.say(f"written: {path}")
    return 0


def seed_result(seed: int, run: TrainingRun) -> dict[str, Any]:
    # train stops at the first iteration whose 100-episode mean (an offline run: whose evaluation) reached the target.
    solved_at = (run.metrics[-1] if run.metrics and run.stop_line.startswith(("stopped: return/mean", "stopped: eval/return_mean"))
                 else None)
    startup = run.manifest.get("startup", {})
    last = run.metrics[-1] if run.metrics else {}
    return {
        "seed": seed,
        "solved": solved_at is not None,
        "time_to_solve_s": solved_at["wall_time_s"] if solved_at else None,
        "env_steps_to_solve": solved_at["env_steps"] if solved_at else None,
        "iterations": last.get("iteration"),
        "final_return_mean": last.get("return/mean"),
        "final_eval_return_mean": last.get("eval/return_mean"),
        "env_steps": last.get("env_steps"),
        "command_s": run.command_s,  # to exit: includes the final checkpoint and Ray's shutdown
        "startup": startup,
        "training_s": (solved_at["wall_time_s"] - startup["algorithm_ready_s"]) if solved_at and startup else None,
        "stop": run.stop_line,
        "layout": run.layout,  # --profile auto may take it from `bench throughput`'s cache
        "layout_from_bench": run.manifest.get("layout_from_bench"),
        "envs_per_runner": run.manifest.get("envs_per_runner"),  # value, source, measured step cost
        "run_dir": str(run.run_dir),
    }


def summarize(rows: list[dict[str, Any]]) -> dict[str, Optional[float]]:
    solved = [r for r in rows if r["solved"]]
    return {
        "solved_seeds": len(solved),
        "time_to_solve_s": median([r["time_to_solve_s"] for r in solved]) if len(solved) == len(rows) else None,
        "env_steps_to_solve": median([r["env_steps_to_solve"] for r in solved]) if len(solved) == len(rows) else None,
        "startup_algorithm_ready_s": median([r["startup"]["algorithm_ready_s"] for r in rows if r["startup"]]),
        "first_sample_s": median([r["startup"]["first_sample_s"] for r in rows if r["startup"]]),
        "training_s": median([r["training_s"] for r in solved]) if solved else None,
    }


def _row_line(r: dict[str, Any]) -> str:
    if not r["solved"]:
        return f"seed {r['seed']}: not solved ({r['stop'] or 'no stop line'}), return {console.fmt(r['final_return_mean'], '.1f')}"
    return (f"seed {r['seed']}: solved in {r['time_to_solve_s']:.1f} s, {r['env_steps_to_solve']:,} env steps "
            f"(algorithm built at {r['startup'].get('algorithm_ready_s', 0):.1f} s; layout {r['layout']})")


def _print_table(rows: list[dict[str, Any]], summary: dict[str, Any]) -> None:
    from rich.table import Table

    table = Table(title="time to solve (from the command's start)")
    for column in ("seed", "solved", "wall s", "env steps", "Ray ready s", "built s", "1st batch s", "training s"):
        table.add_column(column, justify="right")
    for r in rows:
        s = r["startup"]
        table.add_row(str(r["seed"]), "yes" if r["solved"] else "no", console.fmt(r["time_to_solve_s"], ".1f"),
                      console.fmt(r["env_steps_to_solve"], ","), console.fmt(s.get("ray_ready_s"), ".1f"), console.fmt(s.get("algorithm_ready_s"), ".1f"),
                      console.fmt(s.get("first_sample_s"), ".1f"), console.fmt(r["training_s"], ".1f"))
    table.add_row("median", f"{summary['solved_seeds']}/{len(rows)}", console.fmt(summary["time_to_solve_s"], ".1f"),
                  console.fmt(summary["env_steps_to_solve"], ",.0f"), "", console.fmt(summary["startup_algorithm_ready_s"], ".1f"),
                  console.fmt(summary["first_sample_s"], ".1f"), console.fmt(summary["training_s"], ".1f"))
    console.stdout.print(table)

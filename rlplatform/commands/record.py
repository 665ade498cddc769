"""`rlplatform record RUN_DIR|CHECKPOINT -o DIR`: a trained policy playing, recorded as an offline dataset.

The checkpoint's policy plays whole episodes in this process through RLlib's own env runner (no Ray
cluster), greedy by default or sampling with `--stochastic`, and the episodes are written to DIR as
Parquet in RLlib's offline format (adapter/offline_data.py), with `dataset.json` beside them: the
format, the source, the spaces, the episode count, env steps, returns and size on disk. RLlib's offline
algorithms (`offline_data(input_=DIR, input_read_episodes=True)`) read it as their own recordings.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from rlplatform import console
from rlplatform.config.schema import validate
from rlplatform.errors import UserError

PART_FILE = "episodes-000000.parquet"


def add_parser(subparsers: Any) -> None:  # argparse's sub-parsers action
    p = subparsers.add_parser(
        "record", help="record a trained policy's episodes as an offline dataset (Parquet)",
        description="Play whole episodes with a trained policy in this process (no Ray cluster) and write them as "
                    "Parquet in RLlib's offline format, with dataset.json beside them.")
    p.add_argument("target", type=Path, metavar="RUN_DIR|CHECKPOINT")
    p.add_argument("-o", "--output", type=Path, required=True, metavar="DIR",
                   help="directory for the dataset; it must not hold one already")
    p.add_argument("--episodes", type=int, default=100, help="episodes to record (default: 100)")
    p.add_argument("--stochastic", action="store_true", help="sample actions from the policy (default: greedy)")
    p.add_argument("--seed", type=int, default=0, help="seed of the env and of the action sampling (default: 0)")
    p.add_argument("--checkpoint", choices=("best", "latest"), default="best", help="which checkpoint of a run directory")
    p.add_argument("--policy", help="policy (module) id; default: the only or default policy")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rlplatform.commands.evaluate import is_export
    from rlplatform.run.checkpoints import find_checkpoint

    if args.episodes < 1:
        raise UserError(f"--episodes must be at least 1, not {args.episodes}")
    if is_export(args.target):
        raise UserError(f"{args.target} is an export: record plays a checkpoint (a run directory or checkpoint folder)")
    _check_output(args.output)
    info = find_checkpoint(args.target, args.checkpoint, args.policy)
    if "config" not in info.meta:
        raise UserError(f"checkpoint {info.path} carries no experiment config")
    config = validate(info.meta["config"], source=str(info.path))
    if config.multi_agent is not None or config.env == "external":
        raise UserError(f"record plays single-agent runs on a Gymnasium env; {info.path} is "
                        f"{'multi-agent' if config.multi_agent is not None else 'on external simulators'}")
    from rlplatform.adapter.offline_data import play_episodes, summary_of, write_dataset_json, write_part
    from rlplatform.export.spec import space_to_json

    episodes = play_episodes(info.path, config, args.episodes, args.stochastic, args.seed, args.policy)
    part = args.output / PART_FILE
    write_part(episodes, part)
    summary = summary_of(episodes, [part], source=args.output)  # the episodes in hand: no second read of the file
    source = {"checkpoint": str(info.path.resolve()), "iteration": info.iteration, "env_steps": info.env_steps,
              "algorithm": config.algorithm, "actions": "stochastic" if args.stochastic else "greedy", "seed": args.seed}
    write_dataset_json(args.output, summary, config.env, dict(config.env_config), source, space_to_json)
    console.say(f"recorded {summary.episodes} episodes, {summary.env_steps:,} env steps, return {summary.return_mean:.2f} "
                f"(min {summary.return_min:.2f}, max {summary.return_max:.2f}) from {info.path}: {args.output}")
    return 0


def _check_output(output: Path) -> None:
    """An empty or new directory: a dataset already there is not overwritten nor mixed with another."""
    from rlplatform.adapter.offline_data import holds_dataset
    from rlplatform.run.run_dir import check_writable

    if output.exists() and not output.is_dir():
        raise UserError(f"--output {output} is a file, not a directory")
    if holds_dataset(output):
        raise UserError(f"--output {output} already holds a dataset: choose another directory")
    check_writable(output)

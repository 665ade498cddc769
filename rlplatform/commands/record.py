"""`rlplatform record RUN_DIR|CHECKPOINT|EXPORT_DIR -o DIR`: a trained policy playing, recorded as an offline dataset.

A checkpoint's policy plays whole episodes in this process through RLlib's own env runner (no Ray
cluster), greedy by default or sampling with `--stochastic`; an export's plays with onnxruntime (or
TorchScript) alone, as `evaluate` runs it. The episodes are written to DIR as
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
                    "Parquet in RLlib's offline format, with dataset.json beside them. A checkpoint plays through "
                    "RLlib's env runner; an export (a directory with export.json) with onnxruntime alone.")
    p.add_argument("target", type=Path, metavar="RUN_DIR|CHECKPOINT|EXPORT_DIR")
    p.add_argument("-o", "--output", type=Path, required=True, metavar="DIR",
                   help="directory for the dataset; it must not hold one already")
    p.add_argument("--episodes", type=int, default=100, help="episodes to record (default: 100)")
    p.add_argument("--stochastic", action="store_true",
                   help="sample actions from the policy (default: greedy); an export samples only if exported --stochastic")
    p.add_argument("--seed", type=int, default=0, help="seed of the env and of the action sampling (default: 0)")
    p.add_argument("--checkpoint", choices=("best", "latest"), default="best", help="which checkpoint of a run directory")
    p.add_argument("--policy", help="policy (module) id; default: the only or default policy")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rlplatform.commands.evaluate import is_export

    if args.episodes < 1:
        raise UserError(f"--episodes must be at least 1, not {args.episodes}")
    exported = is_export(args.target)
    if exported and not args.target.is_dir():
        raise UserError(f"{args.target}: give the export's directory (its export.json names the env)")
    _check_output(args.output)
    episodes, env, env_config, source = (_play_export if exported else _play_checkpoint)(args)
    from rlplatform.adapter.offline_data import summary_of, write_dataset_json, write_part
    from rlplatform.export.spec import space_to_json

    part = args.output / PART_FILE
    write_part(episodes, part)
    summary = summary_of(episodes, [part], source=args.output)  # the episodes in hand: no second read of the file
    write_dataset_json(args.output, summary, env, env_config, source, space_to_json)
    console.say(f"recorded {summary.episodes} episodes, {summary.env_steps:,} env steps, return {summary.return_mean:.2f} "
                f"(min {summary.return_min:.2f}, max {summary.return_max:.2f}) from {args.target}: {args.output}")
    return 0


def _play_checkpoint(args: argparse.Namespace) -> tuple[list, str, dict, dict]:
    """A checkpoint's policy playing through RLlib's own env runner, in this process."""
    from rlplatform.run.checkpoints import find_checkpoint

    info = find_checkpoint(args.target, args.checkpoint, args.policy)
    if "config" not in info.meta:
        raise UserError(f"checkpoint {info.path} carries no experiment config")
    config = validate(info.meta["config"], source=str(info.path))
    if config.multi_agent is not None or config.env == "external":
        raise UserError(f"record plays single-agent runs on a Gymnasium env; {info.path} is "
                        f"{'multi-agent' if config.multi_agent is not None else 'on external simulators'}")
    from rlplatform.adapter.offline_data import play_episodes

    episodes = play_episodes(info.path, config, args.episodes, args.stochastic, args.seed, args.policy)
    source = {"checkpoint": str(info.path.resolve()), "iteration": info.iteration, "env_steps": info.env_steps,
              "algorithm": config.algorithm, "actions": "stochastic" if args.stochastic else "greedy", "seed": args.seed}
    return episodes, config.env, dict(config.env_config), source


def _play_export(args: argparse.Namespace) -> tuple[list, str, dict, dict]:
    """An export's policy playing with onnxruntime (or TorchScript) alone: no Ray. Whether it samples is the
    export's choice (`export --stochastic`), which `--stochastic` must name."""
    from rlplatform.adapter.offline_data import episode_from_steps
    from rlplatform.commands.evaluate import run_episodes
    from rlplatform.export.runtime import ExportedPolicy
    from rlplatform.export.spec import read_spec

    spec = read_spec(args.target)
    if spec.get("multi_agent"):
        raise UserError(f"record plays single-agent policies; {args.target} is a multi-agent export")
    if bool(spec.get("stochastic")) != args.stochastic:
        raise UserError(f"{args.target} was exported {'stochastic' if spec.get('stochastic') else 'greedy'}: "
                        f"{'drop' if spec.get('stochastic') else 'export with'} --stochastic "
                        f"({'an export samples from its noise input' if spec.get('stochastic') else 'a greedy export cannot sample'})")
    name = _policy_name(spec, args)
    described = spec["policies"][name]
    policy = ExportedPolicy(args.target / described["file"], described, seed=args.seed)
    env_config = dict(spec.get("env_config") or {})
    played: list[dict[str, Any]] = []
    run_episodes(policy, spec["env"], env_config, args.episodes, args.seed, None, name=name, trajectories=played)
    episodes = [episode_from_steps(p["observations"], p["actions"], p["rewards"], p["terminated"], p["spaces"]) for p in played]
    source = {"export": str(args.target.resolve()), **(spec.get("source") or {}),
              "algorithm": spec.get("algorithm"), "actions": "stochastic" if args.stochastic else "greedy", "seed": args.seed}
    return episodes, spec["env"], env_config, source


def _policy_name(spec: dict[str, Any], args: argparse.Namespace) -> str:
    policies = spec["policies"]
    if args.policy is not None and args.policy not in policies:
        raise UserError(f"{args.target} has no policy {args.policy!r}; it has: {', '.join(policies)}")
    if args.policy is None and len(policies) > 1:
        raise UserError(f"{args.target}: several policies; name one with --policy")
    return args.policy or next(iter(policies))


def _check_output(output: Path) -> None:
    """An empty or new directory: a dataset already there is not overwritten nor mixed with another."""
    from rlplatform.run.run_dir import check_new_dataset_directory

    check_new_dataset_directory(output, "--output")

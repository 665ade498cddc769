"""`rlplatform data VERB`: offline datasets of recorded episodes.

- `info PATH`: episodes, env steps, returns (mean/min/max), spaces and size on disk of a dataset in RLlib's
  offline format (Parquet files of packed episodes, as `rlplatform record` and RLlib's recording runner write).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from rlplatform import console


def add_parser(subparsers: Any) -> None:  # argparse's sub-parsers action
    p = subparsers.add_parser("data", help="offline datasets: what a recording of episodes holds")
    verbs = p.add_subparsers(dest="data_verb", metavar="{info}", required=True, parser_class=type(p))
    info = verbs.add_parser("info", help="episodes, env steps, returns, spaces and size of a dataset",
                            description="Read every episode of a dataset (a Parquet file or a directory of them, in "
                                        "RLlib's offline format) and print what it holds.")
    info.add_argument("path", type=Path, metavar="PATH")
    info.add_argument("--json", type=Path, metavar="FILE", help="also write the figures as JSON")
    info.set_defaults(func=run_info)


def run_info(args: argparse.Namespace) -> int:
    from rlplatform.adapter.offline_data import summarize
    from rlplatform.export.spec import space_to_json

    summary = summarize(args.path)
    figures = summary.as_dict(space_to_json)
    console.say(f"{args.path}: {summary.episodes:,} episodes ({summary.finished:,} finished), {summary.env_steps:,} env steps, "
                f"mean length {summary.length_mean:.1f}")
    console.say(f"return: mean {summary.return_mean:.2f}, min {summary.return_min:.2f}, max {summary.return_max:.2f}")
    console.say(f"observation space: {summary.observation_space}; action space: {summary.action_space}")
    console.say(f"on disk: {summary.files} Parquet file{'s' if summary.files != 1 else ''}, {summary.bytes / 1e6:.2f} MB")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1) + "\n")
    return 0

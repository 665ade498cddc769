"""`rlplatform report RUN_DIR ... -o report.png`: PNG plots of one or several runs, overlaid."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from rlplatform import console
from rlplatform.dashboards.report import expand_sweeps, load_rows, plot, run_label


def add_parser(subparsers: Any) -> None:  # argparse's sub-parsers action
    p = subparsers.add_parser("report", help="plot runs (return, throughput, time split) into a PNG")
    p.add_argument("run_dirs", nargs="+", type=Path, metavar="RUN_DIR",
                   help="run directories; a sweep directory (`tune`) stands for all its trials")
    p.add_argument("-o", "--output", type=Path, default=Path("report.png"))
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    runs = {run_label(d): load_rows(d) for d in expand_sweeps(args.run_dirs)}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    plot(runs, args.output)
    console.say(f"report: {args.output} ({len(runs)} run(s))")
    return 0

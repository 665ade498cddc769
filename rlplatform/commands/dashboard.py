"""`rlplatform dashboard [RUNS_DIR]`: TensorBoard on the runs, bound to 127.0.0.1 unless told otherwise."""

from __future__ import annotations

import argparse
import threading
from pathlib import Path
from typing import Any

from rlplatform import console
from rlplatform.dashboards.tensorboard import DEFAULT_PORT, start


def add_parser(subparsers: Any) -> None:  # argparse's sub-parsers action
    p = subparsers.add_parser("dashboard", help="start TensorBoard on run directories and print its URL")
    p.add_argument("runs_dir", nargs="?", type=Path, default=Path("runs"), metavar="RUNS_DIR")
    p.add_argument("--port", type=int, default=DEFAULT_PORT)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; 0.0.0.0 for every interface)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    url = start(args.runs_dir, args.host, args.port)
    console.say(f"TensorBoard on {args.runs_dir}: {url}  (Ctrl-C to stop)")
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    return 0

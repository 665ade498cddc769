"""`python -m rlplatform VERB ...`: one module per verb; bad input ends as `error: ...` and exit 2."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence

from rlplatform import __version__
from rlplatform.errors import TrainingFailed, UserError

EXIT_USAGE = 2
EXIT_FAILURE = 1


def one_line(text: str) -> str:
    """User text quoted in an error may hold any character: the error stays one line, control and line-separator
    characters (which `str.splitlines` and terminals break on, `\x1e` and `\u2028` too) written as escapes."""
    return "".join(ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii") for ch in text)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse's own errors keep our one-line format
        print(f"error: {one_line(message)}", file=sys.stderr)
        sys.exit(EXIT_USAGE)


def build_parser() -> argparse.ArgumentParser:
    from rlplatform import bench
    from rlplatform.commands import cluster, dashboard, data, envs, evaluate, export, record, report, serve, train, tune

    parser = _Parser(prog="rlplatform", description="Distributed reinforcement learning on Ray RLlib.")
    parser.add_argument("--version", action="version", version=f"rlplatform {__version__}")
    subparsers = parser.add_subparsers(dest="verb", metavar="VERB", parser_class=_Parser)
    for verb in (train, tune, evaluate, export, record, data, serve, dashboard, report, envs, cluster, bench):
        verb.add_parser(subparsers)
    return parser


def _quiet() -> None:
    os.environ.setdefault("RAY_DEDUP_LOGS", "1")


def main(argv: Optional[Sequence[str]] = None) -> int:
    _quiet()
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return EXIT_USAGE
    if getattr(args, "address", None):
        from rlplatform.infra.local_ray import use_token_auth_for_address

        use_token_auth_for_address()  # before anything imports ray
    try:
        return args.func(args)
    except UserError as exc:
        print(f"error: {one_line(str(exc))}", file=sys.stderr)
        return EXIT_USAGE
    except TrainingFailed as exc:
        print(f"error: training failed: {one_line(str(exc))}", file=sys.stderr)
        return EXIT_FAILURE
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130

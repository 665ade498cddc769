"""`rlplatform export RUN_DIR|CHECKPOINT -o DIR`: the trained policy as an inference-only ONNX or TorchScript
file (one per policy), observation in, action out, with `export.json` beside it (docs/export.md)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from rlplatform import console
from rlplatform.errors import UserError
from rlplatform.export.spec import FORMATS, SPEC_FILE
from rlplatform.run.run_dir import check_writable


def add_parser(subparsers: Any) -> None:  # argparse's sub-parsers action
    p = subparsers.add_parser("export", help="write a trained policy as ONNX or TorchScript, for use without Ray")
    p.add_argument("target", type=Path, metavar="RUN_DIR|CHECKPOINT")
    p.add_argument("-o", "--output", type=Path, required=True, metavar="DIR", help="directory for the model file(s) and export.json")
    p.add_argument("--format", choices=tuple(FORMATS), default="onnx")
    p.add_argument("--checkpoint", choices=("best", "latest"), default="best", help="which checkpoint of a run directory")
    p.add_argument("--stochastic", action="store_true",
                   help="sample actions from an explicit `noise` input instead of the greedy action (not DQN)")
    p.add_argument("--policy", help="export only this policy (module) id; default: every policy")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rlplatform.config.schema import validate
    from rlplatform.export.writer import export_checkpoint
    from rlplatform.run.checkpoints import find_checkpoint
    from rlplatform.run.tracking import log_export

    check_writable(args.output)
    if args.output.is_file():
        raise UserError(f"--output must be a directory, not the file {args.output}")
    info = find_checkpoint(args.target, args.checkpoint, args.policy)
    if "config" not in info.meta:
        raise UserError(f"checkpoint {info.path} carries no experiment config")
    config = validate(info.meta["config"], source=str(info.path))
    if args.policy and config.multi_agent is not None and args.policy not in config.multi_agent.policies:
        raise UserError(f"--policy {args.policy!r}: the run has {', '.join(config.multi_agent.policies)}")
    spec = export_checkpoint(info, config, args.format, args.output, args.stochastic, args.policy)
    log_export(info.path, config, args.output)
    console.say(f"checkpoint: {info.path} (iteration {info.iteration}, {info.env_steps:,} env steps)")
    for name, policy in spec["policies"].items():
        inputs = ", ".join(i["name"] for i in policy["inputs"])
        console.say(f"policy {name}: {args.output / policy['file']} ({inputs} -> {policy['action_distribution']} action)")
    console.say(f"description: {args.output / SPEC_FILE}")
    return 0

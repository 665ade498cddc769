"""`rlplatform serve RUN_DIR|CHECKPOINT|EXPORT_DIR`: a trained policy behind HTTP, on Ray Serve (docs/serve.md).

A run directory or checkpoint is exported first (greedy and, where the algorithm samples, stochastic
ONNX models, as `rlplatform export` writes them); an export directory is served as it is. The
application listens on 127.0.0.1 unless told otherwise; bound wider, it takes a bearer token.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any, Optional

from rlplatform import console
from rlplatform.config.schema import is_loopback
from rlplatform.errors import UserError
from rlplatform.run.run_dir import CONFIG_FILE

TOKEN_ENV = "RLPLATFORM_SERVE_TOKEN"
APP_NAME = "rlplatform"


def add_parser(subparsers: Any) -> None:  # argparse's sub-parsers action
    p = subparsers.add_parser(
        "serve", help="serve a trained policy over HTTP on Ray Serve",
        description="Deploy a policy as a Ray Serve application: POST /v1/act (a batch of observations, JSON or .npy) "
                    "returns actions; GET /v1/policy describes it. Runs until interrupted.")
    p.add_argument("target", type=Path, metavar="RUN_DIR|CHECKPOINT|EXPORT_DIR")
    p.add_argument("--checkpoint", choices=("best", "latest"), default="best", help="which checkpoint of a run directory")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1; wider needs a token)")
    p.add_argument("--port", type=int, default=8000, help="HTTP port (default: 8000)")
    p.add_argument("--replicas", type=int, default=1, help="replicas (the minimum, with --max-replicas) (default: 1)")
    p.add_argument("--max-replicas", type=int, help="autoscale up to this many replicas on Serve's own policy")
    p.add_argument("--replica-cpus", type=float, default=0.5, help="CPUs each replica reserves (default: 0.5)")
    p.add_argument("--max-batch-size", type=int, default=64,
                   help="requests batched into one model call (default: 64; 1: unbatched)")
    p.add_argument("--token-file", type=Path, metavar="FILE",
                   help=f"bearer token clients must send (else ${TOKEN_ENV}); required off loopback")
    p.add_argument("--follow", action="store_true",
                   help="RUN_DIR only: switch to each newer --checkpoint of the run as it trains (rolling update)")
    p.add_argument("--poll", type=float, default=5.0, metavar="S", help="with --follow: seconds between looks (default: 5)")
    p.add_argument("--address", help="Ray cluster to deploy on (default: a private local instance)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    token = _token(args)
    _check_options(args, token)
    with tempfile.TemporaryDirectory(prefix="rlplatform-serve-") as work:
        bundle = _bundle(args, token, *_exports(args.target, args.checkpoint, Path(work) / "0"))
        return _serve(bundle, args, Path(work), token)


def _bundle(args: argparse.Namespace, token: Optional[str], exports: dict[str, Path], version: dict[str, Any]) -> Any:
    from rlplatform.serving.app import bundle_from_exports

    return bundle_from_exports(exports, version, token=token, settings={"max_batch_size": args.max_batch_size})


def _token(args: argparse.Namespace) -> Optional[str]:
    if args.token_file is not None:
        try:
            token = args.token_file.read_text().strip()
        except OSError as exc:
            raise UserError(f"--token-file {args.token_file}: {exc.strerror}") from None
        if not token:
            raise UserError(f"--token-file {args.token_file} is empty")
        return token
    return os.environ.get(TOKEN_ENV) or None


def _check_options(args: argparse.Namespace, token: Optional[str]) -> None:
    if not 0 < args.port < 65536:
        raise UserError(f"--port must be 1-65535, not {args.port}")
    if args.replicas < 1:
        raise UserError(f"--replicas must be at least 1, not {args.replicas}")
    if args.max_replicas is not None and args.max_replicas < args.replicas:
        raise UserError(f"--max-replicas ({args.max_replicas}) is below --replicas ({args.replicas})")
    if args.replica_cpus <= 0:
        raise UserError(f"--replica-cpus must be above 0, not {args.replica_cpus}")
    if args.max_batch_size < 1:
        raise UserError(f"--max-batch-size must be at least 1, not {args.max_batch_size}")
    if args.follow and not (args.target / CONFIG_FILE).is_file():
        raise UserError(f"--follow takes a run directory (one with {CONFIG_FILE}), not {args.target}")
    if args.poll <= 0:
        raise UserError(f"--poll must be above 0, not {args.poll}")
    if not is_loopback(args.host) and token is None:
        raise UserError(f"--host {args.host} is reachable from other machines: give a token (--token-file or ${TOKEN_ENV})")


def _exports(target: Path, which: str, work: Path) -> tuple[dict[str, Path], dict[str, Any]]:
    """Export directories by mode, and the version the replies carry: a checkpoint exported greedy and stochastic."""
    from rlplatform.commands.evaluate import is_export
    from rlplatform.export.spec import SPEC_FILE
    from rlplatform.run.checkpoints import find_checkpoint

    if is_export(target):
        if not (target / SPEC_FILE).is_file():
            raise UserError(f"{target}: serve takes an export directory (with {SPEC_FILE}), not a model file")
        spec = json.loads((target / SPEC_FILE).read_text())
        if any(i["name"].startswith("state_in") for p in spec["policies"].values() for i in p["inputs"]):
            raise UserError(f"{target}: a recurrent policy needs its state carried between requests, which serve does not do")
        stochastic = any(p.get("noise") for p in spec["policies"].values())
        source = {k: v for k, v in spec.get("source", {}).items() if k in ("checkpoint", "iteration", "env_steps")}
        return {"stochastic" if stochastic else "greedy": target}, {"export": str(target.resolve()), **source}
    return _export_checkpoint(find_checkpoint(target, which), work)


def _export_checkpoint(info: Any, work: Path) -> tuple[dict[str, Path], dict[str, Any]]:
    """A checkpoint exported greedy and (but for DQN) stochastic, and the version the replies carry."""
    from rlplatform.config.schema import validate
    from rlplatform.export.writer import export_checkpoint

    if "config" not in info.meta:
        raise UserError(f"checkpoint {info.path} carries no experiment config")
    config = validate(info.meta["config"], source=str(info.path))
    if config.model.use_lstm:
        raise UserError(f"{info.path}: a recurrent policy (model.use_lstm) needs its state carried between requests, "
                        "which serve does not do; export it and keep the state in the caller")
    exports = {"greedy": work / "greedy"}
    export_checkpoint(info, config, "onnx", exports["greedy"], False, None)
    if config.algorithm != "DQN":
        exports["stochastic"] = work / "stochastic"
        export_checkpoint(info, config, "onnx", exports["stochastic"], True, None)
    version = {"checkpoint": str(info.path.resolve()), "iteration": info.iteration, "env_steps": info.env_steps}
    return exports, version


def _serve(bundle: Any, args: argparse.Namespace, work: Path, token: Optional[str]) -> int:
    from ray import serve

    from rlplatform.infra.local_ray import connect, shutdown
    from rlplatform.serving.app import deployment

    logging.getLogger("ray.serve").setLevel(logging.WARNING)  # Serve's start-up notes; the console keeps to ours
    stop = threading.Event()
    connect(args.address)
    signal.signal(signal.SIGTERM, lambda *_: stop.set())  # after Ray's start, which installs its own handler

    def deploy(bundle: Any) -> None:
        # A new bundle is a new version of the deployment: Serve rolls it out, old replicas drain their requests.
        serve.run(deployment(bundle, args.replicas, args.max_replicas, args.replica_cpus), name=APP_NAME, route_prefix="/")

    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        deploy(bundle)
        console.say(f"serving {', '.join(bundle.policies)} ({_version_line(bundle.version)}) on "
                    f"http://{args.host}:{args.port}/v1/act; GET /v1/policy describes it; Ctrl-C stops")
        try:
            while not stop.wait(args.poll if args.follow else None):
                bundle = _follow(args, bundle, work, token, deploy)
        except KeyboardInterrupt:
            pass
        serve.shutdown()
    finally:
        shutdown()
    return 0


def _follow(args: argparse.Namespace, bundle: Any, work: Path, token: Optional[str], deploy: Any) -> Any:
    """With --follow: the bundle served after this look (a newer checkpoint rolled out, or the same one)."""
    import shutil

    newer = _newer_checkpoint(args, bundle.version, work)
    if newer is None:
        return bundle
    try:
        candidate = _bundle(args, token, *newer)
        deploy(candidate)
    except Exception as exc:  # a failed rollout leaves the running version serving
        print(f"warning: still serving {_version_line(bundle.version)}: the new version did not deploy: "
              f"{type(exc).__name__}: {exc}", file=sys.stderr)
        return bundle
    finally:
        shutil.rmtree(next(iter(newer[0].values())).parent, ignore_errors=True)  # the bytes are in the bundle now
    console.say(f"now serving {_version_line(candidate.version)}")
    return candidate


def _newer_checkpoint(args: argparse.Namespace, version: dict[str, Any], work: Path) -> Optional[tuple[dict[str, Path], dict[str, Any]]]:
    """With --follow: the run's --checkpoint exported, where it is another checkpoint than the one served.

    A checkpoint that does not verify, load or export (one being written, or removed by the run's retention
    meanwhile) is named in one line and tried again at the next look; the one served stays."""
    from rlplatform.run.checkpoints import best_first, find_checkpoint, list_checkpoints, newest_first

    listed = list_checkpoints(args.target / "checkpoints")
    ordered = best_first(listed) if args.checkpoint == "best" else newest_first(listed)
    if not ordered or str(ordered[0].path.resolve()) == version.get("checkpoint"):
        return None
    try:
        info = find_checkpoint(args.target, args.checkpoint)
        if str(info.path.resolve()) == version.get("checkpoint"):
            return None
        return _export_checkpoint(info, work / info.path.name)
    except Exception as exc:  # a checkpoint being written or removed meanwhile; the next look tries again
        print(f"warning: still serving {_version_line(version)}: {exc}", file=sys.stderr)
        return None


def _version_line(version: dict[str, Any]) -> str:
    if "export" in version:
        return f"export {version['export']}"
    return f"checkpoint {Path(version['checkpoint']).name}, iteration {version['iteration']}"

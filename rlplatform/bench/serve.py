"""`bench serve`: requests/s and latency of `rlplatform serve`, batched and unbatched, against onnxruntime in-process.

The policy is exported once (`rlplatform export`, greedy ONNX); `rlplatform serve` then serves that
export directory in its own process, as a user starts it, once with request batching (`--max-batch-size
64`) and once without (1). Clients are threads on keep-alive HTTP/1.1 connections, each sending one
request after another for `--seconds` at each concurrency. The limit beside them is the same model
called in this process with onnxruntime by as many threads, one call per request. Clients, server
and the limit share this machine's cores, so the figures are what one machine does with both ends.
"""

from __future__ import annotations

import argparse
import http.client
import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from rlplatform import console
from rlplatform.bench.training_runs import bench_dir, write_json
from rlplatform.errors import UserError

WAYS = ("serve-batched", "serve-unbatched", "onnxruntime")
BATCH_SIZE = {"serve-batched": 64, "serve-unbatched": 1}


def add_verb(verbs: Any) -> None:  # argparse's sub-parsers action
    q = verbs.add_parser("serve", help="rlplatform serve's requests/s and latency, batched and unbatched, against onnxruntime")
    q.add_argument("target", type=Path, metavar="RUN_DIR|CHECKPOINT", help="the trained policy to serve")
    q.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 64], metavar="C",
                   help="clients sending at once (default: 1 8 64)")
    q.add_argument("--seconds", type=float, default=10.0, help="measured time per way and concurrency (default: 10)")
    q.add_argument("--rows", type=int, default=1, help="observations per request (default: 1)")
    q.add_argument("--replicas", type=int, default=1, help="serve's --replicas (default: 1)")
    q.add_argument("-o", "--output", type=Path, default=Path("bench"), help="directory for the results (default: bench)")
    q.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.seconds <= 0 or args.rows < 1 or args.replicas < 1 or min(args.concurrency) < 1:
        raise UserError("--seconds must be > 0, and --rows, --replicas and every --concurrency at least 1")
    if not args.target.exists():
        raise UserError(f"no such run directory or checkpoint: {args.target}")
    out = bench_dir(args.output, "serve", args.target.resolve().name)
    export = out / "export"
    _cli("export", args.target, "-o", export)
    spec = json.loads((export / "export.json").read_text())
    name, policy = next(iter(spec["policies"].items()))
    observations = _observations(policy["observation_space"], args.rows)
    body = json.dumps({"observations": observations.tolist()}).encode()
    rows = []
    for way in WAYS:
        if way == "onnxruntime":
            rows += _limit(export / policy["file"], policy, observations, args)
        else:
            rows += _served(way, export, body, args)
    result = {"target": str(args.target), "policy": name, "rows_per_request": args.rows, "seconds": args.seconds,
              "replicas": args.replicas, "cpus": _cpus(), "results": rows}
    path = write_json(out / "serve.json", result)
    _print(rows)
    console.say(f"written: {path}")
    return 0


def _cli(*args: Any) -> None:
    result = subprocess.run([sys.executable, "-m", "rlplatform", *map(str, args)], capture_output=True, text=True)
    if result.returncode != 0:
        raise UserError(f"rlplatform {args[0]} failed: {(result.stderr or result.stdout).strip().splitlines()[-1:]}")


def _observations(space: dict[str, Any], rows: int) -> np.ndarray:
    from rlplatform.export.spec import space_from_json

    obs_space = space_from_json(space)
    obs_space.seed(0)
    return np.stack([obs_space.sample() for _ in range(rows)])


def _served(way: str, export: Path, body: bytes, args: argparse.Namespace) -> list[dict[str, Any]]:
    port = _free_port()
    server = subprocess.Popen([sys.executable, "-m", "rlplatform", "serve", str(export), "--port", str(port),
                               "--max-batch-size", str(BATCH_SIZE[way]), "--replicas", str(args.replicas)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _wait_ready(server)
        _post(port, body)  # the first request builds the proxy's route
        return [_measure(way, c, args.seconds, _client(port, body)) for c in args.concurrency]
    finally:
        server.terminate()
        server.wait(timeout=120)


def _wait_ready(server: subprocess.Popen, timeout: float = 300) -> None:
    """Until serve prints its `serving ...` line; its output is drained by a thread from then on too."""
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(server.stdout or ()), daemon=True).start()
    deadline = time.monotonic() + timeout
    while not any(line.startswith("serving ") for line in list(lines)):
        if server.poll() is not None or time.monotonic() > deadline:
            raise UserError("rlplatform serve did not come up: " + "".join(lines[-5:]).strip())
        time.sleep(0.2)


def _client(port: int, body: bytes) -> Callable[[], Callable[[], bool]]:
    """Per thread: one keep-alive connection, and a call that sends one request and says whether it got a 200."""

    def connect() -> Callable[[], bool]:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)

        def request() -> bool:
            connection.request("POST", "/v1/act", body, {"Content-Type": "application/json"})
            response = connection.getresponse()
            response.read()
            return response.status == 200

        return request

    return connect


def _post(port: int, body: bytes) -> None:
    if not _client(port, body)()():
        raise UserError("rlplatform serve answered its first request with an error")


def _limit(model: Path, policy: dict[str, Any], observations: np.ndarray, args: argparse.Namespace) -> list[dict[str, Any]]:
    from rlplatform.export.runtime import ExportedPolicy

    exported = ExportedPolicy(model, policy)

    def connect() -> Callable[[], bool]:
        def request() -> bool:
            exported.act(observations)
            return True

        return request

    return [_measure("onnxruntime", c, args.seconds, connect) for c in args.concurrency]


def _measure(way: str, concurrency: int, seconds: float, connect: Callable[[], Callable[[], bool]]) -> dict[str, Any]:
    """`concurrency` threads calling one after another until `seconds` have passed; every call's latency kept."""
    latencies: list[list[float]] = [[] for _ in range(concurrency)]
    errors = [0] * concurrency
    start = threading.Barrier(concurrency + 1)
    stop = threading.Event()

    def worker(i: int) -> None:
        request = connect()
        start.wait()
        while not stop.is_set():
            t = time.perf_counter()
            try:
                ok = request()
            except (OSError, http.client.HTTPException):
                ok = False
                request = connect()
            if ok:
                latencies[i].append(time.perf_counter() - t)
            else:
                errors[i] += 1

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(concurrency)]
    for thread in threads:
        thread.start()
    start.wait()
    began = time.perf_counter()
    time.sleep(seconds)
    stop.set()
    for thread in threads:
        thread.join(timeout=120)
    elapsed = time.perf_counter() - began
    flat = np.array([x for per in latencies for x in per]) * 1000.0
    row = {"way": way, "concurrency": concurrency, "requests": int(flat.size), "errors": int(sum(errors)),
           "requests_per_s": flat.size / elapsed,
           "p50_ms": float(np.percentile(flat, 50)) if flat.size else None,
           "p99_ms": float(np.percentile(flat, 99)) if flat.size else None}
    console.say(f"  {way}, {concurrency} at once: {row['requests_per_s']:,.0f} requests/s, p50 {_ms(row['p50_ms'])}, "
                f"p99 {_ms(row['p99_ms'])}, {row['errors']} errors")
    return row


def _print(rows: list[dict[str, Any]]) -> None:
    from rich.table import Table

    limit = {r["concurrency"]: r["requests_per_s"] for r in rows if r["way"] == "onnxruntime"}
    table = Table(title="bench serve: requests/s and latency (one machine: clients, server and the limit share its cores)")
    for column in ("way", "concurrency", "requests/s", "of onnxruntime in-process", "p50 ms", "p99 ms", "errors"):
        table.add_column(column, justify="right")
    for r in rows:
        share = r["requests_per_s"] / limit[r["concurrency"]] if limit.get(r["concurrency"]) else None
        table.add_row(r["way"], str(r["concurrency"]), f"{r['requests_per_s']:,.0f}", "-" if share is None else f"{share:.1%}",
                      _ms(r["p50_ms"]), _ms(r["p99_ms"]), str(r["errors"]))
    console.stdout.print(table)


def _ms(value: Any) -> str:
    return "-" if value is None else f"{value:.2f}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cpus() -> int:
    import os

    return len(os.sched_getaffinity(0))

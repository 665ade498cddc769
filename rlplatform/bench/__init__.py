"""`rlplatform bench VERB`: where the time and memory go, measured on the real training path.

- `throughput`: the env's raw stepping limit, then RLlib sampling per layout (learning off).
- `solve`: wall time and env steps until the experiment's stop return, per seed, start-up apart.
- `soak`: resident memory of the driver and every runner and learner over a long run.
- `learner`: DQN/SAC learner updates per second: the lean learner, RLlib's, and plain torch.
- `gpu`: the Atari Pong APPO preset on a GPU learner: learner throughput and GPU utilisation.
- `scale`: many env runners (and nodes) whose envs wait: throughput against the ideal, where the time goes, memory per runner.
- `ingest`: CPU per env step of each role of the pipeline on an env that costs nothing; each role's ceiling.
- `serve`: `rlplatform serve`'s requests/s and latency, batched and unbatched, against onnxruntime in-process.
- `offline`: an offline algorithm's samples/s through the learner, `train`'s set-up against RLlib's tuned examples'.
"""

from __future__ import annotations

from typing import Any


def add_parser(subparsers: Any) -> None:  # argparse's sub-parsers action
    from rlplatform.bench import gpu, ingest, learner, offline, scale, serve, soak, solve, throughput

    p = subparsers.add_parser("bench", help="benchmarks: sampling throughput, time to solve, memory soak, learner updates, GPU learner, scale, ingest, serve, offline")
    verbs = p.add_subparsers(dest="bench_verb", metavar="{throughput,solve,soak,learner,gpu,scale,ingest,serve,offline}", required=True, parser_class=type(p))
    for verb in (throughput, solve, soak, learner, gpu, scale, ingest, serve, offline):
        verb.add_verb(verbs)

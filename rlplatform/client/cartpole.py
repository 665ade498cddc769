"""An example simulator outside Ray: gymnasium's CartPole stepped in this process, trained through `ExternalClient`.

    python -m rlplatform.client.cartpole --run-dir runs/cartpole-external-ppo/<timestamp> [--index 0]
    python -m rlplatform.client.cartpole --host 127.0.0.1 --port 5555 [--token-file FILE]

It runs until the run goes away (the connection closes), or for `--steps` env steps. It reconnects
when the connection drops while the run is still there (`--reconnect`). Needs gymnasium besides the
client's numpy and msgpack.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Optional

from rlplatform.client import protocol
from rlplatform.client.simulator import ExternalClient


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m rlplatform.client.cartpole", description=__doc__.splitlines()[0])
    p.add_argument("--run-dir", type=Path, help="the run's directory (its external.json names host and ports)")
    p.add_argument("--index", type=int, default=0, help="which of the run's ports, with --run-dir (default: 0)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int)
    p.add_argument("--token-file", type=Path)
    p.add_argument("--steps", type=int, default=0, help="stop after this many env steps (default: 0, until the run ends)")
    p.add_argument("--reconnect", action="store_true", help="connect again when the connection drops")
    p.add_argument("--seed", type=int, default=None)
    args = p.parse_args(argv)
    host, port = args.host, args.port
    if args.run_dir is not None:
        facts = json.loads((args.run_dir / "external.json").read_text())
        host, port = facts["host"], facts["ports"][args.index]
    if port is None:
        p.error("give --run-dir or --port")
    token = args.token_file.read_text().strip() if args.token_file else None
    steps = 0
    while True:
        try:
            steps = run(host, port, token, args.steps, steps, args.seed)
            return 0
        except (protocol.PeerError, OSError) as exc:
            if not args.reconnect:
                print(f"simulator: {exc}", file=sys.stderr)
                return 0 if isinstance(exc, protocol.PeerError) and "closed" in str(exc) else 1
            time.sleep(1.0)


def run(host: str, port: int, token: Optional[str], max_steps: int, steps: int, seed: Optional[int]) -> int:
    import gymnasium as gym

    env = gym.make("CartPole-v1")
    with ExternalClient(host, port, token=token, seed=seed) as client:
        obs = client.start_episode(env.reset(seed=seed)[0])
        while not max_steps or steps < max_steps:
            action = client.act(obs)
            obs, reward, terminated, truncated, _ = env.step(action)
            client.step(obs, float(reward), terminated, truncated)
            steps += 1
            if terminated or truncated:
                obs = client.start_episode(env.reset()[0])
    return steps


if __name__ == "__main__":
    sys.exit(main())

"""Stable-Baselines3's SAC on HalfCheetah-v5 with RL Zoo's settings, timed as `train experiments/halfcheetah_sac.yaml`.

RL Zoo's `hyperparams/sac.yml` for MuJoCo: `learning_starts: 10000` and SAC's defaults (batch 256, 256x256 MLPs,
one gradient step per env step, buffer 1M, lr 3e-4, tau 0.005, gamma 0.99, automatic entropy). Reports the
env steps per second of the learning phase (between --rate-from and --rate-to env steps) and, every
--eval-every env steps, the greedy return over 10 episodes, the wall time and the env steps, so that the time
to a greedy return (--target) can be read beside ours. Never imports rlplatform.

    python tools/peers/sb3_sac_halfcheetah.py --steps 16000 --json sb3-rate.json           # the rate alone
    python tools/peers/sb3_sac_halfcheetah.py --steps 300000 --eval-every 25000 --target 5000 --json sb3-5000.json
"""

from __future__ import annotations

import argparse
import json
import time

import gymnasium as gym
import numpy as np
import stable_baselines3
import torch
from stable_baselines3 import SAC
from stable_baselines3.common.callbacks import BaseCallback


def greedy_return(model: SAC, episodes: int, seed: int) -> float:
    env = gym.make("HalfCheetah-v5")
    returns = []
    for i in range(episodes):
        obs, _ = env.reset(seed=seed + i)
        done, total = False, 0.0
        while not done:
            action, _ = model.predict(obs, deterministic=True)
            obs, reward, terminated, truncated, _ = env.step(action)
            total += float(reward)
            done = terminated or truncated
        returns.append(total)
    return float(np.mean(returns))


class Progress(BaseCallback):
    def __init__(self, args: argparse.Namespace, started: float) -> None:
        super().__init__()
        self.args, self.started, self.marks, self.evals, self.eval_s = args, started, {}, [], 0.0

    def _on_step(self) -> bool:
        t, steps = time.perf_counter(), self.num_timesteps
        if steps in (self.args.rate_from, self.args.rate_to):
            self.marks[steps] = t - self.eval_s
        if self.args.eval_every and steps % self.args.eval_every == 0:
            training_s = t - self.started - self.eval_s  # wall time so far, earlier evaluations left out
            value = greedy_return(self.model, 10, seed=10_000)
            self.eval_s += time.perf_counter() - t
            self.evals.append({"env_steps": steps, "greedy_return": value, "training_s": round(training_s, 1)})
            print(json.dumps(self.evals[-1]), flush=True)
            if self.args.target is not None and value >= self.args.target:
                return False
        return True


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=16_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rate-from", type=int, default=10_500)
    p.add_argument("--rate-to", type=int, default=16_000)
    p.add_argument("--eval-every", type=int, default=0)
    p.add_argument("--target", type=float, default=None)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    model = SAC("MlpPolicy", gym.make("HalfCheetah-v5"), learning_starts=10_000, seed=args.seed, device="cpu")
    callback = Progress(args, started)
    model.learn(total_timesteps=args.steps, callback=callback)
    marks = callback.marks
    rate = ((args.rate_to - args.rate_from) / (marks[args.rate_to] - marks[args.rate_from])
            if len(marks) == 2 else None)
    result = {"sb3": stable_baselines3.__version__, "torch": torch.__version__, "threads": args.threads,
              "seed": args.seed, "env_steps": model.num_timesteps, "learning_env_steps_per_s": rate,
              "wall_s": round(time.perf_counter() - started, 1), "evaluations": callback.evals}
    print(json.dumps(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""Peer benchmark: Stable-Baselines3 PPO on Atari (Pong), training throughput in env steps/s.

Runs with the SB3 virtualenv's python (see README.md next to this file); it does not import
rlplatform. Single process: SB3's `make_atari_env` (AtariWrapper: noop reset, frame skip 4 with
max-pool, episodic life, fire reset, 84x84 grayscale, reward clipping) on a DummyVecEnv, plus
`VecFrameStack(n_stack=4)`, and PPO with rl-baselines3-zoo's `hyperparams/ppo.yml` `atari` entry:

    policy CnnPolicy, n_envs 8, n_steps 128, n_epochs 4, batch_size 256, n_timesteps 1e7,
    learning_rate lin_2.5e-4, clip_range lin_0.1, vf_coef 0.5, ent_coef 0.01

`learn()` is called with total_timesteps=1e7 as in the zoo (so the linear schedules decay exactly
as in a full zoo run) and a callback stops it once `--seconds` have passed since the process
started (measured from the first line of this script, i.e. without interpreter start-up).

Figures recorded:
  * env_steps: SB3's `num_timesteps` = agent steps summed over the 8 envs (one agent step is
    4 emulator frames); frames = 4 * env_steps (nominal: noop/fire resets are not counted).
  * env_steps_per_s: env_steps / (end - start of learn()), i.e. after env and model construction.
  * sb3_fps: SB3's own `time/fps` (logged once per rollout, before that rollout's update: steps since
    learn() started / seconds since learn() started); `sb3_fps_log` holds every value logged.
  * ppo_iterations: rollout + update cycles finished; gradient_steps: optimizer steps counted by a
    hook (n_epochs * n_envs * n_steps / batch_size = 16 per iteration); sb3_n_updates: SB3's own
    `train/n_updates`, which counts epochs (4 per iteration), not minibatch steps.
"""
from __future__ import annotations

import time

START: float = time.time()  # "t" = seconds since here (before the heavy imports)

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
from typing import Any, Callable  # noqa: E402

import ale_py  # noqa: E402
import gymnasium  # noqa: E402
import stable_baselines3 as sb3  # noqa: E402
import torch  # noqa: E402
from stable_baselines3 import PPO  # noqa: E402
from stable_baselines3.common.callbacks import BaseCallback  # noqa: E402
from stable_baselines3.common.env_util import make_atari_env  # noqa: E402
from stable_baselines3.common.logger import HumanOutputFormat, KVWriter, Logger  # noqa: E402
from stable_baselines3.common.vec_env import VecEnv, VecEnvWrapper, VecFrameStack  # noqa: E402

gymnasium.register_envs(ale_py)  # makes the *NoFrameskip-v4 ids available

N_TIMESTEPS = int(1e7)  # zoo's n_timesteps; only drives the linear schedules here


def now() -> float:
    return time.time() - START


def linear_schedule(initial: float) -> Callable[[float], float]:
    """The zoo's `lin_<value>`: value * progress_remaining (1 -> 0 over n_timesteps)."""
    return lambda progress_remaining: progress_remaining * initial


class TimedPPO(PPO):
    """PPO that notes when each update (train()) finishes."""

    first_update_t: float | None = None
    iterations: int = 0

    def train(self) -> None:
        super().train()
        self.iterations += 1
        if self.first_update_t is None:
            self.first_update_t = now()


class StopAfter(BaseCallback):
    """Stops learn() at the first env step after the deadline (seconds since START)."""

    def __init__(self, deadline: float) -> None:
        super().__init__()
        self.deadline = deadline

    def _on_step(self) -> bool:
        return now() < self.deadline


class StepCounter:
    """Optimizer step post-hook that counts gradient steps."""

    def __init__(self) -> None:
        self.n = 0

    def __call__(self, *_: Any) -> None:
        self.n += 1


class FpsRecorder(KVWriter):
    """Logger output that keeps every `time/fps` SB3 logs as [t, num_timesteps, fps]."""

    def __init__(self) -> None:
        self.log: list[list[float]] = []

    def write(self, key_values: dict[str, Any], key_excluded: dict[str, Any], step: int = 0) -> None:
        if "time/fps" in key_values:
            self.log.append([round(now(), 2), step, key_values["time/fps"]])


def wrapper_chain(env: VecEnv) -> list[str]:
    names = []
    while isinstance(env, VecEnvWrapper):
        names.append(type(env).__name__)
        env = env.venv
    return names + [type(env).__name__]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--env", default="PongNoFrameskip-v4")
    p.add_argument("--seconds", type=float, default=60.0, help="wall-clock budget from process start")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--n-envs", type=int, default=8)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's own)")
    p.add_argument("--verbose", action="store_true", help="also print SB3's per-iteration log table")
    p.add_argument("--json", default=None, help="write the result JSON here (always printed too)")
    a = p.parse_args()

    if a.threads is not None:
        torch.set_num_threads(a.threads)

    env = VecFrameStack(make_atari_env(a.env, n_envs=a.n_envs, seed=a.seed), n_stack=4)
    env_ready_t = now()
    model = TimedPPO(
        "CnnPolicy", env, n_steps=128, n_epochs=4, batch_size=256,
        learning_rate=linear_schedule(2.5e-4), clip_range=linear_schedule(0.1),
        vf_coef=0.5, ent_coef=0.01, seed=a.seed, device=a.device, verbose=0,
    )
    fps = FpsRecorder()
    outputs: list[KVWriter] = [fps] + ([HumanOutputFormat(sys.stdout)] if a.verbose else [])
    model.set_logger(Logger(folder=None, output_formats=outputs))
    grad_steps = StepCounter()
    model.policy.optimizer.register_step_post_hook(grad_steps)
    model_ready_t = now()

    learn_start_t = now()
    model.learn(total_timesteps=N_TIMESTEPS, callback=StopAfter(a.seconds))
    end_t = now()
    env.close()

    train_s = end_t - learn_start_t
    steps = int(model.num_timesteps)
    result = {
        "library": "stable-baselines3",
        "algo": "PPO (rl-baselines3-zoo hyperparams/ppo.yml atari)",
        "env": a.env,
        "seed": a.seed,
        "n_envs": a.n_envs,
        "device": str(model.device),
        "vec_env": wrapper_chain(model.get_env()),
        "torch_threads": torch.get_num_threads(),
        "seconds_budget": a.seconds,
        "env_steps": steps,
        "frames": 4 * steps,
        "ppo_iterations": model.iterations,
        "gradient_steps": grad_steps.n,
        "sb3_n_updates": int(model._n_updates),
        "env_ready_s": round(env_ready_t, 2),
        "model_ready_s": round(model_ready_t, 2),
        "first_update_s": round(model.first_update_t, 2) if model.first_update_t is not None else None,
        "end_s": round(end_t, 2),
        "train_s": round(train_s, 2),
        "env_steps_per_s": round(steps / train_s, 1),
        "frames_per_s": round(4 * steps / train_s, 1),
        "env_steps_per_s_process": round(steps / end_t, 1),
        "sb3_fps": fps.log[-1][2] if fps.log else None,
        "sb3_fps_log": fps.log,
        "versions": {
            "python": sys.version.split()[0], "stable-baselines3": sb3.__version__, "torch": torch.__version__,
            "gymnasium": gymnasium.__version__, "ale-py": ale_py.__version__,
        },
    }
    text = "{\n" + ",\n".join(f" {json.dumps(k)}: {json.dumps(v)}" for k, v in result.items()) + "\n}"
    if a.json:
        with open(a.json, "w") as f:
            f.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

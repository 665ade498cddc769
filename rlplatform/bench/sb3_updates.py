"""Stable-Baselines3's own update, timed for `bench learner --ways sb3`.

Run as a script by a Python that has stable-baselines3 (the user's SB3 installation, or ours with the
`bench` extra), so it imports nothing of rlplatform. argv[1] is a JSON spec (algorithm, env, batch and
network shapes, learning rate, epochs, torch threads); it builds SB3's model with those shapes, fills
its buffer (random actions for SAC and DQN, one rollout of its own policy for PPO, through `learn()`), warms up and prints
one JSON line `{"ready": ...}`. Then, for each line of stdin holding a number of seconds, it calls SB3's
`train()` for that long and prints `{"updates": gradient steps, "calls": train() calls, "seconds": s}`,
so that `bench learner` can interleave it with its other ways.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any, Callable

ACTIVATIONS = {"relu": "ReLU", "tanh": "Tanh", "elu": "ELU", "swish": "SiLU", "silu": "SiLU"}


def build(spec: dict[str, Any]) -> tuple[Callable[[], int], dict[str, Any]]:
    """SB3's model for the spec, its buffer filled; returns one `train()` call (-> gradient steps) and facts."""
    import warnings

    import gymnasium as gym
    import stable_baselines3 as sb3
    import torch
    from stable_baselines3.common.logger import configure

    warnings.filterwarnings("ignore", category=UserWarning)  # e.g. SB3's note on a batch not a multiple of the minibatch
    torch.set_num_threads(int(spec["threads"]))
    activation = getattr(torch.nn, ACTIVATIONS.get(spec["activation"], "ReLU"))
    hidden = list(spec["hidden"])
    algorithm = spec["algorithm"]
    env = gym.make(spec["env"], **spec.get("env_config", {}))
    if algorithm == "PPO":
        step, model = _ppo(spec, activation, hidden)
    else:
        model = _off_policy(sb3, algorithm, env, spec, activation, hidden)
        k, batch = int(spec["updates_per_call"]), int(spec["batch_size"])

        def step() -> int:
            model.train(gradient_steps=k, batch_size=batch)
            return k
    model.set_logger(configure(folder=None, format_strings=[]))
    return step, {"sb3": sb3.__version__, "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
                  "policy": str(model.policy).replace("\n", " ")[:2000]}


def _off_policy(sb3: Any, algorithm: str, env: Any, spec: dict[str, Any], activation: Any, hidden: list[int]) -> Any:
    import numpy as np

    kwargs: dict[str, Any] = dict(batch_size=int(spec["batch_size"]), learning_rate=float(spec["lr"]),
                                  gamma=float(spec["gamma"]), buffer_size=int(spec["buffer_steps"]), learning_starts=0,
                                  policy_kwargs=dict(net_arch=hidden, activation_fn=activation), device="cpu", seed=0)
    if algorithm == "SAC":
        kwargs["tau"] = float(spec.get("tau", 0.005))
    model = getattr(sb3, algorithm)("MlpPolicy", env, **kwargs)
    obs, _ = env.reset(seed=0)
    env.action_space.seed(0)
    for _ in range(int(spec["buffer_steps"])):
        action = env.action_space.sample()
        next_obs, reward, terminated, truncated, info = env.step(action)
        model.replay_buffer.add(obs[None], next_obs[None], np.asarray(action)[None], np.asarray([reward]),
                                np.asarray([terminated]), [info])
        obs = env.reset()[0] if terminated or truncated else next_obs
    return model


def _ppo(spec: dict[str, Any], activation: Any, hidden: list[int]) -> tuple[Callable[[], int], Any]:
    import math

    from stable_baselines3 import PPO
    from stable_baselines3.common.env_util import make_vec_env

    n_envs = int(spec["envs"])
    n_steps = max(1, int(spec["batch_size"]) // n_envs)
    venv = make_vec_env(spec["env"], n_envs=n_envs, seed=0, env_kwargs=spec.get("env_config", {}))
    minibatch, epochs = int(spec["minibatch_size"]), int(spec["epochs"])
    model = PPO("MlpPolicy", venv, n_steps=n_steps, batch_size=minibatch, n_epochs=epochs,
                learning_rate=float(spec["lr"]), gamma=float(spec["gamma"]), gae_lambda=float(spec["lambda"]),
                clip_range=float(spec["clip"]), ent_coef=float(spec["entropy_coeff"]),
                vf_coef=float(spec["vf_coeff"]), max_grad_norm=float(spec["grad_clip"]),
                policy_kwargs=dict(net_arch=dict(pi=hidden, vf=hidden), activation_fn=activation), device="cpu",
                seed=0)
    model.learn(total_timesteps=n_steps * n_envs)  # one rollout into the buffer (and a first train() on it)
    steps_per_call = epochs * math.ceil(n_steps * n_envs / minibatch)

    def step() -> int:
        model.train()  # the epochs over the rollout buffer, as learn() calls it after each rollout
        return steps_per_call

    return step, model


def main() -> None:
    spec = json.loads(sys.argv[1])
    step, facts = build(spec)
    updates = 0
    while updates < int(spec["warmup"]):
        updates += step()
    print(json.dumps({"ready": facts}), flush=True)
    for line in sys.stdin:
        seconds = float(line)
        updates = calls = 0
        started = time.perf_counter()
        while time.perf_counter() - started < seconds:
            updates += step()
            calls += 1
        print(json.dumps({"updates": updates, "calls": calls, "seconds": time.perf_counter() - started}), flush=True)


if __name__ == "__main__":
    main()

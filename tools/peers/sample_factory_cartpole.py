#!/usr/bin/env python
"""Peer benchmark: Sample Factory 2.1.1 (APPO) on CartPole-v1, time/env-steps to a target return.

Runs with the Sample Factory virtualenv's python (see README.md next to this file); it does not
import rlplatform. Training runs in-process through Sample Factory's own runner, configured exactly
like its shipped example (sf_examples/train_gym_env.py, CartPole-v1 command in its docstring) with
--num_workers / --num_envs_per_worker overridden and --device=cpu.

Figures recorded:
  * env_steps (trained): the learner's env-step counter, what SF logs as "Total num frames" and
    uses for its FPS (frameskip is 1 for CartPole, so frames == env steps).
  * env_steps (sampled): SF's "Samples" counter (observations processed by the inference worker,
    reported to the runner every 3 s, so it lags by up to 3 s).
  * mean100: mean raw (unscaled) return of the last 100 finished episodes, computed here from the
    same per-episode messages SF feeds into its own --stats_avg=100 deque ("Avg episode reward" in
    the log, "reward/reward" in TensorBoard). The target only counts once 100 episodes are done.
  * sf_fps_log: the FPS SF itself prints every 5 s (10 s / 60 s / 300 s windows).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections import deque
from typing import Any

import numpy as np
import psutil

PROCESS_START: float = psutil.Process().create_time()  # epoch seconds, "wall_s" is measured from here

# The CartPole-v1 command from sf_examples/train_gym_env.py's docstring, minus experiment name.
EXAMPLE_ARGS: list[str] = [
    "--algo=APPO", "--use_rnn=False", "--num_envs_per_worker=20", "--policy_workers_per_policy=2",
    "--recurrence=1", "--with_vtrace=False", "--batch_size=512", "--reward_scale=0.1",
    "--save_every_sec=10", "--experiment_summaries_interval=10", "--env=CartPole-v1",
]


def now() -> float:
    return time.time() - PROCESS_START


def sf_argv(a: argparse.Namespace) -> list[str]:
    overrides = {
        "num_workers": a.workers, "num_envs_per_worker": a.envs_per_worker, "device": "cpu",
        "seed": a.seed, "train_dir": a.train_dir, "experiment": f"cartpole_s{a.seed}_{int(PROCESS_START)}",
    }
    keep = [x for x in EXAMPLE_ARGS if x.split("=")[0][2:] not in overrides]
    return keep + [f"--{k}={v}" for k, v in overrides.items()]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=120.0, help="wall-clock budget from process start")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--envs-per-worker", type=int, default=16)
    p.add_argument("--target", type=float, default=475.0)
    p.add_argument("--train-dir", default="/tmp/sf_cartpole")
    p.add_argument("--json", default=None, help="write the result JSON here (always printed too)")
    a = p.parse_args()

    from sample_factory.algo.runners.runner import AlgoObserver, Runner
    from sample_factory.algo.utils.misc import EPISODIC, ExperimentStatus
    from sample_factory.train import make_runner
    from sf_examples.train_gym_env import parse_custom_args, register_custom_components
    from signal_slot.signal_slot import EventLoopObject, Timer

    argv = sf_argv(a)
    register_custom_components()
    _, runner = make_runner(parse_custom_args(argv))  # cfg may be reloaded; runner keeps it

    class Probe(AlgoObserver, EventLoopObject):
        """Collects episode returns and counters in the runner process; stops at target or deadline."""

        def __init__(self, runner: Runner) -> None:
            EventLoopObject.__init__(self, runner.event_loop, "peer_probe")
            self.runner = runner
            self.returns: deque[float] = deque(maxlen=100)
            self.episodes = 0
            self.curve: list[list[float]] = []  # [t, env_steps_trained, mean100]
            self.fps_log: list[list[float]] = []  # [t, env_steps_trained, fps_10s, fps_60s]
            self.hit: dict[str, float] | None = None
            self.last_point = -1.0
            runner.register_episodic_stats_handler(self.on_episode)
            runner.register_observer(self)
            timer = Timer(runner.event_loop, 0.5)
            timer.timeout.connect(self.tick)
            runner.timers.append(timer)
            sf_print_stats = runner.print_stats

            def print_stats(fps: list[float], throughput: dict, total_env_steps: int) -> None:
                self.fps_log.append([round(now(), 2), total_env_steps, finite(fps[0]), finite(fps[1])])
                sf_print_stats(fps, throughput, total_env_steps)

            runner.print_stats = print_stats

        def steps(self) -> tuple[int, int]:
            return self.runner.env_steps.get(0, 0), self.runner.samples_collected[0]

        def mean100(self) -> float | None:
            return round(float(np.mean(self.returns)), 2) if self.returns else None

        def on_episode(self, _runner: Runner, msg: dict[str, Any], _policy_id: int) -> None:
            rewards = np.atleast_1d(msg[EPISODIC]["reward"]).astype(float)
            self.returns.extend(rewards.tolist())
            self.episodes += len(rewards)
            if self.hit is None and len(self.returns) == 100 and (self.mean100() or 0.0) >= a.target:
                trained, sampled = self.steps()
                self.hit = dict(t=now(), env_steps=trained, env_steps_sampled=sampled, episodes=self.episodes)
                self.tick()

        def tick(self) -> None:
            t = now()
            if t - self.last_point >= 1.0 or self.hit is not None:
                self.curve.append([round(t, 2), self.steps()[0], self.mean100()])
                self.last_point = t
            if (self.hit is not None or t >= a.seconds) and not self.runner.stopped:
                self.stop_t, (self.stop_steps, self.stop_sampled) = t, self.steps()
                self.runner._stop_training()  # what SF itself calls on its stop conditions

    probe = Probe(runner)
    status = runner.init()
    if status == ExperimentStatus.SUCCESS:
        status = runner.run()
    if not hasattr(probe, "stop_t"):  # ended on its own (error / interrupt)
        probe.stop_t, (probe.stop_steps, probe.stop_sampled) = now(), probe.steps()

    main_loop_s = runner.timing.get("main_loop", float("nan"))
    hit = probe.hit or {}
    result = {
        "library": "sample-factory",
        "version": _dist_version("sample-factory"),
        "command": "python -m sf_examples.train_gym_env " + " ".join(argv),
        "seed": a.seed,
        "workers": a.workers,
        "envs_per_worker": a.envs_per_worker,
        "target": a.target,
        "reached": probe.hit is not None,
        "wall_s": round(hit["t"], 2) if hit else None,
        "env_steps": hit.get("env_steps"),
        "env_steps_sampled_at_target": hit.get("env_steps_sampled"),
        "episodes_at_target": hit.get("episodes"),
        "stopped_at_s": round(probe.stop_t, 2),
        "env_steps_total": probe.stop_steps,
        "env_steps_sampled_total": probe.stop_sampled,
        # over the whole process lifetime (includes ~startup), and SF's own end-of-run figure
        "env_steps_per_s_trained": round(probe.stop_steps / probe.stop_t, 1),
        "env_steps_per_s_sampled": round(probe.stop_sampled / probe.stop_t, 1),
        "sf_final_fps": finite((runner.total_env_steps_since_resume or 0) / main_loop_s),
        "sf_main_loop_s": finite(main_loop_s, 2),
        "reward_window": "true mean of the last 100 finished episodes (raw return, = SF stats_avg=100)",
        "sf_status": int(status),
        "curve": probe.curve,
        "sf_fps_log": probe.fps_log,
    }
    text = "{\n" + ",\n".join(f" {json.dumps(k)}: {json.dumps(v)}" for k, v in result.items()) + "\n}"
    if a.json:
        with open(a.json, "w") as f:
            f.write(text + "\n")
    print(text)
    return 0 if status == ExperimentStatus.SUCCESS else 1


def finite(x: float, ndigits: int = 1) -> float | None:
    """Rounded value, or None for NaN/inf (keeps the JSON strict)."""
    return round(x, ndigits) if np.isfinite(x) else None


def _dist_version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


if __name__ == "__main__":
    sys.exit(main())

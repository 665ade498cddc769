"""Envs per runner without a bench cache: `--profile auto` measures the env's step cost at start-up.

Where an experiment leaves `scale.envs_per_runner` open (its file, its profile and --set give none)
and `bench throughput` has measured no layout for this machine and env (`config/layouts.py`, which
keeps priority), the driver builds one env as an env runner builds it, before Ray starts, and steps
it with random actions for at most `MEASURE_STEPS` steps or `MEASURE_SECONDS`, and takes the median
wall time of a step (wall time: an env that waits on a simulator makes the runner wait as long; the
median: on a shared machine another process takes the core for whole time slices now and then). Then:

    n = ceil(ENV_SHARE_FACTOR * RUNNER_FIXED_COST_S / step cost), clamped to [1, MAX_ENVS],
    at most train batch / (runners x fragment), rounded down to a power of two.

`RUNNER_FIXED_COST_S` is what an env runner spends per vector step besides the envs (policy forward
pass, connectors, bookkeeping): `bench throughput` layouts 1x1 vs 1x16 on the development machine
(2 cores, 2026-12-06) gave ~195-210 us on CartPole-v1 and on CostlySim-v0 with work_ms 1 (plus
~18 us per env and step on CartPole). With `ENV_SHARE_FACTOR` 4, env time is >= ~80 % of a
runner's time when that is reachable: an env of >= 0.8 ms per step gets 1 env (CostlySim work_ms 1:
84 % of the raw rate with 1 env), CartPole (~9 us) the 64 of the cap, bounded by the batch.

The batch bound keeps every env's share of a train batch at least `MIN_FRAGMENT` steps (RLlib's
APPO/IMPALA default fragment, or the experiment's own `rollout_fragment_length`): APPO's default
batch of 500 on one runner gives 8 envs (fragments of 62 steps), PPO's default of 4000 the cap of
64. On 2 cores APPO CartPole solved in 27.5-47.8 s with 8 envs (4 runs, 208-416k env steps), in
70.7 and 102.8 s with 16 (31-step fragments, 0.8-1.1M env steps) at ~20 % more env steps/s. A PPO
experiment that gives its own `rollout_fragment_length` is not sized (RLlib wants runners x envs x
fragment to make PPO's batch: the fragment fixes the envs). Only the on-policy algorithms (PPO,
APPO, IMPALA) are sized: for DQN and SAC the envs per runner set how much data each update sees,
so they stay at the schema's 1. Multi-agent experiments are left alone, as by the cache.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Any, Callable, Optional

RUNNER_FIXED_COST_S = 200e-6  # per vector step of an env runner, besides the envs (see above)
ENV_SHARE_FACTOR = 4  # env time >= 4 x the fixed cost: >= ~80 % of a runner's time in the envs
MAX_ENVS = 64
MIN_FRAGMENT = 50  # steps each env contributes to one train batch, at least (RLlib's APPO/IMPALA default fragment)
MEASURE_STEPS = 300
MEASURE_SECONDS = 0.2
WARMUP_STEPS = 5
ON_POLICY = ("PPO", "APPO", "IMPALA")

SOURCE_EXPERIMENT = "experiment"
SOURCE_CACHE = "bench throughput cache"
SOURCE_MEASURED = "step-cost measurement at start-up"
SOURCE_DEFAULT = "default"
SOURCE_RESUMED = "resumed run"


def measure_step_cost(env: str, env_config: dict[str, Any], max_steps: int = MEASURE_STEPS,
                      max_seconds: float = MEASURE_SECONDS) -> Optional[float]:
    """Wall seconds per step (the median, so that another process taking the core now and then does not
    count) of one env built as the env runners build it, random actions; None when the env cannot be
    built or stepped (the run's own checks report it)."""
    try:
        from rlplatform.config.env_ids import make_env

        env_obj = make_env(env, **env_config)
    except Exception:
        return None
    try:
        env_obj.reset(seed=0)
        env_obj.action_space.seed(0)
        deadline = time.perf_counter() + max_seconds / 4
        for _ in range(WARMUP_STEPS):  # first steps may compile or load; an env that waits gets one
            if _step(env_obj) or time.perf_counter() > deadline:
                break
        times: list[float] = []
        start = time.perf_counter()
        while len(times) < max_steps and (not times or time.perf_counter() - start < max_seconds):
            before = time.perf_counter()
            _step(env_obj)
            times.append(time.perf_counter() - before)
        return statistics.median(times)
    except Exception:
        return None
    finally:
        try:
            env_obj.close()
        except Exception:
            pass


def _step(env_obj: Any) -> bool:
    _, _, terminated, truncated, _ = env_obj.step(env_obj.action_space.sample())
    if terminated or truncated:
        env_obj.reset()
    return bool(terminated or truncated)


def envs_for_step_cost(step_cost_s: float, batch_bound: int = MAX_ENVS) -> int:
    """The rule: ceil(4 x fixed cost / step cost) in [1, 64], at most `batch_bound`, a power of two."""
    wanted = math.ceil(ENV_SHARE_FACTOR * RUNNER_FIXED_COST_S / max(step_cost_s, 1e-9))
    n = max(1, min(MAX_ENVS, wanted, batch_bound))
    return 1 << (n.bit_length() - 1)


def batch_bound(config: Any, train_batch: Optional[int]) -> int:
    """Most envs per runner such that runners x envs x fragment fits one train batch (at least 1).
    `train_batch` is RLlib's total train batch for the experiment (`adapter.algorithm_config.total_train_batch`);
    None when RLlib refuses the training section (the plan reports that itself)."""
    if train_batch is None:
        return MAX_ENVS
    scale = config.scale
    fragment = scale.rollout_fragment_length if isinstance(scale.rollout_fragment_length, int) else MIN_FRAGMENT
    return max(1, train_batch // (max(1, scale.env_runners) * fragment))


def apply_step_cost(config: Any, given_keys: set[str], train_batch: Optional[int],
                    measure: Callable[[str, dict[str, Any]], Optional[float]] = measure_step_cost,
                    ) -> tuple[Any, Optional[dict[str, Any]]]:
    """`--profile auto` without a cached layout: envs per runner from the env's measured step cost,
    where `given_keys` leave it open. Returns the config and the choice (envs, step cost) or None."""
    if "scale.envs_per_runner" in given_keys or config.multi_agent is not None or config.algorithm not in ON_POLICY:
        return config, None
    if config.algorithm == "PPO" and isinstance(config.scale.rollout_fragment_length, int):
        return config, None  # RLlib wants runners x envs x fragment = PPO's batch: the fragment fixes the envs
    cost = measure(config.env, dict(config.env_config))
    if cost is None:
        return config, None
    envs = envs_for_step_cost(cost, batch_bound(config, train_batch))
    updated = config.model_copy(update={"scale": config.scale.model_copy(update={"envs_per_runner": envs})})
    return type(config).model_validate(updated.model_dump()), {"envs_per_runner": envs, "step_cost_s": cost}


def describe(choice: dict[str, Any]) -> str:
    """The start-up line for a measured choice."""
    return (f"envs per runner: {choice['envs_per_runner']} (step-cost measurement at start-up: "
            f"{choice['step_cost_s'] * 1e6:,.1f} us per env step; rule in docs/experiments.md)")

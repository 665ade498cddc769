"""Regenerate the saved RLlib results that tests/test_results.py maps: run from the project root,

    python tests/data/make_rllib_results.py

Each file holds one real `Algorithm.train()` result of Ray RLlib (the version in `ray_version`), from the
AlgorithmConfig that `rlplatform train` builds for the overrides given (the platform's episode recorder
included: it puts each finished episode's return and length into the result), with one remote env
runner on a private local Ray instance, made JSON-serialisable: numbers, strings, lists and dicts only.
Keys whose values cannot be written as JSON are dropped (none that `from_rllib_result` reads), and so is
`config` (the AlgorithmConfig as a dict: half the file, never read by the mapping).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
RUNS = {
    # One remote runner, a short evaluation each iteration: fault-tolerance and evaluation keys are filled.
    "ppo": ["scale.env_runners=1", "scale.envs_per_runner=2", "training.train_batch_size_per_learner=400",
            "training.minibatch_size=100", "training.num_epochs=3", "evaluation.interval=1", "evaluation.episodes=2"],
    "dqn": ["scale.env_runners=1", "training.num_steps_sampled_before_learning_starts=200"],
}
EXPERIMENTS = {"ppo": "cartpole_ppo", "dqn": "cartpole_dqn"}
DROPPED = ("config",)


def plain(value):
    """JSON-serialisable copy: numpy and torch scalars to numbers, deques and tuples to lists; None where impossible."""
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            item = plain(item)
            if item is not None:
                out[str(key)] = item
        return out
    if isinstance(value, (list, tuple)) or type(value).__name__ == "deque":
        return [plain(v) for v in value]
    if isinstance(value, bool) or isinstance(value, str) or value is None:
        return value
    if isinstance(value, (int, float)):
        return value if not isinstance(value, float) or math.isfinite(value) else str(value)
    if hasattr(value, "item"):
        try:
            return plain(value.item())
        except (ValueError, RuntimeError):
            return plain(value.tolist()) if hasattr(value, "tolist") else None
    return None


def one_result(name: str) -> dict:
    import ray

    from rlplatform.adapter.algorithm_config import build_algorithm_config, epochs_per_batch
    from rlplatform.config.experiment import resolve_experiment

    config = resolve_experiment(ROOT / "experiments" / f"{EXPERIMENTS[name]}.yaml", RUNS[name], "laptop").config
    ray.init(address="local", num_cpus=2, num_gpus=0, include_dashboard=False, logging_level="ERROR")
    try:
        algo = build_algorithm_config(config).build_algo()
        try:
            result = algo.train()
        finally:
            algo.stop()
    finally:
        ray.shutdown()
    result = {k: v for k, v in result.items() if k not in DROPPED}
    return {"experiment": EXPERIMENTS[name], "overrides": RUNS[name], "epochs_per_batch": epochs_per_batch(config),
            "ray_version": ray.__version__, "result": plain(result)}


def main() -> None:
    names = sys.argv[1:] or list(RUNS)
    for name in names:
        data = one_result(name)
        path = HERE / f"rllib_result_{name}.json"
        path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
        print(f"{path}: {path.stat().st_size} bytes")


if __name__ == "__main__":
    main()

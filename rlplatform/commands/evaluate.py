"""`rlplatform evaluate RUN_DIR|CHECKPOINT|EXPORT`: greedy episodes with only the policy network loaded.

No Ray cluster, no env runners, no learners: the RLModule is read from the checkpoint and
stepped in one env in this process. `--video DIR` records MP4s with gymnasium's RecordVideo.
An export (`rlplatform export`: a directory with export.json, or a .onnx/.pt file) runs with
onnxruntime (or torch) alone: Ray and RLlib are not imported.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path
from typing import Any, Optional

from rlplatform import console
from rlplatform.config.schema import ExperimentConfig, validate
from rlplatform.errors import UserError
from rlplatform.run.checkpoints import find_checkpoint
from rlplatform.run.run_dir import check_writable


def add_parser(subparsers: Any) -> None:  # argparse's sub-parsers action
    p = subparsers.add_parser(
        "evaluate", help="run greedy episodes of a trained policy, optionally with video",
        description="Run greedy episodes of a trained policy in this process. It starts no Ray instance; a checkpoint is "
                    "loaded with RLlib (imported), an export with onnxruntime (torch for TorchScript) alone.")
    p.add_argument("target", type=Path, metavar="RUN_DIR|CHECKPOINT|EXPORT")
    p.add_argument("--episodes", type=int, default=10, help="episodes to run (default: 10)")
    p.add_argument("--video", type=Path, metavar="DIR", help="write an MP4 of every episode into DIR")
    p.add_argument("--seed", type=int, default=0, help="episode i is reset with seed S+i (default: 0)")
    p.add_argument("--checkpoint", choices=("best", "latest"), default="best", help="which checkpoint of a run directory")
    p.add_argument("--json", type=Path, metavar="FILE", help="also write the results as JSON")
    p.add_argument("--policy", help="policy (module) id; default: the only or default policy")
    p.add_argument("--env", metavar="ID", help="env of an exported model file with no export.json beside it")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.episodes < 1:
        raise UserError(f"--episodes must be at least 1, not {args.episodes}")
    if args.video:
        check_writable(args.video)
    if is_export(args.target):
        return run_exported(args)
    if args.env:
        raise UserError("--env is for an exported model file; a checkpoint evaluates on the env it was trained on")
    info = find_checkpoint(args.target, args.checkpoint, args.policy)
    config = validate(info.meta["config"], source=str(info.path)) if "config" in info.meta else None
    if config is None:
        raise UserError(f"checkpoint {info.path} carries no experiment config")
    results = evaluate(info.path, config, args.episodes, args.seed, args.video, args.policy)
    console.say(f"checkpoint: {info.path} (iteration {info.iteration}, {info.env_steps:,} env steps)")
    report(results, args.json, {"checkpoint": str(info.path)})
    return 0


def report(results: dict, json_file: Optional[Path], source: dict) -> None:
    returns, lengths = results["returns"], results["lengths"]
    console.say(
        f"{len(returns)} episodes: return {statistics.mean(returns):.2f} ± {statistics.pstdev(returns):.2f}, "
        f"length {statistics.mean(lengths):.1f} ± {statistics.pstdev(lengths):.1f}"
    )
    for name, values in results.get("per_policy_returns", {}).items():
        console.say(f"  policy {name}: return {statistics.mean(values):.2f} ± {statistics.pstdev(values):.2f}")
    if "illegal_actions" in results:
        console.say(f"illegal actions (against the observation's mask): {results['illegal_actions']}")
    for video in results["videos"]:
        console.say(f"video: {video}")
    if json_file:
        json_file.write_text(json.dumps({**source, **results}, indent=1))


def is_export(target: Path) -> bool:
    from rlplatform.export.spec import FORMATS, SPEC_FILE

    return (target.is_file() and target.suffix in FORMATS.values()) or (target / SPEC_FILE).is_file()


def run_exported(args: argparse.Namespace) -> int:
    """An export directory or model file, run with onnxruntime (or torch for TorchScript) alone: no Ray, no RLlib."""
    from rlplatform.export.spec import read_spec, spec_beside

    spec = read_spec(args.target) if args.target.is_dir() else spec_beside(args.target)
    env = args.env or (spec or {}).get("env")
    if env is None:
        raise UserError(f"{args.target}: no export.json beside it names the env: give --env ID")
    env_config = (spec or {}).get("env_config", {}) if env == (spec or {}).get("env") else {}
    root = args.target if args.target.is_dir() else args.target.parent
    policies = _exported_policies(args, spec, root)
    mapping = (spec or {}).get("multi_agent")
    if mapping:
        if args.video:
            raise UserError("--video is not supported for multi-agent envs yet")
        results = run_multi_agent_episodes(policies, mapping["mapping"], env, env_config, args.episodes, args.seed)
    else:
        (policy,) = policies.values()
        name = (spec or {}).get("source", {}).get("experiment") or args.target.stem
        results = run_episodes(policy, env, env_config, args.episodes, args.seed, args.video, name=name)
    console.say(f"exported policy: {args.target} (env {env})")
    report(results, args.json, {"export": str(args.target)})
    return 0


def _exported_policies(args: argparse.Namespace, spec: Optional[dict], root: Path) -> dict:
    from rlplatform.export.runtime import ExportedPolicy

    if spec is None:  # a bare model file
        return {"policy": ExportedPolicy(args.target, seed=args.seed)}
    described = spec["policies"]
    if args.target.is_file():
        described = {name: p for name, p in described.items() if p["file"] == args.target.name}
    elif args.policy:
        if args.policy not in described:
            raise UserError(f"{args.target} has no policy {args.policy!r}; it has: {', '.join(described)}")
        described = {args.policy: described[args.policy]}
    if len(described) > 1 and not spec.get("multi_agent"):
        raise UserError(f"{args.target}: several policies; name one with --policy")
    if spec.get("multi_agent") and set(described) != set(spec["policies"]):
        raise UserError(f"{args.target}: a multi-agent env needs every policy of the export; give the directory")
    return {name: ExportedPolicy(root / p["file"], p, seed=args.seed) for name, p in described.items()}


class CheckpointPolicy:
    """An RLModule from a checkpoint, acting greedily: RLlib's action, as the env gets it."""

    def __init__(self, module: Any, config: ExperimentConfig) -> None:
        self.module, self.config = module, config

    def initial_state(self) -> Any:
        from rlplatform.adapter import policy as rllib_policy

        return rllib_policy.initial_state(self.module)

    def act(self, observations: Any, state: Any = None) -> tuple[list[Any], Any]:
        from rlplatform.adapter import policy as rllib_policy

        actions, state = rllib_policy.greedy_actions(self.module, observations, state)
        return [rllib_policy.to_env_action(a, self.module.action_space, self.config) for a in actions], state


def evaluate(checkpoint: Path, config: ExperimentConfig, episodes: int, seed: int, video_dir: Optional[Path], policy: Optional[str] = None) -> dict:
    from rlplatform.adapter import policy as rllib_policy

    if config.multi_agent is not None:
        if video_dir:
            raise UserError("--video is not supported for multi-agent envs yet")
        modules = {name: CheckpointPolicy(rllib_policy.load_inference_module(checkpoint, name), config)
                   for name in config.multi_agent.policies}
        return run_multi_agent_episodes(modules, config.multi_agent.mapping, config.env, config.env_config, episodes, seed)
    module = CheckpointPolicy(rllib_policy.load_inference_module(checkpoint, policy), config)
    return run_episodes(module, config.env, config.env_config, episodes, seed, video_dir, name=config.name,
                        action_mask=config.model.action_mask)


def run_episodes(policy: Any, env_id: str, env_config: dict, episodes: int, seed: int, video_dir: Optional[Path], name: str,
                 trajectories: Optional[list[dict[str, Any]]] = None, action_mask: Optional[str] = None) -> dict:
    """Greedy episodes; `policy` has initial_state() and act(observations, state) -> (env actions, state).
    `trajectories`: a list that gets each episode's observations, env actions, rewards and how it ended.
    `action_mask`: the observation's mask key; the results then count the actions it forbade (`illegal_actions`)."""
    import gymnasium as gym

    from rlplatform.config.env_ids import make_env

    if video_dir:  # frames are drawn off-screen: no display, no sound card (SDL would look for both, noisily)
        os.environ.setdefault("SDL_VIDEODRIVER", "dummy")
        os.environ.setdefault("SDL_AUDIODRIVER", "dummy")
    env = make_env(env_id, render_mode="rgb_array" if video_dir else None, **env_config)
    if video_dir:
        video_dir.mkdir(parents=True, exist_ok=True)
        env = gym.wrappers.RecordVideo(env, str(video_dir), episode_trigger=lambda _: True,
                                       name_prefix=f"{name}-seed{seed}", disable_logger=True)
    returns, lengths, illegal = [], [], 0
    try:
        for episode in range(episodes):
            obs, _ = env.reset(seed=seed + episode)
            state = policy.initial_state()
            done, total, steps = False, 0.0, 0
            played: dict[str, Any] = {"observations": [obs], "actions": [], "rewards": []}
            while not done:
                actions, state = policy.act(batch_of_one(obs), state)
                if action_mask is not None:
                    illegal += int(not obs[action_mask][int(actions[0])])
                obs, reward, terminated, truncated, _ = env.step(actions[0])
                total, steps, done = total + float(reward), steps + 1, terminated or truncated
                if trajectories is not None:
                    played["observations"].append(obs)
                    played["actions"].append(actions[0])
                    played["rewards"].append(float(reward))
            returns.append(total)
            lengths.append(steps)
            if trajectories is not None:
                trajectories.append({**played, "terminated": bool(terminated), "spaces": (env.observation_space, env.action_space)})
    finally:
        env.close()
    videos = sorted(str(p) for p in video_dir.glob("*.mp4")) if video_dir else []
    counted = {"illegal_actions": illegal} if action_mask is not None else {}
    return {"returns": returns, "lengths": lengths, "videos": videos, **counted}


def batch_of_one(obs: Any) -> Any:
    """An observation as a batch of one (a Dict observation: each entry)."""
    import numpy as np

    if isinstance(obs, dict):
        return {key: batch_of_one(value) for key, value in obs.items()}
    return np.asarray(obs)[None]


def run_multi_agent_episodes(policies: dict, mapping: dict[str, str], env_id: str, env_config: dict, episodes: int, seed: int) -> dict:
    """Every agent acts greedily with the policy its id maps to; the episode return sums all agents."""
    from rlplatform.adapter.algorithm_config import PolicyMapping
    from rlplatform.config.env_ids import make_env

    policy_of = PolicyMapping(mapping)
    env = make_env(env_id, **env_config)
    returns: list[float] = []
    lengths: list[int] = []
    per_policy: dict[str, list[float]] = {name: [] for name in policies}
    for episode in range(episodes):
        obs, _ = env.reset(seed=seed + episode)
        totals = dict.fromkeys(policies, 0.0)
        done, steps = False, 0
        while not done:
            actions = {}
            for agent, agent_obs in obs.items():
                action, _ = policies[policy_of(agent)].act(agent_obs[None])
                actions[agent] = action[0]
            obs, rewards, terminateds, truncateds, _ = env.step(actions)
            for agent, reward in rewards.items():
                totals[policy_of(agent)] += float(reward)
            steps += 1
            done = terminateds.get("__all__", False) or truncateds.get("__all__", False)
        returns.append(sum(totals.values()))
        lengths.append(steps)
        for name, total in totals.items():
            per_policy[name].append(total)
    env.close()
    return {"returns": returns, "lengths": lengths, "videos": [], "per_policy_returns": per_policy}

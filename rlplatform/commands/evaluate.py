"""`rlplatform evaluate RUN_DIR|CHECKPOINT`: greedy episodes with only the policy network loaded.

No Ray cluster, no env runners, no learners: the RLModule is read from the checkpoint and
stepped in one env in this process. `--video DIR` records MP4s with gymnasium's RecordVideo.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path
from typing import Optional

from rlplatform.run import progress
from rlplatform.run.checkpoints import (
    CheckpointInfo, best_first, checked, first_usable, list_checkpoints, newest_first, read_checkpoint,
)
from rlplatform.config.schema import ExperimentConfig, validate
from rlplatform.errors import UserError
from rlplatform.run.run_dir import CONFIG_FILE, check_writable


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("evaluate", help="run greedy episodes of a trained policy, optionally with video")
    p.add_argument("target", type=Path, metavar="RUN_DIR|CHECKPOINT")
    p.add_argument("--episodes", type=int, default=10)
    p.add_argument("--video", type=Path, metavar="DIR", help="write an MP4 of every episode into DIR")
    p.add_argument("--seed", type=int, default=0, help="episode i is reset with seed S+i")
    p.add_argument("--checkpoint", choices=("best", "latest"), default="best", help="which checkpoint of a run directory")
    p.add_argument("--json", type=Path, metavar="FILE", help="also write the results as JSON")
    p.add_argument("--policy", help="policy (module) id; default: the only or default policy")
    p.set_defaults(func=run)


def find_checkpoint(target: Path, which: str = "best", policy: Optional[str] = None) -> CheckpointInfo:
    """A named checkpoint, whole and loadable; or a run directory's best (or latest) checkpoint that
    verifies and loads, newer or better ones that do not skipped and named."""
    if not target.exists():
        raise UserError(f"no such run directory or checkpoint: {target}")

    def loads(info: CheckpointInfo) -> None:
        from rlplatform.adapter.policy import check_loads

        check_loads(info.path, policy)

    if (target / "rllib_checkpoint.json").exists() or target.name.startswith("checkpoint_"):
        return checked(read_checkpoint(target), loads)
    if not (target / CONFIG_FILE).is_file():
        raise UserError(f"not a run directory or checkpoint: {target}")
    checkpoints = list_checkpoints(target / "checkpoints")
    order = best_first(checkpoints) if which == "best" else newest_first(checkpoints)
    return first_usable(order, loads, target / "checkpoints")


def run(args: argparse.Namespace) -> int:
    if args.episodes < 1:
        raise UserError(f"--episodes must be at least 1, not {args.episodes}")
    if args.video:
        check_writable(args.video)
    info = find_checkpoint(args.target, args.checkpoint, args.policy)
    config = validate(info.meta["config"], source=str(info.path)) if "config" in info.meta else None
    if config is None:
        raise UserError(f"checkpoint {info.path} carries no experiment config")
    results = evaluate(info.path, config, args.episodes, args.seed, args.video, args.policy)
    returns, lengths = results["returns"], results["lengths"]
    progress.say(f"checkpoint: {info.path} (iteration {info.iteration}, {info.env_steps:,} env steps)")
    progress.say(
        f"{len(returns)} episodes: return {statistics.mean(returns):.2f} ± {statistics.pstdev(returns):.2f}, "
        f"length {statistics.mean(lengths):.1f} ± {statistics.pstdev(lengths):.1f}"
    )
    for name, values in results.get("per_policy_returns", {}).items():
        progress.say(f"  policy {name}: return {statistics.mean(values):.2f} ± {statistics.pstdev(values):.2f}")
    for video in results["videos"]:
        progress.say(f"video: {video}")
    if args.json:
        args.json.write_text(json.dumps({"checkpoint": str(info.path), **results}, indent=1))
    return 0


def evaluate(checkpoint: Path, config: ExperimentConfig, episodes: int, seed: int, video_dir: Optional[Path], policy: Optional[str] = None) -> dict:
    import gymnasium as gym

    from rlplatform.adapter import policy as rllib_policy
    from rlplatform.config.env_ids import make_env

    if config.multi_agent is not None:
        if video_dir:
            raise UserError("--video is not supported for multi-agent envs yet")
        return evaluate_multi_agent(checkpoint, config, episodes, seed)
    module = rllib_policy.load_inference_module(checkpoint, policy)
    if video_dir:  # frames are drawn off-screen: no display, no sound card (SDL would look for both, noisily)
        os.environ.setdefault("SDL_VIDEODRIVER", "dummy")
        os.environ.setdefault("SDL_AUDIODRIVER", "dummy")
    env = make_env(config.env, render_mode="rgb_array" if video_dir else None, **config.env_config)
    if video_dir:
        video_dir.mkdir(parents=True, exist_ok=True)
        env = gym.wrappers.RecordVideo(env, str(video_dir), episode_trigger=lambda _: True,
                                       name_prefix=f"{config.name}-seed{seed}", disable_logger=True)
    returns, lengths = [], []
    try:
        for episode in range(episodes):
            obs, _ = env.reset(seed=seed + episode)
            state = rllib_policy.initial_state(module)
            done, total, steps = False, 0.0, 0
            while not done:
                actions, state = rllib_policy.greedy_actions(module, obs[None], state)
                action = rllib_policy.to_env_action(actions[0], env.action_space, config)
                obs, reward, terminated, truncated, _ = env.step(action)
                total, steps, done = total + float(reward), steps + 1, terminated or truncated
            returns.append(total)
            lengths.append(steps)
    finally:
        env.close()
    videos = sorted(str(p) for p in video_dir.glob("*.mp4")) if video_dir else []
    return {"returns": returns, "lengths": lengths, "videos": videos}


def evaluate_multi_agent(checkpoint: Path, config: ExperimentConfig, episodes: int, seed: int) -> dict:
    """Every agent acts greedily with the policy its id maps to; the episode return sums all agents."""
    from rlplatform.adapter import policy as rllib_policy
    from rlplatform.config.env_ids import make_env

    from rlplatform.adapter.algorithm_config import PolicyMapping

    mapping = PolicyMapping(config.multi_agent.mapping)
    modules = {name: rllib_policy.load_inference_module(checkpoint, name) for name in config.multi_agent.policies}
    env = make_env(config.env, **config.env_config)
    returns, lengths, per_policy = [], [], {name: [] for name in modules}
    for episode in range(episodes):
        obs, _ = env.reset(seed=seed + episode)
        totals = dict.fromkeys(modules, 0.0)
        done, steps = False, 0
        while not done:
            actions = {}
            for agent, agent_obs in obs.items():
                policy = mapping(agent)
                action, _ = rllib_policy.greedy_actions(modules[policy], agent_obs[None])
                actions[agent] = rllib_policy.to_env_action(action[0], env.unwrapped.get_action_space(agent), config)
            obs, rewards, terminateds, truncateds, _ = env.step(actions)
            for agent, reward in rewards.items():
                totals[mapping(agent)] += float(reward)
            steps += 1
            done = terminateds.get("__all__", False) or truncateds.get("__all__", False)
        returns.append(sum(totals.values()))
        lengths.append(steps)
        for name, total in totals.items():
            per_policy[name].append(total)
    env.close()
    return {"returns": returns, "lengths": lengths, "videos": [], "per_policy_returns": per_policy}

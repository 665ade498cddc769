"""`rlplatform bench learner EXPERIMENT`: SGD updates per second of a DQN or SAC learner alone.

Three ways of doing the experiment's update, one after the other in this process, on batches of the
experiment's shapes drawn from a buffer filled with the env's transitions (random actions), after
a warm-up; each figure includes drawing its batch:

- `lean`: the learner a run uses (`speedups: true`): the flat buffer, k updates per learner call.
- `rllib`: RLlib's learner as RLlib's training step drives it (`speedups: false`): one-step episodes
  sampled from its `EpisodeReplayBuffer`, one `update(episodes=...)` per update.
- `torch`: the same update written in plain torch, CleanRL-style: the same networks (copies of the
  experiment's RLModule's), losses and Adam, no RLlib learner, connector or metrics.

The ratio lean / torch is how close the learner is to the limit of its arithmetic on this machine.
Results: `<output>/learner-<name>-<time>/learner.json`.
"""

from __future__ import annotations

import argparse
import copy
import time
from typing import Any, Callable

from rlplatform import console
from rlplatform.bench.training_runs import bench_dir, check_experiment, write_json
from rlplatform.errors import UserError

ALGORITHMS = ("DQN", "SAC")


def add_verb(verbs: Any) -> None:  # argparse's sub-parsers action
    from pathlib import Path

    q = verbs.add_parser("learner", help="DQN/SAC learner updates per second: lean, RLlib's and plain torch")
    q.add_argument("experiment", nargs="?", type=Path, default=Path("experiments/pendulum_sac.yaml"),
                   help="a DQN or SAC experiment (default: experiments/pendulum_sac.yaml)")
    q.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help="as for train")
    q.add_argument("--profile", default="laptop", help="as for train (default: laptop)")
    q.add_argument("--seconds", type=float, default=15.0, help="measured time per way, after warm-up (default: 15)")
    q.add_argument("--warmup", type=int, default=20, help="updates before measuring (default: 20)")
    q.add_argument("--rounds", type=int, default=5,
                   help="the ways take turns, this many times each, so that a shared host's slow moments fall "
                        "on all of them (default: 5)")
    q.add_argument("--threads", type=int, default=None,
                   help="torch threads (default: the experiment's hardware.driver_cpus, as a run's learner uses)")
    q.add_argument("--ways", nargs="+", default=["lean", "rllib", "torch"], choices=["lean", "rllib", "torch"])
    q.add_argument("-o", "--output", type=Path, default=Path("bench"), help="directory for the results (default: bench)")
    q.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    if args.seconds <= 0 or args.warmup < 0 or args.rounds < 1:
        raise UserError("--seconds must be > 0, --warmup >= 0 and --rounds >= 1")
    config = check_experiment(args)
    if config.algorithm not in ALGORITHMS or config.multi_agent is not None:
        raise UserError(f"bench learner measures single-agent {' and '.join(ALGORITHMS)} learners; "
                        f"{config.name} is {config.algorithm}{' (multi-agent)' if config.multi_agent else ''}")
    if config.hardware.gpus_per_learner:
        device = "cuda"
        if not torch.cuda.is_available():
            raise UserError("hardware.gpus_per_learner > 0 but torch sees no GPU here")
    else:
        device = "cpu"
    threads = args.threads or max(1, int(config.hardware.driver_cpus))
    torch.set_num_threads(threads)
    bench = LearnerBench(config, device)
    rows = bench.measure(args.ways, args.warmup, args.seconds, args.rounds)
    for r in rows:
        console.say(f"{r['way']}: {r['updates_per_s']:.1f} updates/s ({r['ms_per_update']:.2f} ms each)")
    limit = next((r["updates_per_s"] for r in rows if r["way"] == "torch"), None)
    for r in rows:
        r["of_plain_torch"] = r["updates_per_s"] / limit if limit else None
    result = {"experiment": config.name, "algorithm": config.algorithm, "env": config.env, "device": device,
              "torch_threads": threads, "batch_size": bench.batch_size, "updates_per_learner_call": bench.k,
              "hidden": list(config.model.hidden), "overrides": args.overrides, "results": rows}
    path = write_json(bench_dir(args.output, "learner", config.name) / "learner.json", result)
    _print_table(result)
    console.say(f"written: {path}")
    return 0


class LearnerBench:
    """The experiment's learners and a filled buffer; `measure(way)` times one way of updating."""

    def __init__(self, config: Any, device: str) -> None:
        import gymnasium as gym
        from ray.rllib.algorithms.dqn.dqn import calculate_rr_weights

        from rlplatform.adapter.algorithm_config import build_algorithm_config
        from rlplatform.config.env_ids import runner_env_id

        self.config = config
        self.device = device
        self.lean_config = build_algorithm_config(config.model_copy(update={"speedups": True}))
        self.rllib_config = build_algorithm_config(config.model_copy(update={"speedups": False}))
        self.batch_size = self.lean_config.train_batch_size_per_learner
        self.k = max(1, calculate_rr_weights(self.lean_config)[1])
        self.env = gym.make(runner_env_id(config.env), **dict(config.env_config))
        self.episodes = _random_episodes(self.env, steps=max(5_000, 4 * self.batch_size))

    def measure(self, ways: list[str], warmup: int, seconds: float, rounds: int) -> list[dict[str, Any]]:
        """Each way warmed up, then the ways in turn, `rounds` times, `seconds / rounds` each."""
        steps = {way: getattr(self, f"_{way}_step")() for way in ways}
        for way, (step, per_call) in steps.items():
            console.say(f"{way}: warming up ...")
            for _ in range(max(1, warmup // per_call)):
                step()
        updates, elapsed = dict.fromkeys(ways, 0), dict.fromkeys(ways, 0.0)
        for _ in range(rounds):
            for way, (step, per_call) in steps.items():
                started = time.perf_counter()
                while time.perf_counter() - started < seconds / rounds:
                    step()
                    updates[way] += per_call
                self._sync()
                elapsed[way] += time.perf_counter() - started
        return [{"way": way, "updates": updates[way], "seconds": round(elapsed[way], 3),
                 "updates_per_s": updates[way] / elapsed[way], "ms_per_update": 1000 * elapsed[way] / updates[way]}
                for way in ways]

    def _sync(self) -> None:
        if self.device == "cuda":
            import torch

            torch.cuda.synchronize()

    def _flat_buffer(self):
        from rlplatform.adapter import speedups

        buffer = speedups.flat_replay_buffer(100_000, gamma=self.lean_config.gamma, n_step=self.lean_config.n_step, seed=0)
        buffer.add(self.episodes)
        return buffer

    def _learner(self, algo_config):
        import torch

        torch.manual_seed(0)
        learner = algo_config.copy(copy_frozen=False).learners(
            num_gpus_per_learner=1 if self.device == "cuda" else 0).build_learner(env=self.env)
        return learner

    def _lean_step(self) -> tuple[Callable[[], None], int]:
        from rlplatform.adapter import speedups

        learner, buffer = self._learner(self.lean_config), self._flat_buffer()
        timesteps = {"num_env_steps_sampled_lifetime": 10**6}

        def step() -> None:
            rows = buffer.sample(self.k * self.batch_size)
            batch = speedups.flat_rows_to_batch(rows, self.k * self.batch_size)
            learner.update(batch=batch, minibatch_size=self.batch_size, timesteps=timesteps)

        return step, self.k

    def _rllib_step(self) -> tuple[Callable[[], None], int]:
        from ray.rllib.utils.replay_buffers.episode_replay_buffer import EpisodeReplayBuffer

        learner, buffer = self._learner(self.rllib_config), EpisodeReplayBuffer(capacity=100_000)
        buffer.add(copy.deepcopy(self.episodes))
        config, timesteps = self.rllib_config, {"num_env_steps_sampled_lifetime": 10**6}

        def step() -> None:
            episodes = buffer.sample(num_items=self.batch_size, n_step=config.n_step, gamma=config.gamma,
                                     beta=config.replay_buffer_config.get("beta"), sample_episodes=True)
            learner.update(episodes=episodes, timesteps=timesteps)

        return step, 1

    def _torch_step(self) -> tuple[Callable[[], None], int]:
        import torch

        from rlplatform.bench.plain_torch import PlainDQN, PlainSAC

        learner = self._learner(self.rllib_config)
        module = copy.deepcopy(learner.module["default_policy"].unwrapped())
        plain = (PlainSAC if self.config.algorithm == "SAC" else PlainDQN)(module, self.rllib_config)
        buffer = self._flat_buffer()

        def step() -> None:
            for _ in range(self.k):
                rows = buffer.sample(self.batch_size)
                plain.update({k: torch.as_tensor(v, device=self.device) for k, v in rows.items()})
            plain.update_target()

        return step, self.k


def _random_episodes(env, steps: int) -> list:
    from ray.rllib.env.single_agent_episode import SingleAgentEpisode

    episodes: list[Any] = []
    done = True
    for _ in range(steps):
        if done:
            obs, _ = env.reset(seed=len(episodes))
            episodes.append(SingleAgentEpisode(observations=[obs], observation_space=env.observation_space,
                                               action_space=env.action_space))
        action = env.action_space.sample()
        obs, reward, terminated, truncated, _ = env.step(action)
        episodes[-1].add_env_step(obs, action, reward, terminated=terminated, truncated=truncated)
        done = terminated or truncated
    for episode in episodes:
        episode.to_numpy()
    return episodes


def _print_table(result: dict[str, Any]) -> None:
    from rich.table import Table

    table = Table(title=f"{result['algorithm']} learner, {result['experiment']}: batch {result['batch_size']}, "
                        f"{result['device']}, {result['torch_threads']} torch thread(s)")
    for column in ("way", "updates/s", "ms/update", "of plain torch"):
        table.add_column(column, justify="right")
    for r in result["results"]:
        table.add_row(r["way"], f"{r['updates_per_s']:.1f}", f"{r['ms_per_update']:.2f}",
                      console.fmt(r["of_plain_torch"] and 100 * r["of_plain_torch"], ".0f") + " %")
    console.stdout.print(table)

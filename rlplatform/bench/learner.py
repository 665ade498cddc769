"""`rlplatform bench learner EXPERIMENT`: updates per second of a DQN, SAC or PPO learner alone.

Ways of doing the experiment's update, taking turns, after a warm-up. DQN and SAC update on batches of
the experiment's shapes drawn from a buffer filled with the env's transitions (random actions), each
figure including the draw of its batch; PPO updates on one batch of the experiment's size sampled by
its initial policy (an update: the experiment's epochs of minibatches over it):

- `lean`: the learner a run uses (`speedups: true`): for DQN and SAC the flat buffer, k updates per
  learner call.
- `rllib`: RLlib's learner as RLlib's training step drives it (`speedups: false`); for DQN and SAC
  one-step episodes sampled from its `EpisodeReplayBuffer`, one `update(episodes=...)` per update.
- `torch` (DQN, SAC): the same update written in plain torch, CleanRL-style: the same networks (copies
  of the experiment's RLModule's), losses and Adam, no RLlib learner, connector or metrics.
- `sb3`: Stable-Baselines3's own `train()` with the experiment's batch, widths, activation, learning
  rate and epochs, in its own process (`sb3_updates.py`) run by `--sb3-python` (default: this Python,
  which has it with the `bench` extra): the library a user would otherwise pick.

Results: `<output>/learner-<name>-<time>/learner.json`.
"""

from __future__ import annotations

import argparse
import copy
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

from rlplatform import console
from rlplatform.bench.training_runs import bench_dir, check_experiment, write_json
from rlplatform.errors import UserError

ALGORITHMS = ("DQN", "SAC", "PPO")
WAYS = ("lean", "rllib", "torch", "sb3")
PPO_WARMUP = 2  # PPO's warm-up in whole batch updates, each many gradient steps
SB3_SCRIPT = Path(__file__).with_name("sb3_updates.py")
# A way's run: measure for this many seconds -> (updates, seconds measured).
Run = Callable[[float], tuple[int, float]]


def add_verb(verbs: Any) -> None:  # argparse's sub-parsers action
    q = verbs.add_parser("learner", help="DQN/SAC/PPO learner updates per second: lean, RLlib's, plain torch, SB3's")
    q.add_argument("experiment", nargs="?", type=Path, default=Path("experiments/pendulum_sac.yaml"),
                   help="a DQN, SAC or PPO experiment (default: experiments/pendulum_sac.yaml)")
    q.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help="as for train")
    q.add_argument("--profile", default="laptop", help="as for train (default: laptop)")
    q.add_argument("--seconds", type=float, default=15.0, help="measured time per way, after warm-up (default: 15)")
    q.add_argument("--warmup", type=int, default=20, help="updates before measuring (default: 20)")
    q.add_argument("--rounds", type=int, default=5,
                   help="the ways take turns, this many times each, so that a shared host's slow moments fall "
                        "on all of them (default: 5)")
    q.add_argument("--threads", type=int, default=None,
                   help="torch threads (default: the experiment's hardware.driver_cpus, as a run's learner uses)")
    q.add_argument("--ways", nargs="+", default=None, choices=WAYS,
                   help="default: lean rllib torch (DQN, SAC); lean rllib (PPO)")
    q.add_argument("--sb3-python", type=Path, default=None,
                   help="the Python that runs the sb3 way, with stable-baselines3 installed (default: this one)")
    q.add_argument("-o", "--output", type=Path, default=Path("bench"), help="directory for the results (default: bench)")
    q.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    if args.seconds <= 0 or args.warmup < 0 or args.rounds < 1:
        raise UserError("--seconds must be > 0, --warmup >= 0 and --rounds >= 1")
    config = check_experiment(args)
    if config.algorithm not in ALGORITHMS or config.multi_agent is not None:
        raise UserError(f"bench learner measures single-agent {', '.join(ALGORITHMS)} learners; "
                        f"{config.name} is {config.algorithm}{' (multi-agent)' if config.multi_agent else ''}")
    ways = list(dict.fromkeys(args.ways or (["lean", "rllib"] if config.algorithm == "PPO" else ["lean", "rllib", "torch"])))
    if config.algorithm == "PPO" and "torch" in ways:
        raise UserError("--ways torch: the plain torch update covers DQN and SAC, not PPO")
    sb3_python = args.sb3_python or Path(sys.executable)
    if "sb3" in ways:
        check_sb3(sb3_python)
    if config.hardware.gpus_per_learner:
        device = "cuda"
        if not torch.cuda.is_available():
            raise UserError("hardware.gpus_per_learner > 0 but torch sees no GPU here")
        if "sb3" in ways:
            raise UserError("--ways sb3 runs SB3 on the CPU; leave hardware.gpus_per_learner at 0 to compare")
    else:
        device = "cpu"
    threads = args.threads or max(1, int(config.hardware.driver_cpus))
    torch.set_num_threads(threads)
    bench = LearnerBench(config, device, threads, sb3_python)
    try:
        rows = bench.measure(ways, args.warmup, args.seconds, args.rounds)
    finally:
        bench.close()
    for r in rows:
        console.say(f"{r['way']}: {r['updates_per_s']:.1f} updates/s ({r['ms_per_update']:.2f} ms each)")
    for name in ("torch", "sb3"):
        limit = next((r["updates_per_s"] for r in rows if r["way"] == name), None)
        for r in rows:
            r[f"of_{'plain_torch' if name == 'torch' else name}"] = r["updates_per_s"] / limit if limit else None
    result = {"experiment": config.name, "algorithm": config.algorithm, "env": config.env, "device": device,
              "torch_threads": threads, "batch_size": bench.batch_size, "updates_per_learner_call": bench.k,
              "update": bench.unit, "hidden": list(config.model.hidden), "overrides": args.overrides,
              "sb3": bench.sb3_facts, "results": rows}
    path = write_json(bench_dir(args.output, "learner", config.name) / "learner.json", result)
    _print_table(result)
    console.say(f"written: {path}")
    return 0


def check_sb3(python: Path) -> None:
    """One error line where the given Python cannot import stable_baselines3."""
    try:
        done = subprocess.run([str(python), "-c", "import stable_baselines3"], capture_output=True, timeout=120)
    except OSError as exc:
        raise UserError(f"--sb3-python {python}: cannot run it ({exc.strerror})") from None
    if done.returncode != 0:
        raise UserError(f"--ways sb3: stable-baselines3 is not importable by {python} "
                        "(pip install -e \".[bench]\", or point --sb3-python at a Python that has it)")


class LearnerBench:
    """The experiment's learners and their data; `measure(ways)` times the ways of updating in turns."""

    def __init__(self, config: Any, device: str, threads: int = 1, sb3_python: Optional[Path] = None) -> None:
        import gymnasium as gym

        from rlplatform.adapter.algorithm_config import build_algorithm_config, without_own_training_keys
        from rlplatform.config.env_ids import runner_env_id

        self.config = config
        self.device = device
        self.threads = threads
        self.sb3_python = sb3_python or Path(sys.executable)
        self.sb3_facts: Optional[dict[str, Any]] = None
        self._closers: list[Callable[[], None]] = []
        self.lean_config = build_algorithm_config(config.model_copy(update={"speedups": True}))
        # RLlib's own learner, with RLlib's own loss where the experiment chose one of ours (the same cost)
        self.rllib_config = build_algorithm_config(without_own_training_keys(config).model_copy(update={"speedups": False}))
        self.batch_size = self.lean_config.train_batch_size_per_learner
        self.env = gym.make(runner_env_id(config.env), **dict(config.env_config))
        if config.algorithm == "PPO":
            self.k, self.unit = 1, (f"{self.lean_config.num_epochs} epoch(s) over a batch of {self.batch_size} "
                                    f"in minibatches of {self.lean_config.minibatch_size}")
            self.episodes = _policy_episodes(self.rllib_config, self.batch_size)
        else:
            from ray.rllib.algorithms.dqn.dqn import calculate_rr_weights

            self.k, self.unit = max(1, calculate_rr_weights(self.lean_config)[1]), "one gradient step on a batch"
            self.episodes = _random_episodes(self.env, steps=self.buffer_steps)

    @property
    def buffer_steps(self) -> int:
        return max(5_000, 4 * self.batch_size)

    def measure(self, ways: list[str], warmup: int, seconds: float, rounds: int) -> list[dict[str, Any]]:
        """Each way warmed up, then the ways in turn, `rounds` times, `seconds / rounds` each."""
        runs: dict[str, Run] = {}
        for way in ways:
            console.say(f"{way}: warming up ...")
            runs[way] = getattr(self, f"_{way}_run")(warmup)
        updates, elapsed = dict.fromkeys(ways, 0), dict.fromkeys(ways, 0.0)
        for _ in range(rounds):
            for way, measure_for in runs.items():
                n, s = measure_for(seconds / rounds)
                updates[way] += n
                elapsed[way] += s
        return [{"way": way, "updates": updates[way], "seconds": round(elapsed[way], 3),
                 "updates_per_s": updates[way] / elapsed[way], "ms_per_update": 1000 * elapsed[way] / updates[way]}
                for way in ways]

    def close(self) -> None:
        for close in self._closers:
            close()

    def _local(self, step: Callable[[], Optional[float]], per_call: int, warmup: int) -> Run:
        """A way run in this process: `step()` does `per_call` updates and returns the seconds to count (None: all)."""
        for _ in range(max(1, warmup // per_call)):
            step()

        def measure_for(seconds: float) -> tuple[int, float]:
            updates, counted, started = 0, 0.0, time.perf_counter()
            while time.perf_counter() - started < seconds:
                t0 = time.perf_counter()
                timed = step()
                counted += timed if timed is not None else time.perf_counter() - t0
                updates += per_call
            self._sync()
            return updates, counted

        return measure_for

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

    def _ppo_run(self, algo_config, warmup: int) -> Run:
        """PPO learner updates, each over a fresh copy of the batch's episodes (the copy not counted: the learner
        connector adds a step to each episode); the warm-up in whole updates, at most `PPO_WARMUP`."""
        learner = self._learner(algo_config)
        kwargs = dict(num_epochs=algo_config.num_epochs, minibatch_size=algo_config.minibatch_size,
                      shuffle_batch_per_epoch=algo_config.shuffle_batch_per_epoch,
                      timesteps={"num_env_steps_sampled_lifetime": 10**6})

        def step() -> float:
            episodes = copy.deepcopy(self.episodes)
            started = time.perf_counter()
            learner.update(episodes=episodes, **kwargs)
            return time.perf_counter() - started

        return self._local(step, 1, min(warmup, PPO_WARMUP))

    def _lean_run(self, warmup: int) -> Run:
        from rlplatform.adapter import speedups

        if self.config.algorithm == "PPO":
            return self._ppo_run(self.lean_config, warmup)
        learner, buffer = self._learner(self.lean_config), self._flat_buffer()
        timesteps = {"num_env_steps_sampled_lifetime": 10**6}

        def step() -> None:
            rows = buffer.sample(self.k * self.batch_size)
            batch = speedups.flat_rows_to_batch(rows, self.k * self.batch_size)
            learner.update(batch=batch, minibatch_size=self.batch_size, timesteps=timesteps)

        return self._local(step, self.k, warmup)

    def _rllib_run(self, warmup: int) -> Run:
        from ray.rllib.utils.replay_buffers.episode_replay_buffer import EpisodeReplayBuffer

        if self.config.algorithm == "PPO":
            return self._ppo_run(self.rllib_config, warmup)
        learner, buffer = self._learner(self.rllib_config), EpisodeReplayBuffer(capacity=100_000)
        buffer.add(copy.deepcopy(self.episodes))
        config, timesteps = self.rllib_config, {"num_env_steps_sampled_lifetime": 10**6}

        def step() -> None:
            episodes = buffer.sample(num_items=self.batch_size, n_step=config.n_step, gamma=config.gamma,
                                     beta=config.replay_buffer_config.get("beta"), sample_episodes=True)
            learner.update(episodes=episodes, timesteps=timesteps)

        return self._local(step, 1, warmup)

    def _torch_run(self, warmup: int) -> Run:
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

        return self._local(step, self.k, warmup)

    def _sb3_run(self, warmup: int) -> Run:
        """SB3's `train()` in a process of `--sb3-python`, told how long to run each turn over a pipe."""
        proc = subprocess.Popen([str(self.sb3_python), str(SB3_SCRIPT), json.dumps(self.sb3_spec(warmup))],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._closers.append(lambda: _stop(proc))
        self.sb3_facts = _reply(proc)["ready"]

        def measure_for(seconds: float) -> tuple[int, float]:
            assert proc.stdin is not None
            proc.stdin.write(f"{seconds}\n")
            proc.stdin.flush()
            reply = _reply(proc)
            return int(reply["calls" if self.config.algorithm == "PPO" else "updates"]), float(reply["seconds"])

        return measure_for

    def sb3_spec(self, warmup: int) -> dict[str, Any]:
        """The experiment's update in SB3's terms (sb3_updates.py)."""
        c, algo = self.lean_config, self.config.algorithm
        spec: dict[str, Any] = {"algorithm": algo, "env": self.env.spec.id if self.env.spec else self.config.env,
                                "env_config": dict(self.config.env_config), "batch_size": self.batch_size,
                                "hidden": list(self.config.model.hidden), "activation": self.config.model.activation,
                                "gamma": c.gamma, "threads": self.threads, "warmup": warmup}
        if algo == "PPO":
            spec.update(lr=c.lr, envs=max(1, self.config.scale.envs_per_runner) * max(1, self.config.scale.env_runners),
                        minibatch_size=c.minibatch_size, epochs=c.num_epochs, clip=c.clip_param,
                        entropy_coeff=c.entropy_coeff, vf_coeff=c.vf_loss_coeff, grad_clip=c.grad_clip or float("inf"),
                        warmup=min(warmup, PPO_WARMUP))
            spec["lambda"] = c.lambda_
        elif algo == "SAC":
            spec.update(lr=c.actor_lr, tau=c.tau, buffer_steps=self.buffer_steps, updates_per_call=self.k)
        else:
            spec.update(lr=c.lr, buffer_steps=self.buffer_steps, updates_per_call=self.k)
        return spec


def _reply(proc: subprocess.Popen) -> dict[str, Any]:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        code = proc.wait()
        raise UserError(f"--ways sb3: SB3's process ended (exit code {code}) before it answered; its output is above")
    return json.loads(line)


def _stop(proc: subprocess.Popen) -> None:
    if proc.stdin is not None:
        proc.stdin.close()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()


def _policy_episodes(algo_config: Any, steps: int) -> list:
    """`steps` env steps of episodes sampled by the experiment's initial policy with RLlib's env runner, as PPO's
    training step gets them (module outputs included)."""
    import torch
    from ray.rllib.env.single_agent_env_runner import SingleAgentEnvRunner

    torch.manual_seed(0)
    runner = SingleAgentEnvRunner(config=algo_config.copy(copy_frozen=False).env_runners(num_env_runners=0))
    try:
        return runner.sample(num_timesteps=steps, explore=True)
    finally:
        runner.stop()


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

    rows = result["results"]
    table = Table(title=f"{result['algorithm']} learner, {result['experiment']}: batch {result['batch_size']}, "
                        f"{result['device']}, {result['torch_threads']} torch thread(s); an update: {result['update']}")
    ratios = [(key, label) for key, label in (("of_plain_torch", "of plain torch"), ("of_sb3", "of SB3"))
              if any(r[key] for r in rows)]
    for column in ("way", "updates/s", "ms/update", *(label for _, label in ratios)):
        table.add_column(column, justify="right")
    for r in rows:
        table.add_row(r["way"], f"{r['updates_per_s']:.1f}", f"{r['ms_per_update']:.2f}",
                      *(console.fmt(r[key] and 100 * r[key], ".0f") + " %" for key, _ in ratios))
    console.stdout.print(table)

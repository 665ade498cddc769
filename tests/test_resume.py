"""Runs that survive their own crashes: resume skips damaged checkpoints and rewinds the record, one writer
per run directory, a full disk ends the run cleanly. Real `train` processes on private Ray instances."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from conftest import ROOT, assert_user_error, only_run_dir, read_metrics, run_cli

from rlplatform.run.checkpoints import list_checkpoints, verify

pytestmark = pytest.mark.slow
UNTIL_CLOCK = ["--set", "stop.return_mean=null", "--set", "stop.env_steps=null"]


def iterations(run_dir: Path) -> list[int]:
    return [row["iteration"] for row in read_metrics(run_dir)]


def tensorboard_iterations(run_dir: Path) -> list[tuple[int, float]]:
    """(env steps, iteration) of `progress/iteration` as TensorBoard shows them, purged events hidden."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = EventAccumulator(str(run_dir))
    board.Reload()
    return [(event.step, event.value) for event in board.Scalars("progress/iteration")]


def test_resume_skips_a_damaged_checkpoint_and_rewinds_the_record(runs):
    first = run_cli("train", "--runs-dir", runs, *UNTIL_CLOCK, "--set", "stop.iterations=5",
                    "--set", "checkpoint.every=2", "--set", "checkpoint.keep_last=5")
    assert first.returncode == 0, first.stderr
    run_dir = only_run_dir(runs, "cartpole-ppo")
    weights = next((run_dir / "checkpoints" / "checkpoint_000005").rglob("default_policy/module_state.pkl"))
    size = weights.stat().st_size
    weights.write_bytes(weights.read_bytes()[:100])  # the last checkpoint damaged after it was written

    second = run_cli("train", "--resume", run_dir, "--set", "stop.iterations=7")
    assert second.returncode == 0, second.stdout + second.stderr
    skipped = [line for line in second.stderr.splitlines() if line.startswith("skipped")]
    assert skipped == [f"skipped 1 checkpoint(s) that are not whole: checkpoint_000005: "
                       f"learner_group/learner/rl_module/default_policy/module_state.pkl has 100 bytes, {size:,} were written"]
    assert "(iteration 4)" in second.stdout
    assert iterations(run_dir) == [1, 2, 3, 4, 5, 6, 7]
    rolled = [json.loads(line) for line in (run_dir / "metrics.rolled_back.jsonl").read_text().splitlines()]
    assert [json.loads(r["row"])["iteration"] for r in rolled] == [5]
    assert rolled[0]["rolled_back"]["resumed_from_iteration"] == 4
    assert (run_dir / "checkpoints" / "rolled_back" / "checkpoint_000005").is_dir()
    shown = tensorboard_iterations(run_dir)
    assert [value for _, value in shown] == [1, 2, 3, 4, 5, 6, 7]
    assert [step for step, _ in shown] == sorted({step for step, _ in shown})  # each env step once, rising
    assert [c.iteration for c in list_checkpoints(run_dir / "checkpoints")] == [2, 4, 6, 7]


def _children(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def test_one_writer_per_run_directory_and_a_killed_run_resumes_without_a_trace(runs):
    first = run_cli("train", "--runs-dir", runs, *UNTIL_CLOCK, "--set", "stop.iterations=2", "--set", "checkpoint.every=1")
    assert first.returncode == 0, first.stderr
    run_dir = only_run_dir(runs, "cartpole-ppo")
    log = runs / "writer.log"
    with log.open("w") as out:
        writer = subprocess.Popen(
            [sys.executable, "-m", "rlplatform", "train", "--resume", str(run_dir), "--set", "stop.iterations=10000",
             "--set", "checkpoint.every=3"],
            cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.time() + 180
        while time.time() < deadline and len(iterations(run_dir)) < 9:
            assert writer.poll() is None, f"the resumed run ended early: {log.read_text()[-2000:]}"
            time.sleep(0.5)
        second = run_cli("train", "--resume", run_dir, "--set", "stop.iterations=3")
        assert_user_error(second, f"in use by process {writer.pid}", str(run_dir))
    finally:
        ended = writer.poll()
        for process in [*_children(writer.pid), *([psutil.Process(writer.pid)] if ended is None else [])]:
            process.send_signal(signal.SIGKILL)  # the driver and the Ray it started, no cleanup anywhere
        writer.wait(timeout=30)
    assert ended is None, f"the resumed run ended on its own (exit {ended}) before it was killed: {log.read_text()[-2000:]}"
    before_kill = iterations(run_dir)
    newest = list_checkpoints(run_dir / "checkpoints")[-1].iteration
    assert len(before_kill) >= 9 and newest <= before_kill[-1]

    third = run_cli("train", "--resume", run_dir, "--set", f"stop.iterations={before_kill[-1] + 2}")
    assert third.returncode == 0, third.stdout + third.stderr  # the OS released the killed writer's lock
    assert f"(iteration {newest})" in third.stdout
    assert iterations(run_dir) == list(range(1, before_kill[-1] + 3))
    assert [value for _, value in tensorboard_iterations(run_dir)] == list(range(1, before_kill[-1] + 3))
    assert not list((run_dir / "checkpoints").glob(".partial-*"))
    assert all(verify(c) is None for c in list_checkpoints(run_dir / "checkpoints"))


@pytest.fixture
def small_disk(tmp_path):
    """A real 2 MiB file system (tmpfs): room for a few checkpoints, then ENOSPC."""
    mount_point = tmp_path / "small-disk"
    mount_point.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount_point)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {mounted.stderr.decode().strip()}")
    yield mount_point
    subprocess.run(["umount", "-l", str(mount_point)], check=False)


def test_a_full_disk_ends_the_run_with_one_line_and_every_earlier_checkpoint_whole(small_disk):
    runs = small_disk / "runs"
    result = run_cli("train", "--runs-dir", runs, *UNTIL_CLOCK, "--set", "stop.iterations=500",
                     "--set", "checkpoint.every=1", "--set", "checkpoint.keep_last=1000")
    assert result.returncode == 1, result.stdout + result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: training failed: checkpoint "), result.stderr
    assert "No space left on device" in lines[0] and "the checkpoints written before are intact" in lines[0]
    run_dir = only_run_dir(runs, "cartpole-ppo")
    written = list_checkpoints(run_dir / "checkpoints")
    assert written and [c.iteration for c in written] == list(range(1, len(written) + 1))
    assert all(verify(c) is None for c in written)
    assert str(written[-1].path) in lines[0]
    assert not list((run_dir / "checkpoints").glob(".partial-*"))
    assert os.statvfs(small_disk).f_bavail * os.statvfs(small_disk).f_frsize < 512 * 1024  # it really was full


def test_max_failures_rebuilds_the_algorithm_from_its_newest_checkpoint_when_its_actor_dies(runs):
    # One remote env runner (laptop profile); the algorithm in an actor of the run's placement group, as on a cluster.
    run = subprocess.Popen(
        [sys.executable, "-m", "rlplatform", "train", "--runs-dir", str(runs), "--profile", "laptop", *UNTIL_CLOCK,
         "--set", "stop.iterations=10", "--set", "checkpoint.every=2", "--set", "scale.algorithm_in=actor",
         "--max-failures", "2"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    killed = None
    deadline = time.time() + 240
    while killed is None and time.time() < deadline and run.poll() is None:
        run_dirs = list((runs / "cartpole-ppo").glob("*")) if (runs / "cartpole-ppo").is_dir() else []
        if run_dirs and len(iterations(run_dirs[0])) >= 5:
            hosts = [p for p in _children(run.pid) if "AlgorithmHost" in " ".join(p.cmdline())]
            if hosts:
                killed = hosts[0]
                killed.send_signal(signal.SIGKILL)  # as the OOM killer or a lost node would
        time.sleep(0.2)
    stdout, stderr = run.communicate(timeout=300)
    assert killed is not None, stdout + stderr
    assert run.returncode == 0, stdout + stderr
    assert "restart 1 of at most 2" in stdout
    run_dir = only_run_dir(runs, "cartpole-ppo")
    assert iterations(run_dir) == list(range(1, 11))  # each iteration once, the lost ones rolled back
    manifest = json.loads((run_dir / "manifest.json").read_text())
    (restart,) = manifest["restarts"]
    assert restart["from_iteration"] in (2, 4, 6) and restart["error"]
    assert read_metrics(run_dir)[-1]["faults/run_restarts"] == 1
    assert [value for _, value in tensorboard_iterations(run_dir)] == list(range(1, 11))


# The lean SAC run learns from its second training step on; plain RLlib's DQN updates are slow here and
# what is under test there is only the line about its buffer, so it does not start learning.
@pytest.mark.parametrize("experiment,speedups,restored,learning_starts,iteration_steps", [
    ("pendulum_sac", "true", True, 64, 100), ("cartpole_dqn", "false", False, 10**6, 64)])
def test_an_off_policy_run_on_remote_runners_resumes_with_its_replay_buffer_or_says_it_starts_empty(
        runs, experiment, speedups, restored, learning_starts, iteration_steps):
    sets = ["--set", f"speedups={speedups}", "--set", "scale.env_runners=2", "--set", "scale.envs_per_runner=1",
            "--set", "hardware.cpus_per_env_runner=0.5", "--set", "hardware.driver_cpus=1",
            "--set", "checkpoint.every=1", "--set", f"training.num_steps_sampled_before_learning_starts={learning_starts}",
            "--set", f"rllib.reporting.min_sample_timesteps_per_iteration={iteration_steps}"]
    first = run_cli("train", str(ROOT / "experiments" / f"{experiment}.yaml"), "--runs-dir", runs, *UNTIL_CLOCK,
                    *sets, "--set", "stop.iterations=2")
    assert first.returncode == 0, first.stderr
    run_dir = next(Path(runs).glob("*/*"))
    second = run_cli("train", "--resume", run_dir, "--set", "stop.iterations=3")
    assert second.returncode == 0, second.stdout + second.stderr
    buffer_lines = [line for line in second.stdout.splitlines() if line.startswith("replay buffer:")]
    assert len(buffer_lines) == 1, second.stdout
    if restored:
        stored = int(buffer_lines[0].split()[2].replace(",", ""))
        assert stored >= 2 * iteration_steps - 2 * 2  # two iterations' env steps, less the n-step tails waiting
    else:
        assert "starts empty" in buffer_lines[0]
    assert iterations(run_dir) == [1, 2, 3]

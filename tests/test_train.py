"""Real training through the CLI: every algorithm with remote env runners, the run directory,
resume, Ctrl-C, evaluate with video. The algorithm runs share one Ray head per module."""

import json
import shlex
import signal
import statistics
import subprocess
import sys
import time

import pytest
from conftest import ROOT, only_run_dir, read_metrics, run_cli

pytestmark = pytest.mark.slow  # every test trains, on the module's Ray head or a private local instance

# Only the iteration count stops these runs: an asynchronous algorithm with the lean sampler can pass
# the experiment's 100k env steps within its first iteration.
TINY = ["--set", "stop.iterations=2", "--set", "stop.env_steps=null", "--set", "stop.return_mean=null",
        "--set", "checkpoint.every=1", "--set", "scale.env_runners=1"]
ALGORITHMS = {
    "PPO": ["--set", "training.train_batch_size_per_learner=500"],
    "APPO": ["--set", "training={}"],
    "IMPALA": ["--set", "training={}"],
    "DQN": ["--set", "training={num_steps_sampled_before_learning_starts: 200}"],
    "SAC": ["--set", "env=Pendulum-v1", "--set", "training={num_steps_sampled_before_learning_starts: 200}"],
}


@pytest.mark.parametrize("algorithm", list(ALGORITHMS))
def test_two_iterations_with_remote_runners(algorithm, ray_head, runs):
    name = f"smoke-{algorithm.lower()}"
    result = run_cli("train", "--address", ray_head.address, "--runs-dir", runs, "--set", f"algorithm={algorithm}",
                     "--set", f"name={name}", *TINY, *ALGORITHMS[algorithm], timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    run_dir = only_run_dir(runs, name)

    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert {"command", "versions", "host", "resources", "seed"} <= set(manifest)
    assert manifest["versions"]["ray"] == "2.60.0"
    assert len(manifest["placement"]["env_runner_nodes"]) == 1
    assert manifest["placement"]["algorithm_in"] == "actor"  # on a cluster: in the run's placement group
    assert "algorithm: " + algorithm in (run_dir / "config.yaml").read_text()

    rows = read_metrics(run_dir)
    assert [r["iteration"] for r in rows] == [1, 2]
    assert rows[1]["env_steps"] > rows[0]["env_steps"] > 0
    for key in ("throughput/env_steps_sampled_per_s", "time/iteration_s", "faults/healthy_env_runners"):
        assert key in rows[1], sorted(rows[1])
    assert rows[1]["faults/healthy_env_runners"] == 1.0  # a remote runner really sampled
    assert any(k.startswith("learner/default_policy/") for k in rows[1])
    for row in rows:  # the system panel: every node's probe answers from the first iteration on
        assert any(k.startswith("system/") and k.endswith("/cpu_percent") for k in row), sorted(row)
        assert row["ray/object_store_used_gb"] >= 0
    assert list(run_dir.glob("events.out.tfevents.*"))
    checkpoints = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert checkpoints == ["checkpoint_000001", "checkpoint_000002"]


def test_resume_continues_counters_and_wall_time_in_the_same_run(ray_head, runs):
    """The first session is started as `bash -c 'sleep 6 && exec python -m rlplatform train ...'` starts it: a
    shell's process handed to train, whose time must count neither in the start-up figures nor towards
    `stop.wall_time_s` (tests/test_loop.py checks `command_start_time` itself, without training)."""
    shell_s = 6
    command = [sys.executable, "-m", "rlplatform", "train", "--address", ray_head.address, "--runs-dir", str(runs),
               "--set", "name=resume", *TINY, "--set", "training.train_batch_size_per_learner=500"]
    started = time.time()
    first = subprocess.run(["bash", "-c", f"sleep {shell_s} && exec {shlex.join(command)}"], cwd=ROOT,
                           capture_output=True, text=True, timeout=300)
    command_s = time.time() - started - shell_s  # at most the command's own time: the sleep may have lasted longer
    assert first.returncode == 0, first.stdout + first.stderr
    run_dir = only_run_dir(runs, "resume")
    assert 0 < read_metrics(run_dir)[-1]["wall_time_s"] <= command_s
    assert 0 < json.loads((run_dir / "manifest.json").read_text())["startup"]["ray_ready_s"] < command_s

    second = run_cli("train", "--address", ray_head.address, "--resume", run_dir, "--set", "stop.iterations=4", timeout=300)
    assert second.returncode == 0, second.stdout + second.stderr
    assert only_run_dir(runs, "resume") == run_dir
    rows = read_metrics(run_dir)
    assert [r["iteration"] for r in rows] == [1, 2, 3, 4]
    steps = [r["env_steps"] for r in rows]
    assert steps == sorted(steps) and steps[2] > steps[1]
    assert rows[2]["wall_time_s"] > rows[1]["wall_time_s"]  # the wall time goes on from the checkpoint's
    assert rows[2]["episodes/total"] > rows[1]["episodes/total"]  # the episode window came back too
    assert len(list(run_dir.glob("events.out.tfevents.*"))) == 2  # both sessions log into the same run
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert len(manifest["resumes"]) == 1
    kept = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert kept[-1] == "checkpoint_000004" and len(kept) <= 4


def test_ctrl_c_checkpoints_and_exits_0_then_evaluate_records_video(runs, tmp_path):
    """A private local Ray instance (no --address): SIGINT mid-run, then evaluate the checkpoint it left."""
    overrides = ["name=sigint", "stop.iterations=1000", "checkpoint.every=0", "training.train_batch_size_per_learner=500"]
    cmd = [sys.executable, "-m", "rlplatform", "train", "--runs-dir", str(runs), *(a for o in overrides for a in ("--set", o))]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 180
        metrics = None
        while time.time() < deadline and proc.poll() is None:
            found = list(runs.glob("sigint/*/metrics.jsonl"))
            if found and found[0].read_text().count("\n") >= 2:
                metrics = found[0]
                break
            time.sleep(0.5)
        assert metrics is not None, proc.communicate(timeout=30)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out + err
    assert "SIGINT" in out
    run_dir = metrics.parent
    # --profile auto sized the run for this machine: on 2 cores without a GPU it samples and learns in one
    # process, the driver holding the Algorithm; with more cores or a GPU, remote env runners and an actor.
    from rlplatform.config.experiment import resolve_experiment
    from rlplatform.infra.local_ray import local_resources
    from rlplatform.run.plan import make_plan

    resolved = resolve_experiment(ROOT / "experiments" / "cartpole_ppo.yaml", overrides)
    expected = make_plan(resolved, local_resources(), joined_cluster=False, resize=True)
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["bundles"] == expected.bundles
    placement, runners = manifest["placement"], expected.config.scale.env_runners
    assert placement["algorithm_in"] == ("driver" if expected.algorithm_in_driver else "actor")
    if runners == 0:
        assert placement["env_runner_nodes"] == [placement["algorithm_node"]]
        assert "sampling in the main process" in out
    else:
        assert len(placement["env_runner_nodes"]) == runners
        assert f"{runners} env runner(s)" in out
    checkpoints = list((run_dir / "checkpoints").glob("checkpoint_*"))
    assert len(checkpoints) == 1 and not list((run_dir / "checkpoints").glob(".partial-*"))

    videos = tmp_path / "videos"
    result = run_cli("evaluate", run_dir, "--episodes", "2", "--video", videos, "--json", tmp_path / "eval.json")
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads((tmp_path / "eval.json").read_text())
    returns, lengths = report["returns"], report["lengths"]
    assert len(returns) == len(lengths) == 2
    # CartPole pays 1 per step and truncates at 500: a return is the episode's length.
    assert returns == [float(n) for n in lengths] and all(1 <= n <= 500 for n in lengths), report
    assert (f"2 episodes: return {statistics.mean(returns):.2f} ± {statistics.pstdev(returns):.2f}, "
            f"length {statistics.mean(lengths):.1f} ± {statistics.pstdev(lengths):.1f}") in result.stdout
    mp4s = sorted(videos.glob("*.mp4"))
    assert report["videos"] == [str(p) for p in mp4s]
    assert len(mp4s) == 2 and all(p.stat().st_size > 1000 for p in mp4s)
    assert mp4s[0].read_bytes()[4:8] == b"ftyp"  # a real MP4 container
    # Greedy actions on seeded episodes: the same checkpoint gives the same episodes again, video or not.
    again = run_cli("evaluate", run_dir, "--episodes", "2", "--json", tmp_path / "again.json")
    assert again.returncode == 0, again.stdout + again.stderr
    assert json.loads((tmp_path / "again.json").read_text())["returns"] == returns


def test_an_env_that_fails_to_build_in_the_driver_fails_the_run_in_one_line(runs):
    # Sampling in the main process on any machine (as --profile auto chooses on 2 cores without a GPU).
    result = run_cli("train", "--runs-dir", runs, "--set", "env=rlplatform/CostlySim-v0", "--set", "env_config={work_ms: -1}",
                     "--profile", "laptop", "--set", "scale.env_runners=0", timeout=300)
    assert result.returncode == 1, result.stdout + result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert errors == ["error: training failed: the algorithm could not be built: work_ms and wait_ms must be >= 0"], result.stderr
    assert "Traceback" not in result.stdout + result.stderr


def test_own_env_and_lstm_model_in_remote_runners_then_evaluate(ray_head, runs):
    """An id of our `envs` package builds inside a remote env runner; a stateful (LSTM) policy evaluates."""
    result = run_cli("train", "--address", ray_head.address, "--runs-dir", runs, "--set", "name=own-env-lstm",
                     "--set", "env=rlplatform/CostlySim-v0", "--set", "env_config={work_ms: 0.05}",
                     "--set", "model={hidden: [32], use_lstm: true, lstm_cell_size: 32, max_seq_len: 10}",
                     "--set", "training.train_batch_size_per_learner=400", "--set", "scale.envs_per_runner=2", *TINY,
                     timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    run_dir = only_run_dir(runs, "own-env-lstm")
    assert read_metrics(run_dir)[-1]["faults/healthy_env_runners"] == 1.0
    evaluated = run_cli("evaluate", run_dir, "--episodes", "1", "--checkpoint", "latest")
    assert evaluated.returncode == 0, evaluated.stdout + evaluated.stderr
    assert "1 episodes: return" in evaluated.stdout

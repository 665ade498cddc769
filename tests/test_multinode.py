"""Real multi-node runs on this machine: a head node (127.0.0.2) and worker nodes (127.0.0.3, ...),
each with its own temp dir and process session, token auth on, stopped by process id.

- env runners spread over two nodes (manifest placement), each recording its episodes into one directory,
- a job submitted through the Jobs API (`rlplatform cluster submit`) trains and its run dir is found; a sweep
  (`cluster submit --tune`) runs its trials and its directory and results table land on the head's runs dir,
- a worker node lost mid-run: training goes on with the remaining runner; a node joins, RLlib restarts the runner,
- two CPU learners (Gloo all-reduce) hold identical weights after an update.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import run_cli
from multinode import ROOT, RayNode, read_metrics, wait_for_nodes

TINY = ["--set", "scale.envs_per_runner=1", "--set", "training.train_batch_size_per_learner=200",
        "--set", "training.minibatch_size=100", "--set", "training.num_epochs=1", "--set", "checkpoint.every=0"]


@pytest.fixture(scope="module")
def cluster():
    head = RayNode("127.0.0.2", num_cpus=2, dashboard=True)
    nodes = [head]
    try:
        # 1 CPU: the worker holds exactly one env runner, the head the algorithm and the other (spread is best effort).
        nodes.append(RayNode("127.0.0.3", num_cpus=1, address=head.address))
        wait_for_nodes(head.address, head.env, 2)
        yield nodes
    finally:
        for node in reversed(nodes):
            node.stop()


def _train(head: RayNode, runs: Path, *extra: str, stop_iterations: int) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "rlplatform", "train", "--address", head.address, "--runs-dir", str(runs),
         "--set", "scale.placement=spread", "--set", "scale.env_runners=2", "--set", "hardware.driver_cpus=1",
         # Only the iteration count stops these runs (the lean sampler reaches 100k env steps sooner).
         "--set", f"stop.iterations={stop_iterations}", "--set", "stop.env_steps=null", "--set", "stop.return_mean=null",
         *TINY, *extra],
        cwd=ROOT, env=head.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )


def _only_run_dir(runs: Path) -> Path:
    (run_dir,) = [p for p in runs.glob("*/*") if (p / "manifest.json").is_file()]
    return run_dir


@pytest.mark.slow
@pytest.mark.cluster
def test_env_runners_spread_over_two_nodes(cluster, tmp_path: Path) -> None:
    head = cluster[0]
    # Both nodes' runners record into one directory (on this machine, standing in for shared storage).
    episodes = tmp_path / "shared" / "episodes"
    proc = _train(head, tmp_path / "runs", "--set", f"record.path={episodes}", stop_iterations=2)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:]
    run_dir = _only_run_dir(tmp_path / "runs")
    manifest = json.loads((run_dir / "manifest.json").read_text())
    placement = manifest["placement"]
    assert len(placement["env_runner_nodes"]) == 2
    assert len(set(placement["env_runner_nodes"])) == 2, placement  # two distinct nodes
    assert placement["algorithm_node"] in placement["env_runner_nodes"]  # the head holds one runner and the algorithm
    dataset = json.loads((episodes / "dataset.json").read_text())
    assert dataset["episodes"] == int(read_metrics(run_dir)[-1]["episodes/total"])
    assert {f.name.split("-")[0] for f in episodes.glob("*.parquet")} == {"runner001", "runner002"}  # each runner its part


@pytest.mark.slow
@pytest.mark.cluster
def test_job_submission_through_jobs_api(cluster, tmp_path: Path) -> None:
    head = cluster[0]
    runs = tmp_path / "job-runs"
    result = run_cli(
        "cluster", "submit", "--address", head.dashboard_url, "experiments/cartpole_ppo.yaml",
        "--python", sys.executable,          # the raylet's PATH has no virtualenv
        "--ray-address", head.address,       # never "auto": another cluster on this host could answer
        "--runs-dir", str(runs),
        "--set", "scale.env_runners=1", "--set", "stop.iterations=2", *TINY,
        env=head.env, timeout=300,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    run_dir = _only_run_dir(runs)
    assert f"run directory (on the head node): {run_dir}" in output
    assert "TensorBoard:" in output
    assert len(read_metrics(run_dir)) == 2
    assert list(run_dir.glob("events.out.tfevents.*"))


@pytest.mark.slow
@pytest.mark.cluster
def test_sweep_submission_through_jobs_api(cluster, tmp_path: Path) -> None:
    """`cluster submit --tune`: a real two-trial sweep runs as a Ray job; its directory and results land on the
    head's runs dir."""
    head = cluster[0]
    runs = tmp_path / "sweep-runs"
    result = run_cli(
        "cluster", "submit", "--tune", "--address", head.dashboard_url, "experiments/cartpole_ppo_tune.yaml",
        "--python", sys.executable, "--ray-address", head.address, "--runs-dir", str(runs),
        "--set", "search.space={training.lr: {choice: [0.001, 0.01]}}", "--set", "search.searcher=grid",
        "--set", "search.samples=1", "--set", "search.scheduler=fifo",
        "--set", "scale.env_runners=0", "--set", "stop.iterations=2", "--set", "stop.env_steps=null",
        "--set", "stop.return_mean=null", "--set", "checkpoint.keep_best=false", *TINY,
        env=head.env, timeout=400,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    (sweep,) = [p for p in runs.glob("*/*") if (p / "search.yaml").is_file()]
    assert f"sweep directory (on the head node): {sweep}" in output
    rows = json.loads((sweep / "results.json").read_text())
    assert sorted(r["params"]["training.lr"] for r in rows) == [0.001, 0.01]
    assert all(r["stopped"] == "iterations 2 >= 2" for r in rows), rows
    csv_lines = (sweep / "results.csv").read_text().splitlines()
    assert len(csv_lines) == 3 and csv_lines[0].startswith("trial,training.lr,return/mean")
    for r in rows:  # every trial a run directory under the sweep, as `train` writes one
        run_dir = Path(r["run_dir"])
        assert run_dir.parent == sweep and (run_dir / "manifest.json").is_file()
        assert len(read_metrics(run_dir)) == 2


@pytest.mark.slow
@pytest.mark.cluster
def test_env_runner_node_lost_and_replaced(cluster, tmp_path: Path) -> None:
    head, worker = cluster[0], cluster[1]
    runs = tmp_path / "runs"
    proc = _train(head, runs, "--set", "rllib.reporting.min_time_s_per_iteration=1", stop_iterations=30)
    try:
        deadline = time.time() + 180
        while time.time() < deadline and not (list(runs.glob("*/*/metrics.jsonl")) and len(read_metrics(_only_run_dir(runs))) >= 2):
            assert proc.poll() is None, proc.stdout.read()[-3000:]
            time.sleep(0.5)
        run_dir = _only_run_dir(runs)
        assert len(read_metrics(run_dir)) >= 2, "training did not start"
        placement = json.loads((run_dir / "manifest.json").read_text())["placement"]
        assert len(set(placement["env_runner_nodes"])) == 2, placement
        worker.kill_raylet()  # the node dies with its env runner
        worker.stop()
        cluster.remove(worker)
        # Training goes on with the runner on the head, then a node joins and RLlib restarts the lost runner.
        deadline = time.time() + 90
        while time.time() < deadline and not any((m.get("faults/healthy_env_runners") or 0) < 2 for m in read_metrics(run_dir)):
            assert proc.poll() is None, proc.stdout.read()[-3000:]
            time.sleep(0.5)
        cluster.append(RayNode("127.0.0.4", num_cpus=1, address=head.address))
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-3000:]
    metrics = read_metrics(run_dir)
    healthy = [m.get("faults/healthy_env_runners") for m in metrics]
    restarts = [m.get("faults/env_runner_restarts") or 0 for m in metrics]
    assert healthy[0] == 2 and 1 in healthy, healthy
    assert max(restarts) > 0, restarts
    assert healthy[-1] == 2, healthy  # the restarted runner is back
    assert metrics[-1]["iteration"] == 30


LEARNER_CHECK = r"""
import hashlib, json, ray, torch
from rlplatform.config.experiment import resolve_experiment
from rlplatform.adapter.algorithm_config import build_algorithm_config
ray.init(address="local", num_cpus=3, num_gpus=0, include_dashboard=False, logging_level="ERROR")
config = resolve_experiment(None, ["scale.learners=2", "scale.env_runners=0", "scale.envs_per_runner=1",
                                   "hardware.cpus_per_learner=1", "hardware.driver_cpus=1",
                                   "training.train_batch_size_per_learner=100", "training.minibatch_size=50",
                                   "training.num_epochs=1", "profile=laptop"]).config
algo = build_algorithm_config(config).build_algo()
def digest(learner):
    import torch.distributed as dist
    h = hashlib.sha256()
    for name, tensor in sorted(learner.module["default_policy"].state_dict().items()):
        h.update(name.encode()); h.update(tensor.detach().cpu().numpy().tobytes())
    return h.hexdigest(), dist.get_backend() if dist.is_initialized() else None, dist.get_world_size() if dist.is_initialized() else 1
def each(fn):
    return [r.get() if hasattr(r, "get") else r for r in algo.learner_group.foreach_learner(fn)]
before = each(digest)
algo.train()
after = each(digest)
print("RESULT " + json.dumps({"before": [list(x) for x in before], "after": [list(x) for x in after]}))
algo.stop(); ray.shutdown()
"""


@pytest.mark.slow  # one node, a private Ray instance with two learner actors
def test_two_cpu_learners_hold_identical_weights() -> None:
    result = subprocess.run([sys.executable, "-c", LEARNER_CHECK], cwd=ROOT, capture_output=True, text=True, timeout=300)
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    assert result.returncode == 0 and lines, (result.stdout + result.stderr)[-3000:]
    data = json.loads(lines[-1][len("RESULT "):])
    before, after = data["before"], data["after"]
    assert len(after) == 2
    assert all(backend == "gloo" and world == 2 for _, backend, world in after), after
    assert after[0][0] == after[1][0], "learners diverged after an all-reduced update"
    assert after[0][0] != before[0][0], "the update did not change the weights"

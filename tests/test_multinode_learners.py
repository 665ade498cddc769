"""Two CPU learners, each fed by its own aggregator actor, on two Ray nodes of this machine (loopback IPs, each
node its own temp dir, token auth on, stopped by process id): APPO learns CartPole through `train --address`,
the learners all-reduce over Gloo and end with the same weights (the manifest's `learners` record)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from multinode import ROOT, read_metrics, wait_for_nodes

from rlplatform.infra.loopback import LoopbackCluster

TARGET = 150.0  # a 100-episode mean a random policy (about 22) never reaches


@pytest.fixture(scope="module")
def cluster():
    # Logical CPUs. Bundles: the algorithm's actor 1, the env runner 1, each learner 2 + 1 for its aggregator. Ray puts
    # each learner in any bundle of the group with room (RLlib names none); at 2 CPUs only a learner bundle has room
    # for one, and only one: two learner bundles of 3 cannot share a node of 4, so the learners run on two nodes.
    with LoopbackCluster(workers=1, cpus=4, first_ip=6) as nodes:
        wait_for_nodes(nodes.address, nodes.head.env, 2)
        yield nodes.head


@pytest.mark.slow
@pytest.mark.cluster
@pytest.mark.learning
def test_two_learners_with_aggregators_on_two_nodes_learn_cartpole_and_hold_the_same_weights(cluster, tmp_path: Path) -> None:
    head = cluster
    runs = tmp_path / "runs"
    result = subprocess.run(
        [sys.executable, "-m", "rlplatform", "train", "experiments/cartpole_appo.yaml", "--address", head.address,
         "--runs-dir", str(runs),
         "--set", "scale.learners=2", "--set", "scale.aggregators_per_learner=1", "--set", "scale.placement=spread",
         "--set", "scale.env_runners=1", "--set", "hardware.driver_cpus=1", "--set", "hardware.cpus_per_env_runner=1",
         "--set", "hardware.cpus_per_learner=2", "--set", f"stop.return_mean={TARGET}", "--set", "stop.env_steps=null",
         "--set", "stop.wall_time_s=400", "--set", "checkpoint.every=0"],
        cwd=ROOT, env=head.env, capture_output=True, text=True, timeout=900,
    )
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-3000:]
    (run_dir,) = [p for p in runs.glob("*/*") if (p / "manifest.json").is_file()]
    manifest = json.loads((run_dir / "manifest.json").read_text())
    learner_nodes = manifest["placement"]["learner_nodes"]
    assert len(learner_nodes) == 2 and len(set(learner_nodes)) == 2, manifest["placement"]  # one learner per node
    learners = manifest["learners"]
    assert learners["count"] == 2 and learners["weights_equal"], learners
    assert "learners: 2, the same weights" in out
    metrics = read_metrics(run_dir)
    assert metrics[-1]["return/mean"] >= TARGET, (metrics[-1], out[-2000:])
    assert f"return/mean {metrics[-1]['return/mean']:.2f} >= {TARGET:g}" in out  # stopped by the target, not the clock

"""Experiment tracking: a real MLflow tracking server on 127.0.0.1 (started and stopped by process id here),
read back through MLflow's client; W&B in offline mode, its run file read back; a tracker that is down or
refuses costs one warning line and never the run."""

import http.server
import json
import os
import signal
import struct
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import ROOT, free_port, only_run_dir, read_metrics, run_cli

TWO_ITERATIONS = ["--set", "stop.iterations=2", "--set", "stop.env_steps=null", "--set", "stop.return_mean=null",
                  "--set", "scale.env_runners=0", "--set", "model.hidden=[16]", "--set", "checkpoint.every=1",
                  "--set", "training.train_batch_size_per_learner=128", "--set", "training.minibatch_size=64"]


def start_mlflow_server(root: Path) -> tuple[subprocess.Popen, str]:
    """`mlflow server` on a free loopback port with a SQLite store, in its own process group; (process, URI)
    once it answers /health."""
    port = free_port()
    log = (root / "server.log").open("w")
    server = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
         "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}", "--artifacts-destination", str(root / "artifacts")],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},  # no job-runner processes for a test
    )
    log.close()  # the child holds its own copy
    uri = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert server.poll() is None, (root / "server.log").read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"{uri}/health", timeout=2) as answer:
                    if answer.status == 200:
                        return server, uri
            except OSError:
                pass
            assert time.monotonic() < deadline, "mlflow server did not answer within 120 s"
            time.sleep(0.5)
    except BaseException:
        stop_mlflow_server(server)
        raise


def stop_mlflow_server(server: subprocess.Popen, sig: int = signal.SIGTERM) -> None:
    """Its process group (its own: start_new_session) by its id; SIGKILL if it does not go."""
    if server.poll() is None:
        os.killpg(server.pid, sig)
    try:
        server.wait(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    server, uri = start_mlflow_server(tmp_path_factory.mktemp("mlflow"))
    try:
        yield uri
    finally:
        stop_mlflow_server(server)


def wandb_records(run_file: Path):
    """The records of a W&B run file (`run-<id>.wandb`): a LevelDB-style log of protobuf `Record`s in 32 KiB
    blocks, each chunk behind a 7-byte header (crc32, length, type: 1 full, 2 first, 3 middle, 4 last)."""
    from wandb.proto import wandb_internal_pb2

    data, block, header = run_file.read_bytes(), 32768, 7
    assert data[:4] == b":W&B", data[:7]
    pos, chunks = header, []
    while pos + header <= len(data):
        if block - pos % block < header:
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + header])
        if kind == 0 and length == 0:  # zero padding up to the block's end
            pos += block - pos % block
            continue
        chunks.append(data[pos + header:pos + header + length])
        pos += header + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(chunks))
            chunks = []
            yield record


@pytest.mark.slow
def test_mlflow_and_wandb_offline_get_metrics_params_and_artifacts(mlflow_server, runs, tmp_path):
    from mlflow.tracking import MlflowClient

    result = run_cli("train", "--runs-dir", runs, "--set", "name=tracked", *TWO_ITERATIONS,
                     "--set", f"tracking.mlflow.uri={mlflow_server}", "--set", "tracking.mlflow.experiment=tracking-test",
                     "--set", "tracking.wandb={project: rlplatform-test, mode: offline}", timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "warning" not in result.stderr, result.stderr
    run_dir = only_run_dir(runs, "tracked")
    rows = read_metrics(run_dir)
    steps = [row["env_steps"] for row in rows]
    final = sorted((run_dir / "checkpoints").glob("checkpoint_*"))[-1]

    client = MlflowClient(tracking_uri=mlflow_server)
    experiment = client.get_experiment_by_name("tracking-test")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FINISHED"
    assert run.info.run_id == json.loads((run_dir / "tracking.json").read_text())["mlflow_run_id"]
    history = client.get_metric_history(run.info.run_id, "return/mean")
    assert [m.step for m in history] == steps
    assert [m.value for m in history] == pytest.approx([row["return/mean"] for row in rows])
    assert [m.step for m in client.get_metric_history(run.info.run_id, "progress/iteration")] == steps
    assert run.data.params["algorithm"] == "PPO" and run.data.params["env"] == "CartPole-v1"
    assert run.data.params["training.train_batch_size_per_learner"] == "128"
    assert run.data.tags["rlplatform.final_checkpoint"] == str(final.resolve())
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"config.yaml", "manifest.json"} <= artifacts, artifacts
    config_copy = client.download_artifacts(run.info.run_id, "config.yaml", str(tmp_path))
    assert Path(config_copy).read_text() == (run_dir / "config.yaml").read_text()

    exported = run_cli("export", run_dir, "-o", tmp_path / "policy")
    assert exported.returncode == 0, exported.stdout + exported.stderr
    exported_files = {a.path for a in client.list_artifacts(run.info.run_id, "export")}
    assert exported_files == {"export/policy.onnx", "export/export.json"}, exported_files

    run_files = sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(run_files) == 2  # the run, then the export joining it (the same W&B run id)
    records = list(wandb_records(run_files[0]))
    (started,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert started.run_id == json.loads((run_dir / "tracking.json").read_text())["wandb_run_id"]
    assert started.project == "rlplatform-test"
    config = {item.key: json.loads(item.value_json) for item in started.config.update}
    assert config["algorithm"] == "PPO" and config["training.train_batch_size_per_learner"] == 128
    history = [{item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
               for r in records if r.WhichOneof("record_type") == "history"]
    assert [h["env_steps"] for h in history] == steps
    assert [h["return/mean"] for h in history] == pytest.approx([row["return/mean"] for row in rows])
    saved = {f.path for r in records if r.WhichOneof("record_type") == "files" for f in r.files.files}
    assert {"config.yaml", "manifest.json"} <= saved, saved
    summary = {item.key: item.value_json for r in records if r.WhichOneof("record_type") == "summary" for item in r.summary.update}
    assert json.loads(summary["rlplatform.final_checkpoint"]) == str(final.resolve())
    export_saved = {f.path for r in wandb_records(run_files[1]) if r.WhichOneof("record_type") == "files" for f in r.files.files}
    assert {"policy/policy.onnx", "policy/export.json"} <= export_saved, export_saved


@pytest.mark.slow
def test_a_tracker_that_is_down_or_refuses_is_one_warning_line_and_the_run_goes_on(runs):
    down = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    env = {"WANDB_API_KEY": "", "NETRC": os.devnull}
    result = run_cli("train", "--runs-dir", runs, "--set", "name=untracked", *TWO_ITERATIONS,
                     "--set", f"tracking.mlflow.uri={down}", "--set", "tracking.wandb.project=p", timeout=300, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 2, result.stderr
    assert warnings[0].startswith("warning: MLflow tracking is off for this run: ") and warnings[0].endswith("TensorBoard goes on")
    assert warnings[1].startswith("warning: W&B tracking is off for this run: ") and "API key" in warnings[1]
    assert "Traceback" not in result.stdout + result.stderr
    run_dir = only_run_dir(runs, "untracked")
    assert [row["iteration"] for row in read_metrics(run_dir)] == [1, 2]
    assert list(run_dir.glob("events.out.tfevents.*"))
    assert not (run_dir / "tracking.json").exists()


class _Refusing(http.server.BaseHTTPRequestHandler):
    def _refuse(self):
        self.send_response(403)
        self.end_headers()
        self.wfile.write(b"forbidden")

    do_GET = do_POST = do_PATCH = _refuse

    def log_message(self, *args):
        pass


@pytest.mark.slow
def test_a_server_killed_mid_run_drops_the_tracker_with_one_warning_and_the_run_finishes(runs, tmp_path):
    """A real `mlflow server`, SIGKILLed once the run's first iteration has reached it: the next send fails,
    MLflow is dropped with one warning line, and the run trains on to its end (exit 0) with TensorBoard."""
    from mlflow.tracking import MlflowClient

    server, uri = start_mlflow_server(tmp_path)
    try:
        train = subprocess.Popen(
            [sys.executable, "-m", "rlplatform", "train", "--runs-dir", str(runs), "--set", "name=killed",
             *TWO_ITERATIONS, "--set", "stop.iterations=4", "--set", "checkpoint.every=0",
             "--set", "rllib.reporting.min_time_s_per_iteration=2",  # time to see iteration 1 and kill before 2
             "--set", f"tracking.mlflow.uri={uri}", "--set", "tracking.mlflow.experiment=killed"],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        client, logged = MlflowClient(tracking_uri=uri), []
        deadline = time.monotonic() + 240
        while not logged and train.poll() is None and time.monotonic() < deadline:
            experiment = client.get_experiment_by_name("killed")
            runs_there = client.search_runs([experiment.experiment_id]) if experiment else []
            if runs_there:
                logged = client.get_metric_history(runs_there[0].info.run_id, "progress/iteration")
            if not logged:
                time.sleep(0.1)
        assert [m.value for m in logged] == [1], logged  # only the first iteration had reached the server
        stop_mlflow_server(server, signal.SIGKILL)
        out, err = train.communicate(timeout=300)
    finally:
        stop_mlflow_server(server, signal.SIGKILL)
    assert train.returncode == 0, out[-3000:] + err[-3000:]
    warnings = [line for line in err.splitlines() if "warning" in line.lower() and "mlflow" in line.lower()]
    assert len(warnings) == 1, err
    assert warnings[0].startswith("warning: MLflow tracking stopped (sending metrics failed): "), warnings[0]
    assert warnings[0].endswith("TensorBoard goes on")
    assert "Traceback" not in out + err
    run_dir = only_run_dir(runs, "killed")
    assert [row["iteration"] for row in read_metrics(run_dir)] == [1, 2, 3, 4]
    assert list(run_dir.glob("events.out.tfevents.*"))


def test_a_server_that_refuses_at_start_up_drops_the_tracker_with_one_warning(tmp_path, capsys):
    """In the driver's logger itself, no Ray: a server that answers 403 to everything, the run's creation first."""
    from rlplatform.config.schema import validate
    from rlplatform.run.tracking import Tracking

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Refusing)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        config = validate({"tracking": {"mlflow": {"uri": f"http://127.0.0.1:{server.server_address[1]}"}}})
        tracking = Tracking(tmp_path, config, resume=False)
        tracking.log({"return/mean": 1.0}, 100)
        tracking.end()
    finally:
        server.shutdown()
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("warning: MLflow tracking is off for this run"), lines
    assert tracking.trackers == []


def test_tracking_section_is_validated():
    from rlplatform.config.schema import validate
    from rlplatform.errors import UserError

    config = validate({"tracking": {"mlflow": {"uri": "http://127.0.0.1:5000"}, "wandb": {"project": "p", "mode": "offline"}}})
    assert config.tracking.mlflow.experiment is None and config.tracking.wandb.mode == "offline"
    for bad, fragment in (({"wandb": {"project": "p", "mode": "sometimes"}}, "tracking.wandb.mode"),
                          ({"mlflow": {"uri": "http://x", "url": "http://x"}}, "unknown key 'tracking.mlflow.url'"),
                          ({"mlflow": {}}, "tracking.mlflow.uri")):
        with pytest.raises(UserError, match=fragment.replace(".", r"\.")):
            validate({"tracking": bad})

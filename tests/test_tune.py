"""`rlplatform tune`: real sweeps on Ray Tune (ASHA, PBT, Optuna, interrupt and resume) on CartPole, tiny, sharing
one Ray instance; and every bad `search:` entry refused with one line before Ray starts."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import yaml

from rlplatform.cli import main

TINY = {
    "version": 1, "algorithm": "PPO", "env": "CartPole-v1", "seed": 0,
    "training": {"lr": 0.001, "num_epochs": 2, "minibatch_size": 64, "train_batch_size_per_learner": 200},
    "model": {"hidden": [16, 16]},
    "scale": {"env_runners": 0, "envs_per_runner": 1},
    "stop": {"iterations": 4},
    "checkpoint": {"every": 0, "keep_last": 2},
}


def experiment(tmp_path: Path, name: str, search: dict, **changes) -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump({**TINY, "name": name, **changes, "search": search}))
    return path


def sweep_dir(runs: Path, name: str) -> Path:
    (found,) = sorted((runs / name).iterdir())
    return found


def results(sweep: Path) -> list[dict]:
    return json.loads((sweep / "results.json").read_text())


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def history(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "config_history.jsonl").read_text().splitlines()]


# ----------------------------------------------------------------------------- bad input, before Ray starts


BAD_SEARCH = [
    ({"space": {"training.lrr": {"loguniform": [1.0e-4, 1.0e-3]}}}, "search.space.training.lrr", "not a PPO hyper-parameter"),
    ({"space": {"model.hiden": {"choice": [[8]]}}}, "search.space.model.hiden", "unknown key 'model.hiden'"),
    ({"space": {"training.lr": {"logunifrom": [1.0e-4, 1.0e-3]}}}, "search.space.training.lr", "unknown distribution 'logunifrom'"),
    ({"space": {"training.num_epochs": {"choice": []}}}, "search.space.training.num_epochs", "non-empty"),
    ({"space": {"training.lr": {"uniform": [0.01, 0.001]}}}, "search.space.training.lr", "must be below high"),
    ({"space": {"training.lr": {"choice": [0.1]}}, "metric": "return/maen"}, "search.metric", "not one of our metric tags"),
    ({"space": {"model.hidden": {"choice": [[16], "wide"]}}}, "search.space.model.hidden", "'wide'"),
    ({"space": {"training.lr": {"choice": [0.1]}}, "scheduler": "hyperband"}, "search.scheduler", "'hyperband'"),
    ({"space": {"training.num_epochs": {"choice": [5, "ten"]}}}, "search.space.training.num_epochs = 'ten'", "an integer"),
    ({"space": {"training.num_epochs": {"uniform": [2, 8]}}}, "search.space.training.num_epochs = 2.0", "use randint"),
    ({"space": {"training.lr": {"choice": [0.001, True]}}}, "search.space.training.lr = True", "a number"),
    ({"space": {"training.use_gae": {"choice": [True, 0]}}}, "search.space.training.use_gae = 0", "true or false"),
    ({"space": {"init_from": {"choice": ["runs/a", "runs/b"]}}}, "search.space.init_from", "resolved and checked once"),
    ({"space": {"training.lr": {"choice": [0.1]}}, "scheduler": "pbt",
      "pbt": {"mutations": {"training.minibatch_size": {"loguniform": [32, 128]}}}},
     "training.minibatch_size = 32.0", "an integer"),
]


@pytest.mark.parametrize("search, key, problem", BAD_SEARCH, ids=[case[1] + ":" + case[2][:12] for case in BAD_SEARCH])
def test_bad_search_entry_is_one_line_before_ray(tmp_path, capsys, search, key, problem):
    import ray

    path = experiment(tmp_path, "bad", search)
    code = main(["tune", str(path), "--runs-dir", str(tmp_path / "runs")])
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, out + err
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert key in lines[0] and problem in lines[0], lines[0]
    assert "Traceback" not in out + err
    assert not ray.is_initialized() and not (tmp_path / "runs").exists()


def test_trials_that_fit_packs_bundles_per_node():
    from rlplatform.config.sizing import Resources
    from rlplatform.run.sweep import trials_that_fit

    two_nodes = Resources(cpus=12, gpus=2, nodes=[{"CPU": 8, "GPU": 1}, {"CPU": 4, "GPU": 1}])
    assert trials_that_fit([{"CPU": 1}], Resources(cpus=2, gpus=0, nodes=[{"CPU": 2, "GPU": 0}])) == 2
    assert trials_that_fit([{"CPU": 1, "GPU": 1}, {"CPU": 1}, {"CPU": 1}], two_nodes) == 2
    assert trials_that_fit([{"CPU": 5}], two_nodes) == 1  # 5 + 5 CPUs, but no node holds the second
    assert trials_that_fit([{"CPU": 1, "GPU": 1}], Resources(cpus=8, gpus=0, nodes=[{"CPU": 8, "GPU": 0}])) == 0


def test_cluster_submit_runs_a_sweep_as_a_job_and_finds_its_directory():
    import shlex

    from rlplatform.infra.jobs import run_dir_from_logs, train_entrypoint

    entrypoint = train_entrypoint("python", "experiments/cartpole_ppo_tune.yaml", ["search.samples=4"], None, "auto",
                                  "/mnt/shared/runs", verb="tune")
    assert shlex.split(entrypoint) == ["python", "-m", "rlplatform", "tune", "experiments/cartpole_ppo_tune.yaml",
                                       "--set", "search.samples=4", "--address", "auto", "--runs-dir", "/mnt/shared/runs"]
    logs = "rlplatform tune PPO on CartPole-v1: ...\nsweep directory: /mnt/shared/runs/x/2026-01-01_00-00-00\nbest trial: ..."
    assert run_dir_from_logs(logs) == "/mnt/shared/runs/x/2026-01-01_00-00-00"


def test_submit_tune_needs_a_search_section(tmp_path):
    from rlplatform.cli import build_parser
    from rlplatform.errors import UserError

    (tmp_path / "plain.yaml").write_text(yaml.safe_dump({**TINY, "name": "plain"}))
    # The verb itself, not `main`: `main` with --address switches this process to token mode for joining a cluster.
    args = build_parser().parse_args(["cluster", "submit", str(tmp_path / "plain.yaml"), "--address",
                                      "http://127.0.0.1:1", "--working-dir", str(tmp_path), "--tune"])
    with pytest.raises(UserError, match="no search section to sweep"):
        args.func(args)


# ----------------------------------------------------------------------------- real sweeps, one Ray instance


@pytest.fixture(scope="module")
def shared_ray():
    """One private Ray instance for the module's sweeps (the `tune` command uses a Ray this process runs)."""
    from rlplatform.infra import local_ray
    from rlplatform.infra.local_ray import local_resources

    local_ray.connect(None, local_resources(), speedups=True)
    yield
    local_ray.shutdown()


@pytest.mark.slow
def test_asha_stops_trials_early_and_every_trial_is_a_run(tmp_path, capsys, shared_ray):
    search = {"space": {"training.lr": {"loguniform": [1.0e-5, 3.0e-2]}, "model.hidden": {"choice": [[16], [32, 32]]}},
              "samples": 4, "scheduler": "asha", "asha": {"grace_period": 1, "reduction_factor": 2}}
    runs = tmp_path / "runs"
    assert main(["tune", str(experiment(tmp_path, "asha", search)), "--runs-dir", str(runs)]) == 0
    out = capsys.readouterr().out
    sweep = sweep_dir(runs, "asha")
    rows = results(sweep)
    assert len(rows) == 4 and {r["trial"] for r in rows} == {f"trial_0000{i}" for i in range(4)}
    early = [r for r in rows if r["stopped"] == "stopped early by ASHA"]
    assert early and all(r["iterations"] < 4 for r in early), rows
    assert all(r["stopped"] == "iterations 4 >= 4" for r in rows if r not in early)
    values = [r["return/mean"] for r in rows]
    assert values == sorted(values, reverse=True)
    csv_lines = (sweep / "results.csv").read_text().splitlines()
    assert len(csv_lines) == 5 and csv_lines[0].startswith("trial,model.hidden,training.lr,return/mean")
    for row in rows:  # each trial is a run directory as `train` writes it, with the trial's parameters applied
        run_dir = Path(row["run_dir"])
        config = yaml.safe_load((run_dir / "config.yaml").read_text())
        assert config["training"]["lr"] == row["params"]["training.lr"]
        assert config["model"]["hidden"] == row["params"]["model.hidden"]
        assert config["search"] is None
        assert [m["iteration"] for m in metrics(run_dir)] == list(range(1, row["iterations"] + 1))
        assert list(run_dir.glob("events.out.tfevents.*"))
        assert (run_dir / "checkpoints" / f"checkpoint_{row['iterations']:06d}" / "rlplatform_checkpoint.json").is_file()
        assert json.loads((run_dir / "manifest.json").read_text())["params"] == row["params"]
    best = rows[0]
    assert f"best trial: {best['trial']}" in out and f"python -m rlplatform evaluate {best['run_dir']}" in out
    assert out.count("stopped early by ASHA") >= 2 * len(early)  # its line when it stopped, and the table
    # `report` overlays the trials of a sweep directory
    assert main(["report", str(sweep), "-o", str(tmp_path / "report.png")]) == 0
    assert "(4 run(s))" in capsys.readouterr().out


@pytest.mark.slow
def test_pbt_perturbs_a_trial_and_its_learner_takes_the_new_learning_rate(tmp_path, capsys, shared_ray):
    search = {"space": {"training.lr": {"choice": [1.0e-4, 1.0e-2]}}, "samples": 2, "scheduler": "pbt",
              "pbt": {"interval": 2, "synchronous": True, "resample_probability": 1.0,
                      "mutations": {"training.lr": {"loguniform": [1.0e-6, 1.0e-5]}}}}
    runs = tmp_path / "runs"
    assert main(["tune", str(experiment(tmp_path, "pbt", search)), "--runs-dir", str(runs)]) == 0
    sweep = sweep_dir(runs, "pbt")
    rows = results(sweep)
    assert len(rows) == 2
    perturbed = [r for r in rows if any(h["params"]["training.lr"] < 1.0e-5 for h in history(Path(r["run_dir"])))]
    assert len(perturbed) == 1, [history(Path(r["run_dir"])) for r in rows]
    run_dir = Path(perturbed[0]["run_dir"])
    first, exploit = history(run_dir)[0], history(run_dir)[-1]
    assert first["params"]["training.lr"] in (1.0e-4, 1.0e-2) and exploit["from_iteration"] == 2
    other = next(Path(r["run_dir"]) for r in rows if r is not perturbed[0])
    assert Path(exploit["from_checkpoint"]).parent.parent == other  # it continued from the better trial's weights
    new_lr = exploit["params"]["training.lr"]
    lrs = {m["iteration"]: m["learner/default_policy/lr"] for m in metrics(run_dir)}
    assert lrs[2] == pytest.approx(first["params"]["training.lr"])
    assert lrs[3] == pytest.approx(new_lr) and lrs[4] == pytest.approx(new_lr)
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["training"]["lr"] == pytest.approx(new_lr)


@pytest.mark.slow
def test_optuna_searches_three_trials(tmp_path, capsys, shared_ray):
    search = {"space": {"training.lr": {"loguniform": [1.0e-4, 1.0e-2]}, "model.hidden": {"choice": [[16], [32, 32]]}},
              "samples": 3, "searcher": "optuna"}
    runs = tmp_path / "runs"
    assert main(["tune", str(experiment(tmp_path, "optuna", search, stop={"iterations": 2})), "--runs-dir", str(runs)]) == 0
    rows = results(sweep_dir(runs, "optuna"))
    assert len(rows) == 3 and all(r["stopped"] == "iterations 2 >= 2" and r["return/mean"] > 0 for r in rows)
    assert len({r["params"]["training.lr"] for r in rows}) == 3
    assert all(r["params"]["model.hidden"] in ([16], [32, 32]) for r in rows)  # lists travel through Optuna as text
    for r in rows:
        assert yaml.safe_load((Path(r["run_dir"]) / "config.yaml").read_text())["model"]["hidden"] == r["params"]["model.hidden"]


@pytest.mark.slow
def test_interrupted_sweep_resumes_with_finished_trials_kept(tmp_path, capsys, shared_ray):
    search = {"space": {"training.lr": {"choice": [1.0e-4, 1.0e-3, 1.0e-2]}}, "searcher": "grid", "samples": 1,
              "concurrent": 1}
    runs = tmp_path / "runs"
    iterations = 8  # the interrupt comes at the second trial's first iteration; Tune takes a few to act on it
    path = experiment(tmp_path, "resume", search, stop={"iterations": iterations})

    def interrupt_once_the_second_trial_trains() -> None:  # Ctrl-C, as the terminal sends it to the driver
        deadline = time.time() + 240
        while time.time() < deadline:
            second = list((runs / "resume").glob("*/trial_00001/metrics.jsonl"))
            if second and second[0].read_text().count("\n") >= 1:
                os.kill(os.getpid(), signal.SIGINT)
                return
            time.sleep(0.2)

    watcher = threading.Thread(target=interrupt_once_the_second_trial_trains, daemon=True)
    watcher.start()
    assert main(["tune", str(path), "--runs-dir", str(runs)]) == 0
    watcher.join()
    out = capsys.readouterr().out
    sweep = sweep_dir(runs, "resume")
    assert f"continue with: python -m rlplatform tune --resume {sweep}" in out
    before = {r["trial"]: r for r in results(sweep)}
    assert before["trial_00000"]["stopped"] == f"iterations {iterations} >= {iterations}"
    assert before["trial_00001"]["stopped"].startswith("interrupted")
    finished_metrics = (sweep / "trial_00000" / "metrics.jsonl").read_text()
    stopped_at = max(m["iteration"] for m in metrics(sweep / "trial_00001"))
    checkpoint = sweep / "trial_00001" / "checkpoints" / f"checkpoint_{stopped_at:06d}"
    assert checkpoint.is_dir()  # the stop checkpointed the interrupted trial's last iteration

    assert main(["tune", "--resume", str(sweep)]) == 0
    after = {r["trial"]: r for r in results(sweep)}
    assert set(after) == {"trial_00000", "trial_00001", "trial_00002"}
    assert all(r["stopped"] == f"iterations {iterations} >= {iterations}" for r in after.values()), after
    assert (sweep / "trial_00000" / "metrics.jsonl").read_text() == finished_metrics  # not run again
    resumed = history(sweep / "trial_00001")
    assert len(resumed) == 2 and resumed[1]["from_checkpoint"] == str(checkpoint)
    assert [m["iteration"] for m in metrics(sweep / "trial_00001")] == list(range(1, iterations + 1))


@pytest.mark.slow
def test_a_sweep_whose_trials_all_fail_exits_1_naming_their_error_files(tmp_path, capsys, shared_ray):
    # CostlySim refuses a negative wait in its constructor: every trial fails building its env, inside Ray
    search = {"space": {"training.lr": {"choice": [1.0e-3, 1.0e-2]}}, "searcher": "grid", "samples": 1}
    runs = tmp_path / "runs"
    path = experiment(tmp_path, "failing", search, env="rlplatform/CostlySim-v0", env_config={"wait_ms": -1},
                      stop={"iterations": 1})
    code = main(["tune", str(path), "--runs-dir", str(runs)])
    out, err = capsys.readouterr()
    sweep = sweep_dir(runs, "failing")
    rows = results(sweep)
    assert code == 1, out + err
    assert len(rows) == 2 and all(r["stopped"].startswith("error: ") for r in rows), rows
    assert all("wait_ms must be >= 0" in r["stopped"] for r in rows), rows
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, err
    assert "no trial of the sweep finished: 2 of 2 trial(s) failed" in errors[0], errors[0]
    for r in rows:
        assert Path(r["error_file"]).is_file() and r["error_file"] in errors[0], (r, errors[0])
        assert "wait_ms must be >= 0" in Path(r["error_file"]).read_text()


@pytest.mark.slow
def test_a_sweep_with_one_failed_trial_exits_0_and_says_it_failed(tmp_path, capsys, shared_ray):
    search = {"space": {"env_config.wait_ms": {"choice": [0, -1]}}, "searcher": "grid", "samples": 1}
    runs = tmp_path / "runs"
    path = experiment(tmp_path, "half", search, env="rlplatform/CostlySim-v0", stop={"iterations": 1})
    code = main(["tune", str(path), "--runs-dir", str(runs)])
    out, err = capsys.readouterr()
    rows = results(sweep_dir(runs, "half"))
    assert code == 0, out + err
    (failed,) = [r for r in rows if r["stopped"].startswith("error: ")]
    (finished,) = [r for r in rows if r["stopped"] == "iterations 1 >= 1"]
    assert failed["params"] == {"env_config.wait_ms": -1} and finished["params"] == {"env_config.wait_ms": 0}
    assert f"1 of 2 trial(s) failed; their errors: {failed['error_file']}" in " ".join(out.split())
    assert not [line for line in err.splitlines() if line.startswith("error: ")], err

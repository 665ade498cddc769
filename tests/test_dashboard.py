"""Dashboards: a real short training run, a real TensorBoard server read over HTTP, a real
headless Chromium rendering the Custom Scalars page, and `report` plotting two runs."""

import json
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml
from conftest import ROOT, assert_user_error, free_port, read_metrics, run_cli

ARTIFACTS = ROOT / "test-artifacts"
SECTIONS = ["Overview", "Learner", "Cluster"]
REPORT_PANELS = ["Return vs env steps", "Return vs wall time", "Env steps/s sampled", "Time per iteration: sample / learn / sync"]
TIME_PARTS = {"sample": "time/sample_s", "learn": "time/learn_s", "sync weights": "time/sync_weights_s"}


@pytest.fixture(scope="module")
def two_runs(ray_head, tmp_path_factory) -> Path:
    runs = tmp_path_factory.mktemp("dash") / "runs"
    for name, lr in (("dash-a", "1e-3"), ("dash-b", "3e-4")):
        result = run_cli("train", "--address", ray_head.address, "--runs-dir", runs, "--set", f"name={name}",
                         "--set", f"training.lr={lr}", "--set", "stop.iterations=2", "--set", "evaluation.interval=1",
                         "--set", "evaluation.episodes=2", "--set", "training.train_batch_size_per_learner=500",
                         timeout=300)
        assert result.returncode == 0, result.stdout + result.stderr
    return runs


def http_json(url: str, body: dict | None = None):
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


@pytest.fixture(scope="module")
def tensorboard(two_runs):
    """`rlplatform dashboard` on a port that is already taken: it must say so and use the next one."""
    port = free_port()
    blocker = socket.socket()
    blocker.bind(("127.0.0.1", port))
    blocker.listen()
    proc = subprocess.Popen([sys.executable, "-m", "rlplatform", "dashboard", str(two_runs), "--port", str(port)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    url = None
    deadline = time.time() + 60
    while time.time() < deadline and url is None:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            break
        lines.append(line)
        match = re.search(r"(http://127\.0\.0\.1:\d+/)", line)
        url = match.group(1) if match else None
    assert url, "".join(lines)
    for _ in range(60):  # the runs are loaded in the background
        tags = http_json(url + "data/plugin/scalars/tags")
        if len(tags) == 2 and all("eval/return_mean" in t for t in tags.values()):
            break
        time.sleep(1)
    yield {"url": url, "asked_port": port, "output": "".join(lines)}
    proc.terminate()
    proc.wait(timeout=30)
    blocker.close()


@pytest.mark.slow  # two training runs on a Ray head
def test_port_in_use_moves_to_the_next_free_port(tensorboard):
    assert f"port {tensorboard['asked_port']} is in use" in tensorboard["output"]
    assert f":{tensorboard['asked_port']}/" not in tensorboard["url"]


@pytest.mark.slow  # two training runs on a Ray head
def test_custom_scalars_layout_has_three_sections_whose_tags_all_exist(tensorboard):
    url = tensorboard["url"]
    layout = http_json(url + "data/plugin/custom_scalars/layout")
    assert [c["title"] for c in layout["category"]] == SECTIONS
    tags_by_run = http_json(url + "data/plugin/scalars/tags")
    for run, tags in tags_by_run.items():
        for category in layout["category"]:
            for chart in category["chart"]:
                for pattern in chart["multiline"]["tag"]:
                    assert any(re.fullmatch(pattern, tag) for tag in tags), (run, chart["title"], pattern)
    overview = [c["title"] for c in layout["category"][0]["chart"]]
    assert any("Return" in t for t in overview) and any("Env steps per second" in t for t in overview)
    cluster = {c["title"] for c in layout["category"][2]["chart"]}
    assert {"CPU % per node", "RAM % per node", "Env runners: healthy and restarts"} <= cluster


@pytest.mark.slow  # two training runs on a Ray head
def test_hparams_lists_both_runs_with_their_scale_and_final_metrics(tensorboard, two_runs):
    groups = http_json(tensorboard["url"] + "data/plugin/hparams/session_groups", {
        "experimentName": "", "startIndex": 0, "sliceSize": 100, "colParams": [],
        "allowedStatuses": ["STATUS_UNKNOWN", "STATUS_SUCCESS", "STATUS_FAILURE", "STATUS_RUNNING"],
    })["sessionGroups"]
    assert len(groups) == 2
    # Each run's final numbers, as it logged them: the last row of its metrics.jsonl, by learning rate.
    last_rows = {}
    for run_dir in two_runs.glob("*/*"):
        lr = yaml.safe_load((run_dir / "config.yaml").read_text())["training"]["lr"]
        last_rows[lr] = read_metrics(run_dir)[-1]
    assert set(last_rows) == {1e-3, 3e-4}
    for group in groups:
        assert {"scale.env_runners", "scale.envs_per_runner", "profile"} <= set(group["hparams"])
        metrics = {m["name"]["tag"]: m["value"] for m in group["metricValues"]}
        last = last_rows[group["hparams"]["training.lr"]]
        for tag in ("return/mean", "throughput/env_steps_sampled_per_s"):
            assert metrics[tag] == pytest.approx(last[tag], rel=1e-6), (tag, metrics, last)
    assert {g["hparams"]["training.lr"] for g in groups} == {1e-3, 3e-4}


@pytest.mark.slow
@pytest.mark.browser
def test_headless_chromium_renders_the_overview_charts(tensorboard, two_runs):
    from playwright.sync_api import sync_playwright

    layout = http_json(tensorboard["url"] + "data/plugin/custom_scalars/layout")
    overview_titles = [c["title"] for c in layout["category"][0]["chart"]]
    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path="/usr/bin/chromium", headless=True,
            args=["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--no-first-run"],
        )
        try:
            page = browser.new_page(viewport={"width": 1600, "height": 1400})
            page.goto(tensorboard["url"] + "#custom_scalars", wait_until="networkidle")
            # Playwright's text locators pierce the plugin's shadow DOM, where the charts live.
            for text in [*SECTIONS, *overview_titles]:
                page.get_by_text(text, exact=True).first.wait_for(state="visible", timeout=60_000)
            page.wait_for_timeout(2000)  # let the lines draw before the screenshot
            page.screenshot(path=str(ARTIFACTS / "custom_scalars.png"), full_page=True)
        finally:
            browser.close()
    assert (ARTIFACTS / "custom_scalars.png").stat().st_size > 10_000


def test_dashboard_refuses_a_missing_directory(tmp_path):
    assert_user_error(run_cli("dashboard", tmp_path / "nothing-here"), "no such runs directory", "nothing-here")


@pytest.mark.slow  # two training runs on a Ray head
def test_report_plots_two_runs(two_runs, tmp_path):
    from rlplatform.dashboards.report import load_rows, run_label

    run_dirs = sorted(two_runs.glob("*/*"))
    output = tmp_path / "report.png"
    result = run_cli("report", *run_dirs, "-o", output)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 run(s)" in result.stdout
    png = output.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000
    width, height = int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")
    assert (width, height) == (1300, 850)
    # The same runs plotted in this process: every panel shows both runs' real numbers.
    runs = {run_label(d): load_rows(d) for d in run_dirs}
    assert_report_shows(plotted(runs, tmp_path / "again.png"), runs)


def plotted(runs: dict, output: Path):
    """`report.plot` as `rlplatform report` calls it, keeping the figure it saves (it closes it) to inspect."""
    import matplotlib.figure

    from rlplatform.dashboards import report

    figures, savefig = [], matplotlib.figure.Figure.savefig

    def keep(fig, *args, **kwargs):
        figures.append(fig)
        return savefig(fig, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(matplotlib.figure.Figure, "savefig", keep)
        report.plot(runs, output)
    (figure,) = figures
    assert output.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return figure


def assert_report_shows(figure, runs: dict) -> None:
    """Four panels: three curves per run (rows without the value left out) and a stacked time split per run."""
    import numpy as np

    def series(rows, x, y):
        points = [(r[x], r[y]) for r in rows if r.get(x) is not None and r.get(y) is not None]
        return [p[0] for p in points], [p[1] for p in points]

    def mean(rows, key):
        values = [r[key] for r in rows if r.get(key) is not None]
        return sum(values) / len(values) if values else 0.0

    axes = figure.axes
    assert [ax.get_title() for ax in axes] == REPORT_PANELS
    curves = [("env_steps", "return/mean"), ("wall_time_s", "return/mean"), ("env_steps", "throughput/env_steps_sampled_per_s")]
    for ax, (x, y) in zip(axes, curves):
        lines = {line.get_label(): line for line in ax.get_lines()}
        assert set(lines) == set(runs), (ax.get_title(), sorted(lines))
        for label, rows in runs.items():
            xs, ys = series(rows, x, y)
            assert xs, (label, x, y)  # a real run logs every one of these
            np.testing.assert_allclose(lines[label].get_xdata(), xs, err_msg=f"{ax.get_title()}: {label}")
            np.testing.assert_allclose(lines[label].get_ydata(), ys, err_msg=f"{ax.get_title()}: {label}")
    split = axes[3]
    stacks = {container.get_label(): [bar.get_height() for bar in container] for container in split.containers}
    assert list(stacks) == [*TIME_PARTS, "other"]
    for i, rows in enumerate(runs.values()):
        parts = [mean(rows, key) for key in TIME_PARTS.values()]
        assert [stacks[name][i] for name in TIME_PARTS] == pytest.approx(parts)
        assert stacks["other"][i] == pytest.approx(max(0.0, mean(rows, "time/iteration_s") - sum(parts)))
    assert [t.get_text() for t in split.get_xticklabels()] == [label.replace("/", "\n") for label in runs]


def test_report_overlays_each_run_on_four_panels(tmp_path):
    """`report.plot` on rows as runs write them, without training: one with gaps, one whose time is mostly elsewhere."""
    a = [{"iteration": i, "env_steps": 1000 * i, "wall_time_s": 2.0 * i, "return/mean": 10.0 * i,
          "throughput/env_steps_sampled_per_s": 500.0 + i, "time/iteration_s": 2.0, "time/sample_s": 0.5,
          "time/learn_s": 1.0 + 0.1 * i, "time/sync_weights_s": 0.1} for i in range(1, 5)]
    a[1].pop("return/mean")  # an iteration before any episode finished
    b = [{"iteration": i, "env_steps": 400 * i, "wall_time_s": 1.5 * i, "return/mean": 30.0 - i,
          "throughput/env_steps_sampled_per_s": 900.0, "time/iteration_s": 5.0, "time/sample_s": 0.25} for i in range(1, 4)]
    runs = {"cartpole-ppo/2026-01-01_00-00-00": a, "cartpole-dqn/2026-01-02_00-00-00": b}
    output = tmp_path / "report.png"
    assert_report_shows(plotted(runs, output), runs)
    png = output.read_bytes()
    assert (int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")) == (1300, 850)


def test_report_refuses_a_directory_without_metrics(tmp_path):
    assert_user_error(run_cli("report", tmp_path), "no metrics.jsonl")

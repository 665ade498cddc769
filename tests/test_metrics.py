"""A run's metrics: the exact 100-episode window (kept in checkpoints for resume), the scalars that are
logged, and the records metrics.jsonl gets (no Ray)."""

from __future__ import annotations

import json
import statistics

from conftest import read_metrics

from rlplatform.run.metrics import EpisodeWindow, RunLogger, scalars


def test_an_empty_window_reports_only_the_count():
    window = EpisodeWindow()
    assert not window.full
    assert window.summary() == {"episodes/total": 0}
    window.add([], [])  # an iteration in which no episode finished
    assert window.summary() == {"episodes/total": 0}


def test_full_only_with_100_episodes():
    window = EpisodeWindow()
    window.add([1.0] * 60, [1] * 60)
    assert not window.full
    window.add([1.0] * 39, [1] * 39)
    assert not window.full
    window.add([1.0], [1])
    assert window.full
    window.add([2.0] * 250, [2] * 250)
    assert window.full and len(window.returns) == len(window.lengths) == 100


def test_summary_is_exact_over_the_last_100_and_counts_every_episode():
    returns = [float(i) for i in range(150)]  # 0 .. 149
    lengths = [10 + i for i in range(150)]
    window = EpisodeWindow()
    for start in range(0, 150, 7):  # in iterations of 7 episodes
        window.add(returns[start:start + 7], lengths[start:start + 7])
    assert window.summary() == {
        "return/mean": statistics.mean(returns[50:]),  # 99.5: episodes 50 .. 149
        "return/min": 50.0,
        "return/max": 149.0,
        "episode/length_mean": statistics.mean(lengths[50:]),
        "episodes/total": 150,
    }


def test_a_partial_window_summarises_what_it_has():
    window = EpisodeWindow()
    window.add([10.0, 20.0, 60.0], [10, 20, 60])
    assert window.summary() == {"return/mean": 30.0, "return/min": 10.0, "return/max": 60.0,
                                "episode/length_mean": 30.0, "episodes/total": 3}


def test_state_round_trips_through_json_as_a_checkpoint_keeps_it():
    window = EpisodeWindow()
    window.add([float(i) for i in range(130)], list(range(130)))
    state = json.loads(json.dumps(window.state()))
    restored = EpisodeWindow.from_state(state)
    assert restored.summary() == window.summary() and restored.full
    assert restored.episodes_total == 130
    for w in (window, restored):  # and both go on the same way
        w.add([1000.0], [7])
    assert restored.summary() == window.summary()
    assert restored.summary()["return/max"] == 1000.0 and restored.summary()["episodes/total"] == 131


def test_from_state_of_nothing_is_an_empty_window():
    for nothing in (None, {}):
        window = EpisodeWindow.from_state(nothing)
        assert window.summary() == {"episodes/total": 0} and not window.full


def test_a_state_longer_than_the_window_keeps_its_last_100():
    window = EpisodeWindow.from_state({"returns": [float(i) for i in range(120)], "lengths": list(range(120)),
                                       "episodes_total": 500})
    assert list(window.returns) == [float(i) for i in range(20, 120)]
    assert window.summary()["episodes/total"] == 500 and window.full


def test_scalars_keep_the_named_numbers_as_floats():
    metrics = {
        "iteration": 3, "env_steps": 4000, "wall_time_s": 12.5, "timestamp": 1.7e9,  # the record's own fields
        "return/mean": 21, "time/learn_s": 0.25, "system/127.0.0.1/cpu_percent": 50,
        "episode_returns": [1.0], "note/text": "x", "eval/return_mean": None, "learner/x/list": [1, 2],
    }
    out = scalars(metrics)
    assert out == {"return/mean": 21.0, "time/learn_s": 0.25, "system/127.0.0.1/cpu_percent": 50.0}
    assert all(type(v) is float for v in out.values())


def test_the_logger_writes_one_json_record_per_iteration_keyed_by_env_steps(tmp_path):
    logger = RunLogger(tmp_path, config=None, fresh=True)
    try:
        logger.log({"iteration": 1, "env_steps": 1000, "wall_time_s": 3.0, "timestamp": 1.7e9,
                    "return/mean": 20, "time/iteration_s": 1.5, "episode_returns": [20.0], "note": "x"})
        logger.log({"iteration": 2, "env_steps": 2000.0, "wall_time_s": 4.5, "return/mean": 25.5})
    finally:
        logger.close()
    rows = read_metrics(tmp_path)
    assert rows == [
        {"iteration": 1, "env_steps": 1000, "wall_time_s": 3.0, "return/mean": 20.0, "time/iteration_s": 1.5},
        {"iteration": 2, "env_steps": 2000, "wall_time_s": 4.5, "return/mean": 25.5},
    ]
    assert type(rows[1]["env_steps"]) is int
    assert list(tmp_path.glob("events.out.tfevents.*"))


def test_a_resumed_logger_appends(tmp_path):
    for iteration in (1, 2):
        logger = RunLogger(tmp_path, fresh=iteration == 1)
        logger.log({"iteration": iteration, "env_steps": 100 * iteration, "return/mean": 1.0})
        logger.close()
    rows = read_metrics(tmp_path)
    assert [r["iteration"] for r in rows] == [1, 2]


"""The training loop's decisions, without training: the stop criteria, the stall guard, the signal flag,
the checkpoint score and when the command's wall time starts (no Ray)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
from conftest import ROOT

import rlplatform
from rlplatform.config.schema import validate
from rlplatform.errors import TrainingFailed
from rlplatform.run import loop
from rlplatform.run.loop import StallGuard, StopFlag, command_start_time, stop_reason


def stops(**stop):
    return validate({"stop": stop})


def m(iteration=1, env_steps=1000, **more):
    return {"iteration": iteration, "env_steps": env_steps, **more}


# --- stop_reason -----------------------------------------------------------------------------------------

def test_no_criterion_never_stops():
    config = stops()
    assert stop_reason(config, m(10**6, 10**9, **{"return/mean": 1e9}), window_full=True, wall_s=1e9) is None


def test_each_criterion_stops_at_its_threshold_and_not_before():
    cases = [
        (stops(env_steps=5000), lambda v: (m(env_steps=v), 0.0), 5000, "env steps 5,000 >= 5,000"),
        (stops(iterations=7), lambda v: (m(iteration=v), 0.0), 7, "iterations 7 >= 7"),
        (stops(wall_time_s=60), lambda v: (m(), float(v)), 60, "wall time 60 s >= 60 s"),
        (stops(return_mean=475), lambda v: (m(**{"return/mean": float(v)}), 0.0), 475, "return/mean 475.00 >= 475"),
    ]
    for config, metrics_at, threshold, reason in cases:
        metrics, wall = metrics_at(threshold - 1)
        assert stop_reason(config, metrics, window_full=True, wall_s=wall) is None, reason
        metrics, wall = metrics_at(threshold)
        assert stop_reason(config, metrics, window_full=True, wall_s=wall) == reason
        metrics, wall = metrics_at(threshold + 1)
        assert stop_reason(config, metrics, window_full=True, wall_s=wall) is not None, reason


def test_the_return_criterion_waits_for_a_full_window():
    config = stops(return_mean=100)
    high = m(**{"return/mean": 500.0})
    assert stop_reason(config, high, window_full=False, wall_s=0.0) is None  # a few lucky episodes are not enough
    assert stop_reason(config, high, window_full=True, wall_s=0.0) == "return/mean 500.00 >= 100"
    assert stop_reason(config, m(), window_full=True, wall_s=0.0) is None  # no episode finished yet


def test_a_negative_return_target_is_a_target_too():
    config = stops(return_mean=-200)
    assert stop_reason(config, m(**{"return/mean": -250.0}), window_full=True, wall_s=0.0) is None
    assert stop_reason(config, m(**{"return/mean": -150.5}), window_full=True, wall_s=0.0) == "return/mean -150.50 >= -200"


def test_when_several_criteria_hold_the_first_in_order_is_named():
    config = stops(return_mean=10, env_steps=100, iterations=1, wall_time_s=1)
    every = m(iteration=5, env_steps=10_000, **{"return/mean": 50.0})
    assert stop_reason(config, every, window_full=True, wall_s=10.0).startswith("return/mean")
    assert stop_reason(config, every, window_full=False, wall_s=10.0).startswith("env steps")
    assert stop_reason(config, m(iteration=5, env_steps=10), window_full=False, wall_s=10.0).startswith("iterations")
    assert stop_reason(config, m(iteration=0, env_steps=10), window_full=False, wall_s=10.0).startswith("wall time")


# --- StallGuard -------------------------------------------------------------------------------------------

@pytest.fixture
def clock(monkeypatch):
    """The loop module's time.time(), moved by hand."""
    now = SimpleNamespace(t=1000.0)
    monkeypatch.setattr(loop, "time", SimpleNamespace(time=lambda: now.t))
    return now


def test_stall_guard_fails_a_run_that_samples_nothing_for_the_timeout(clock):
    guard = StallGuard(timeout_s=30)
    guard.update(m(env_steps=0))  # the first report counts as progress, even with no steps
    clock.t += 30
    guard.update(m(env_steps=0))  # at the timeout, not yet past it
    clock.t += 0.5
    with pytest.raises(TrainingFailed, match=r"no env steps sampled for 30 s \(healthy env runners: 0.0\)"):
        guard.update(m(env_steps=0, **{"faults/healthy_env_runners": 0.0}))


def test_stall_guard_keeps_quiet_while_steps_grow_however_slowly(clock):
    guard = StallGuard(timeout_s=30)
    started = clock.t
    for step in range(1, 20):
        clock.t += 29  # each iteration takes almost the whole timeout, but brings new steps
        guard.update(m(iteration=step, env_steps=step))
    assert clock.t - started == 19 * 29 > guard.timeout_s  # many timeouts in all, none without a new step
    clock.t += 29
    guard.update(m(iteration=20, env_steps=19))  # no new step, but 29 s since the last one: still quiet
    clock.t += 1.5
    with pytest.raises(TrainingFailed):  # 30.5 s since the last new step, however long the run has gone on
        guard.update(m(iteration=21, env_steps=19))


def test_stall_guard_counts_from_the_last_new_steps_not_from_its_start(clock):
    guard = StallGuard(timeout_s=30)
    clock.t += 100  # a long first iteration (building the algorithm, a slow env) is no stall
    guard.update(m(env_steps=500))
    clock.t += 29
    guard.update(m(env_steps=500))
    clock.t += 2  # 31 s without a new step
    with pytest.raises(TrainingFailed):
        guard.update(m(env_steps=500))


def test_stall_guard_with_the_real_clock():
    """The guard reads time.time() itself. Only a lower bound on time here (the sleep lasts at least its
    length), so a loaded machine cannot fail it; staying quiet before the timeout is shown on the clock above."""
    guard = StallGuard(timeout_s=0.05)
    guard.update(m(env_steps=10))
    time.sleep(0.1)
    with pytest.raises(TrainingFailed, match="no env steps sampled"):
        guard.update(m(env_steps=10))


def test_the_default_timeout_is_five_minutes(clock):
    guard = StallGuard()
    guard.update(m(env_steps=0))
    clock.t += 300
    guard.update(m(env_steps=0))  # 5 minutes without a step: not yet
    clock.t += 0.5
    with pytest.raises(TrainingFailed, match=r"no env steps sampled for 300 s"):
        guard.update(m(env_steps=0))


# --- StopFlag ---------------------------------------------------------------------------------------------

def test_sigterm_then_sigint_set_the_reason_and_a_second_ctrl_c_aborts():
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    flag = StopFlag()
    try:
        assert flag.reason is None
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)  # the handler runs between bytecodes of this thread
        assert flag.reason == "SIGTERM"
        os.kill(os.getpid(), signal.SIGTERM)  # a second SIGTERM changes nothing
        time.sleep(0.01)
        assert flag.reason == "SIGTERM"
        with pytest.raises(KeyboardInterrupt):  # a second Ctrl-C after the first request
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.5)
    finally:
        flag.restore()
    assert {s: signal.getsignal(s) for s in before} == before


def test_a_first_ctrl_c_only_asks_to_stop():
    flag = StopFlag()
    try:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.01)
        assert flag.reason == "SIGINT"
    finally:
        flag.restore()


# --- the checkpoint score ---------------------------------------------------------------------------------

def test_checkpoints_are_scored_by_evaluation_when_there_is_one():
    assert loop._score({"return/mean": 10.0}) == 10.0
    assert loop._score({"return/mean": 10.0, "eval/return_mean": 3.0}) == 3.0
    assert loop._score({}) is None


# --- command_start_time -----------------------------------------------------------------------------------

def test_wall_time_starts_at_the_process_start_when_python_started_this_process(monkeypatch):
    monkeypatch.setattr(loop, "_process_creation_time", lambda: 500.0)
    monkeypatch.setattr(rlplatform, "IMPORTED_AT", 500.4)  # the interpreter's own start-up counts
    assert command_start_time() == 500.0
    monkeypatch.setattr(rlplatform, "IMPORTED_AT", 500.0 + loop.EXEC_GRACE_S - 0.01)
    assert command_start_time() == 500.0


def test_wall_time_starts_at_the_import_when_a_shell_execd_this_process(monkeypatch):
    monkeypatch.setattr(loop, "_process_creation_time", lambda: 500.0)
    monkeypatch.setattr(rlplatform, "IMPORTED_AT", 507.0)  # `bash -c 'sleep 7 && exec python ...'`
    assert command_start_time() == 507.0


REPORT_START = (
    "import time; first = time.time()\n"
    "import json, rlplatform\n"
    "from rlplatform.run.loop import _process_creation_time, command_start_time\n"
    "print(json.dumps({'first': first, 'created': _process_creation_time(), 'imported': rlplatform.IMPORTED_AT,"
    " 'start': command_start_time()}))\n"
)


def _start_times(command: list[str]) -> tuple[float, dict]:
    spawned = time.time()
    out = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=60, check=True).stdout
    return spawned, json.loads(out.strip().splitlines()[-1])


def test_the_process_creation_time_is_exact_to_the_tick():
    """The boot clock gives the process's age to 10 ms (psutil's create_time can be a second early)."""
    spawned, seen = _start_times([sys.executable, "-c", REPORT_START])
    assert spawned - 0.05 <= seen["created"] <= seen["first"], seen
    assert seen["start"] <= seen["imported"]


def test_a_shells_time_before_exec_is_not_the_commands():
    sleep_s = loop.EXEC_GRACE_S + 0.5
    script = f"sleep {sleep_s} && exec {sys.executable} -c \"$0\""
    spawned, seen = _start_times(["bash", "-c", script, REPORT_START])
    # The process is the shell's, created before its sleep (lower bounds only: a loaded machine makes the
    # gaps longer, never shorter; 0.05 s is the boot clock's tick and the two clocks' rounding).
    assert spawned - 0.05 <= seen["created"] and seen["first"] - seen["created"] >= sleep_s - 0.05
    assert seen["imported"] - seen["created"] >= sleep_s - 0.05
    assert seen["start"] == seen["imported"]

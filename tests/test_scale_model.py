"""The cost model's cluster fit: the driver's CPU per iteration and the runners' and relays' in parallel, from points
as `bench scale` writes them (the measuring itself is tested in test_bench.py)."""

import math

import pytest

from rlplatform.bench import scale_model

DRIVER = {"a: per iteration (s)": 0.01, "b: per runner (s)": 0.15e-3, "r: per relay (s)": 0.8e-3, "c: per env step (s)": 0.0}
RUNNER = {"u: per iteration (s)": 4e-3, "v: per env step (s)": 0.3e-3}
RELAY = {"e: per relay (s)": 2e-3, "f: per runner (s)": 0.4e-3, "g: per env step (s)": 1e-6}


def point(runners: int, fragment: int, size: int) -> dict:
    relays = math.ceil(runners / size) if 0 < size < runners else 0
    a, b, r, c = DRIVER.values()
    u, v = RUNNER.values()
    return {"runners": runners, "fragment": fragment, "envs_per_runner": 1, "learners": 1, "relays": relays,
            "runners_per_relay": size,
            "cpu_s_per_iteration": {"algorithm + local learner": a + b * runners + r * relays + c * runners * fragment,
                                    "env runner": runners * (u + v * fragment),
                                    "relay": sum(w * x for w, x in zip(RELAY.values(), (relays, runners, runners * fragment)))
                                    if relays else 0.0}}


def test_the_cluster_fit_recovers_the_costs_and_adds_the_parallel_part_once():
    points = [point(n, f, size) for n, f, size in ((8, 40, 4), (16, 40, 4), (32, 40, 4), (16, 40, 8), (32, 40, 8), (32, 160, 4))]
    points.append({**point(4, 40, 0), "learners": 0})  # a local learner's CPU would be in the driver's: not used
    model = scale_model.fit_cluster(points, wait_ms=50.0, fragments=[40, 160])
    assert "2 needed" in model["direct"]["left_out"]
    relays = model["relays"]
    assert relays["points"] == 6 and relays["measured_runners_per_relay"] == [4, 8]
    assert relays["runners_per_relay"] == 32  # extrapolated with the schema's default
    for term, value in DRIVER.items():
        assert relays["driver"]["coefficients"][term] == pytest.approx(value, abs=1e-9), term
    for term, value in RUNNER.items():
        assert relays["runner"]["coefficients"][term] == pytest.approx(value, abs=1e-9), term
    for term, value in RELAY.items():
        assert relays["relay"]["coefficients"][term] == pytest.approx(value, abs=1e-9), term
    row = scale_model.predict_cluster(relays, runners=1000, fragment=40, wait_ms=50.0)
    driver = 0.01 + 1000 * 0.15e-3 + 32 * 0.8e-3
    parallel = 2e-3 + 32 * 0.4e-3 + 32 * 40 * 1e-6 + 4e-3 + 40 * 0.3e-3  # one relay of 32 runners, one runner
    assert row["relays"] == 32
    assert row["driver_s"] == pytest.approx(driver) and row["parallel_s"] == pytest.approx(parallel)
    assert row["sync_of_ideal"] == pytest.approx(2.0 / (2.0 + driver + parallel))
    assert [(r["runners"], r["fragment"]) for r in relays["extrapolation"]] == [(256, 40), (1000, 40), (256, 160), (1000, 160)]


def test_without_relays_every_runner_is_the_drivers():
    points = [point(n, f, 0) for n, f in ((8, 40), (16, 40), (32, 40), (32, 160))]
    direct = scale_model.fit_cluster(points, wait_ms=50.0, fragments=[40])["direct"]
    assert direct["driver"]["left_out"]["r: per relay (s)"] == "the points cannot tell it apart"
    row = scale_model.predict_cluster(direct, runners=1000, fragment=40, wait_ms=50.0)
    assert row["relays"] == 0 and row["driver_s"] == pytest.approx(0.01 + 1000 * 0.15e-3)

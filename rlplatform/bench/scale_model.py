"""The cost model behind docs/scale.md, fitted to `bench scale` points: `bench scale --fit FILE [FILE ...]`.

Per synchronous (PPO) iteration with N runners of one env each, F env steps per runner and W MB of
policy weights, the time beyond the envs' own (F x wait) and the learner's is

    overhead = a + b N + c N F + d N W

    a: fixed per iteration (RLlib's bookkeeping, metrics, one ray.put of the weights)
    b: per runner (one sample request and its reply, one set_state, the connector-state round trip)
    c: per env step gathered (episodes packed, sent, unpacked, turned into a batch)
    d: per MB of weights per runner (each runner fetching and loading the broadcast weights)

b and c are told apart only by points with different fragment lengths, d only by points with different
models: where the points cannot separate a term, the fit leaves it out and says so.

That wall-clock fit is this machine's: on 2 cores the runners' own work queues for the cores with the driver's.
For a cluster, where every runner and relay has a core, `--fit` also fits the driver's own CPU per iteration
(its process's /proc time, from points measured with a remote learner, so the process does nothing else):

    driver = a + b N + r R + c N F          (R: the relay actors PPO's requests go through, 0 without)

and adds what runs in parallel: one relay's CPU (e + f n + g n F for its n runners: it makes their calls one after
another and packs their episodes; fitted as e R + f N + g N F over the relays' summed CPU) and one runner's CPU per
iteration beyond its envs' waiting (u + v F). Points with relays and points without are fitted apart: a runner
costs the driver a Ray call without relays, its metrics with them. The extrapolation puts one relay on each node
of `runners_per_relay` (32) runners, and leaves the learner out, as the wall-clock model does: with relays and one
learner, the learner fetches the episodes itself, so where it runs in the algorithm's process (`learners: 0`) their
per-step cost is still that process's.

Asynchronous algorithms (APPO, IMPALA) do not wait for the slowest runner or the learner; their limit
is the driver handling every fragment in turn: at most F / (b + c F + d W) env steps/s however many
runners there are (one weight push per fragment), and nothing in between if N F / (F wait) stays below it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from rlplatform import console
from rlplatform.bench.processes import ROLES
from rlplatform.bench.training_runs import write_json
from rlplatform.config.schema import ScaleSection
from rlplatform.errors import UserError

TERMS = ("a: per iteration (s)", "b: per runner (s)", "c: per env step (s)", "d: per MB per runner (s)")
CPU_TERMS = ("a: per iteration (s)", "b: per runner (s)", "r: per relay (s)", "c: per env step (s)")
RUNNER_TERMS = ("u: per iteration (s)", "v: per env step (s)")
RELAY_TERMS = ("e: per relay (s)", "f: per runner (s)", "g: per env step (s)")
EXTRAPOLATE_RUNNERS = (256, 1000)
EXTRAPOLATE_NODES = (16, 64)
ALGORITHM_ROLE = ROLES["AlgorithmHost"]  # the process that runs training_step


def run_fit(paths: list[Path], output: Path) -> int:
    points, wait_ms = load_points(paths)
    points = [p for p in points if not p.get("asynchronous")]  # the model is the synchronous iteration's
    if len(points) < 2:
        raise UserError("--fit needs at least two measured points of a synchronous algorithm (PPO)")
    direct = [p for p in points if not p.get("relays")]
    model = fit(direct if len(direct) >= 2 else points)  # this machine's wall clock (relays hide a term from it)
    fragments = sorted({int(p["fragment"]) for p in points})
    policy_mb = sorted({min(p["policy_mb"] for p in points), max(p["policy_mb"] for p in points)})
    result = {"sources": [str(p) for p in paths], "wait_ms": wait_ms, "points": len(points), **model,
              "extrapolation": [row for f in dict.fromkeys([fragments[0], fragments[-1]])
                                for row in extrapolate(model, wait_ms, fragment=f, policy_mb=policy_mb)],
              "cluster": fit_cluster(points, wait_ms, fragments)}
    output.mkdir(parents=True, exist_ok=True)
    path = write_json(output / "scale-fit.json", result)
    print_fit(result)
    print_cluster(result["cluster"])
    console.say(f"written: {path}")
    return 0


def load_points(paths: list[Path]) -> tuple[list[dict[str, Any]], float]:
    points, waits = [], set()
    for path in paths:
        try:
            data = json.loads(path.read_text())
            waits.add(float(data["wait_ms"]))
            points += [p for p in data["points"] if not p.get("error")]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise UserError(f"--fit: {path} is not a bench scale result ({type(exc).__name__}: {exc})") from None
    if len(waits) != 1:
        raise UserError(f"--fit: the files measured different wait_ms ({', '.join(f'{w:g}' for w in sorted(waits))}); fit one at a time")
    if len(points) < 2:
        raise UserError("--fit needs at least two measured points")
    return points, waits.pop()


def overhead_s(point: dict[str, Any]) -> float:
    """An iteration's time beyond the envs' own and the learner's."""
    return point["iteration_s"] - point["env_time_s"] - (point["learn_s"] or 0.0)


def fit(points: list[dict[str, Any]]) -> dict[str, Any]:
    """The wall-clock model: least squares over the terms the points can tell apart."""
    columns = [[1.0 for _ in points], [p["runners"] for p in points], [_env_steps(p) for p in points],
               [p["runners"] * p["policy_mb"] for p in points]]
    model = least_squares(columns, [overhead_s(p) for p in points], TERMS)
    model["fitted"] = [{"runners": p["runners"], "fragment": p["fragment"], "model": p["model"],
                        "measured_overhead_s": m, "model_overhead_s": f}
                       for p, m, f in zip(points, model.pop("measured"), model.pop("predicted"))]
    return model


def _env_steps(point: dict[str, Any]) -> float:
    return point["runners"] * point["fragment"] * point["envs_per_runner"]


def least_squares(columns: list[list[float]], observed: list[float], terms: tuple[str, ...]) -> dict[str, Any]:
    """Least squares over the terms (the first one fixed) the points can tell apart; a term fitted below zero is
    left out."""
    import numpy as np

    y = np.array(observed)
    n = len(terms)
    active: list[int] = []
    for i in range(n):
        if _varies_apart([columns[j] for j in active], columns[i]):
            active.append(i)
    reasons = {i: "the points cannot tell it apart" for i in range(n) if i not in active}
    while True:
        x = np.array([columns[i] for i in active]).T
        coef, *_ = np.linalg.lstsq(x, y, rcond=None)
        negative = [i for i, c in zip(active, coef) if c < 0 and i != 0]
        if not negative:
            break
        active.remove(negative[0])
        reasons[negative[0]] = "fitted below zero: smaller than the noise"
    values = dict.fromkeys(range(n), 0.0)
    values.update(zip(active, map(float, coef)))
    predicted = x @ coef
    residual = float(np.sqrt(np.mean((predicted - y) ** 2)))
    return {"coefficients": {terms[i]: values[i] for i in range(n)}, "left_out": {terms[i]: r for i, r in reasons.items()},
            "rms_residual_s": residual, "measured": [float(v) for v in y], "predicted": [float(v) for v in predicted]}


def fit_cluster(points: list[dict[str, Any]], wait_ms: float, fragments: list[int]) -> dict[str, Any]:
    """The cluster model (the module's text), per sampling path that has at least two points measured with a
    remote learner and their processes' CPU."""
    usable = [p for p in points if p.get("learners") and ALGORITHM_ROLE in (p.get("cpu_s_per_iteration") or {})]
    paths: dict[str, Any] = {}
    for name, members in (("direct", [p for p in usable if not p.get("relays")]),
                          ("relays", [p for p in usable if p.get("relays")])):
        if len(members) < 2:
            paths[name] = {"left_out": f"{len(members)} point(s) measured with a remote learner and CPU per role (2 needed)"}
            continue
        paths[name] = _cluster_path(members, wait_ms, fragments)
    return paths


def _cluster_path(points: list[dict[str, Any]], wait_ms: float, fragments: list[int]) -> dict[str, Any]:
    cpu = [p["cpu_s_per_iteration"] for p in points]
    driver = least_squares([[1.0 for _ in points], [p["runners"] for p in points], [p.get("relays", 0) for p in points],
                            [_env_steps(p) for p in points]], [c[ALGORITHM_ROLE] for c in cpu], CPU_TERMS)
    runner = least_squares([[1.0 for _ in points], [p["fragment"] * p["envs_per_runner"] for p in points]],
                           [c.get("env runner", 0.0) / p["runners"] for p, c in zip(points, cpu)], RUNNER_TERMS)
    relayed = [(p, c) for p, c in zip(points, cpu) if p.get("relays")]
    relay = (least_squares([[p["relays"] for p, _ in relayed], [p["runners"] for p, _ in relayed],
                            [_env_steps(p) for p, _ in relayed]], [c.get("relay", 0.0) for _, c in relayed], RELAY_TERMS)
             if relayed else {"coefficients": dict.fromkeys(RELAY_TERMS, 0.0)})
    model = {"points": len(points), "driver": _without_series(driver), "runner": _without_series(runner),
             "relay": _without_series(relay),
             "measured_runners_per_relay": sorted({p["runners_per_relay"] for p, _ in relayed}),
             # extrapolated with the experiment schema's default: what a run on a cluster uses
             "runners_per_relay": ScaleSection.model_fields["runners_per_relay"].default if relayed else 0}
    model["extrapolation"] = [predict_cluster(model, n, f, wait_ms) for f in dict.fromkeys([fragments[0], fragments[-1]])
                              for n in EXTRAPOLATE_RUNNERS]
    return model


def _without_series(model: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in model.items() if k not in ("measured", "predicted")}


def predict_cluster(model: dict[str, Any], runners: int, fragment: int, wait_ms: float, envs_per_runner: int = 1) -> dict[str, Any]:
    """One synchronous iteration at `runners` with cores of their own: the driver's CPU in series, then the slowest
    relay's calls and one runner's own work."""
    import math

    a, b, r, c = (model["driver"]["coefficients"][t] for t in CPU_TERMS)
    u, v = (model["runner"]["coefficients"][t] for t in RUNNER_TERMS)
    e, f, g = (model["relay"]["coefficients"][t] for t in RELAY_TERMS)
    size = model["runners_per_relay"]
    relays = math.ceil(runners / size) if 0 < size < runners else 0
    steps = fragment * envs_per_runner
    driver = a + b * runners + r * relays + c * runners * steps
    per_relay = min(runners, size)
    parallel = (e + f * per_relay + g * per_relay * steps if relays else 0.0) + u + v * steps
    env_time = fragment * wait_ms / 1000.0
    return {"runners": runners, "fragment": fragment, "relays": relays, "driver_s": driver, "parallel_s": parallel,
            "sync_of_ideal": env_time / (env_time + driver + parallel)}


def _varies_apart(kept: list[list[float]], column: list[float]) -> bool:
    """The column adds information to the columns kept before it (it is not a combination of them); the first one is
    always kept."""
    import numpy as np

    if not kept:
        return True
    return bool(np.linalg.matrix_rank(np.array([*kept, column]).T) == len(kept) + 1)


def predict(coefficients: dict[str, float], runners: int, fragment: int, policy_mb: float) -> float:
    a, b, c, d = (coefficients[t] for t in TERMS)
    return a + b * runners + c * runners * fragment + d * runners * policy_mb


def extrapolate(model: dict[str, Any], wait_ms: float, fragment: int, policy_mb: list[float]) -> list[dict[str, Any]]:
    """What the model says for many runners: the synchronous iteration's share of ideal (learning apart) and
    the asynchronous driver's ceiling. Nodes only divide the runners: every cost here is the driver's."""
    coefficients = model["coefficients"]
    env_time = fragment * wait_ms / 1000.0
    rows = []
    for mb in sorted(set(policy_mb)):
        for n in EXTRAPOLATE_RUNNERS:
            overhead = predict(coefficients, n, fragment, mb)
            per_fragment = predict({**coefficients, TERMS[0]: 0.0}, 1, fragment, mb)
            ideal = n * 1000.0 / wait_ms
            ceiling = fragment / per_fragment if per_fragment > 0 else None
            rows.append({"runners": n, "runners_per_node": [n / k for k in EXTRAPOLATE_NODES], "policy_mb": mb, "fragment": fragment,
                         "ideal_env_steps_per_s": ideal, "sync_overhead_s": overhead,
                         "sync_of_ideal": env_time / (env_time + overhead),
                         "async_driver_ceiling_env_steps_per_s": ceiling,
                         "async_of_ideal": min(1.0, ceiling / ideal) if ceiling else None})
    return rows


def print_fit(result: dict[str, Any]) -> None:
    from rich.table import Table

    for term, value in result["coefficients"].items():
        why = result["left_out"].get(term)
        console.say(f"{term}: {value * 1000:.3f} ms" + (f" (left out: {why})" if why else ""))
    console.say(f"rms residual over {result['points']} points: {result['rms_residual_s'] * 1000:.1f} ms per iteration")
    table = Table(title=f"extrapolation, {result['wait_ms']:g} ms per env step (learning apart)")
    for column in ("runners", "weights MB", "fragment", "ideal steps/s", "PPO overhead s/it", "PPO of ideal",
                   "async driver ceiling steps/s", "async of ideal"):
        table.add_column(column, justify="right")
    for r in result["extrapolation"]:
        table.add_row(str(r["runners"]), f"{r['policy_mb']:.2f}", str(r["fragment"]), f"{r['ideal_env_steps_per_s']:,.0f}",
                      f"{r['sync_overhead_s']:.2f}", f"{r['sync_of_ideal']:.0%}", _fmt(r["async_driver_ceiling_env_steps_per_s"]),
                      "-" if r["async_of_ideal"] is None else f"{r['async_of_ideal']:.0%}")
    console.stdout.print(table)


def _fmt(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:,.0f}"


def print_cluster(cluster: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="cluster model: the driver's CPU in series, relays and runners on cores of their own (learning apart)")
    for column in ("path", "driver a ms", "b ms/runner", "r ms/relay", "c us/step", "relay e ms + f ms/runner + g us/step",
                   "runner u ms + v us/step",
                   "runners", "fragment", "relays", "driver s", "parallel s", "PPO of ideal"):
        table.add_column(column, justify="right")
    for name, path in cluster.items():
        if "extrapolation" not in path:
            console.say(f"cluster model, {name}: left out: {path['left_out']}")
            continue
        a, b, r, c = (path["driver"]["coefficients"][t] for t in CPU_TERMS)
        u, v = (path["runner"]["coefficients"][t] for t in RUNNER_TERMS)
        e, f, g = (path["relay"]["coefficients"][t] for t in RELAY_TERMS)
        for row in path["extrapolation"]:
            table.add_row(name, f"{a * 1e3:.1f}", f"{b * 1e3:.3f}", f"{r * 1e3:.2f}", f"{c * 1e6:.2f}",
                          f"{e * 1e3:.1f} + {f * 1e3:.2f} + {g * 1e6:.1f}", f"{u * 1e3:.1f} + {v * 1e6:.0f}", str(row["runners"]),
                          str(row["fragment"]), str(row["relays"]), f"{row['driver_s']:.3f}", f"{row['parallel_s']:.3f}",
                          f"{row['sync_of_ideal']:.0%}")
    # Piped into a file, rich would squeeze the columns into 80 characters.
    (console.stdout if console.stdout.is_terminal else Console(highlight=False, width=170)).print(table)

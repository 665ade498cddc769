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

Asynchronous algorithms (APPO, IMPALA) do not wait for the slowest runner or the learner; their limit
is the driver handling every fragment in turn: at most F / (b + c F + d W) env steps/s however many
runners there are (one weight push per fragment), and nothing in between if N F / (F wait) stays below it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from rlplatform import console
from rlplatform.bench.training_runs import write_json
from rlplatform.errors import UserError

TERMS = ("a: per iteration (s)", "b: per runner (s)", "c: per env step (s)", "d: per MB per runner (s)")
EXTRAPOLATE_RUNNERS = (256, 1000)
EXTRAPOLATE_NODES = (16, 64)


def run_fit(paths: list[Path], output: Path) -> int:
    points, wait_ms = load_points(paths)
    points = [p for p in points if not p.get("asynchronous")]  # the model is the synchronous iteration's
    if len(points) < 2:
        raise UserError("--fit needs at least two measured points of a synchronous algorithm (PPO)")
    model = fit(points)
    fragments = sorted({int(p["fragment"]) for p in points})
    policy_mb = sorted({min(p["policy_mb"] for p in points), max(p["policy_mb"] for p in points)})
    result = {"sources": [str(p) for p in paths], "wait_ms": wait_ms, "points": len(points), **model,
              "extrapolation": [row for f in dict.fromkeys([fragments[0], fragments[-1]])
                                for row in extrapolate(model, wait_ms, fragment=f, policy_mb=policy_mb)]}
    output.mkdir(parents=True, exist_ok=True)
    path = write_json(output / "scale-fit.json", result)
    print_fit(result)
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
    """Least squares over the terms the points can tell apart; a term fitted below zero is left out."""
    import numpy as np

    columns = [[1.0 for _ in points], [p["runners"] for p in points],
               [p["runners"] * p["fragment"] * p["envs_per_runner"] for p in points],
               [p["runners"] * p["policy_mb"] for p in points]]
    y = np.array([overhead_s(p) for p in points])
    active = [i for i in range(4) if _varies_apart(columns, i)]
    reasons = {i: "the points cannot tell it apart" for i in range(4) if i not in active}
    while True:
        x = np.array([columns[i] for i in active]).T
        coef, *_ = np.linalg.lstsq(x, y, rcond=None)
        negative = [i for i, c in zip(active, coef) if c < 0 and i != 0]
        if not negative:
            break
        active.remove(negative[0])
        reasons[negative[0]] = "fitted below zero: smaller than the noise"
    values = dict.fromkeys(range(4), 0.0)
    values.update(zip(active, map(float, coef)))
    predicted = x @ coef
    residual = float(np.sqrt(np.mean((predicted - y) ** 2)))
    return {"coefficients": {TERMS[i]: values[i] for i in range(4)}, "left_out": {TERMS[i]: r for i, r in reasons.items()}, "rms_residual_s": residual,
            "fitted": [{"runners": p["runners"], "fragment": p["fragment"], "model": p["model"],
                        "measured_overhead_s": float(m), "model_overhead_s": float(f)} for p, m, f in zip(points, y, predicted)]}


def _varies_apart(columns: list[list[float]], i: int) -> bool:
    """Column i adds information to the columns before it (its values are not a multiple of one of them)."""
    import numpy as np

    if i == 0:
        return True
    x = np.array(columns[: i + 1]).T
    return np.linalg.matrix_rank(x) == i + 1


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

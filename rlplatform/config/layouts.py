"""The best sampling layout `bench throughput` measured, per machine and env, for `--profile auto`.

`bench throughput` records the fastest layout (env runners x envs per runner x vectorisation) it
measured; `train --profile auto` on the same machine then uses the envs per runner and vectorisation
of the best layout whose runner count fits what it sized, where the experiment leaves them open (its
file, its profile and --set give neither): how many envs share a batch is part of an on-policy
experiment's tuning (CartPole PPO with 8 envs solves in 62-68k env steps; with the 64 that sample
fastest here, in 79-101k), so a value the experiment gives stays. The file
is `~/.cache/rlplatform/layouts.json` (or `$RLPLATFORM_CACHE_DIR/layouts.json`), one entry per
machine (host name, CPU count and model, GPU count) and env (id and env_config).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
from pathlib import Path
from typing import Any, Optional

from rlplatform.config.schema import ExperimentConfig

CACHE_ENV = "RLPLATFORM_CACHE_DIR"


def cache_root() -> Path:
    """Where rlplatform keeps what it measured or converted on this machine (layouts, Minari conversions)."""
    return Path(os.environ[CACHE_ENV]) if os.environ.get(CACHE_ENV) else Path.home() / ".cache" / "rlplatform"


def cache_file() -> Path:
    return cache_root() / "layouts.json"


def machine_key(cpus: float, gpus: float) -> str:
    return f"{platform.node()}|{cpus:g} CPUs|{_cpu_model()}|{gpus:g} GPUs"


def env_key(env: str, env_config: dict[str, Any]) -> str:
    digest = hashlib.sha1(json.dumps(_string_keys(env_config), sort_keys=True, default=str).encode()).hexdigest()[:10]
    return f"{env}|{digest}"


def _string_keys(value: Any) -> Any:
    """Mappings with keys of mixed types (YAML allows `{1: a, b: c}`) cannot be sorted as they are."""
    if isinstance(value, dict):
        return {str(k): _string_keys(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_string_keys(v) for v in value]
    return value


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _read() -> dict[str, Any]:
    try:
        data = json.loads(cache_file().read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def record(cpus: float, gpus: float, env: str, env_config: dict[str, Any], rows: list[dict[str, Any]], source: Path) -> Path:
    """Keep the measured rows of `bench throughput` (env_runners, envs_per_runner, vectorize, env_steps_per_s)."""
    path = cache_file()
    data = _read()
    data.setdefault(machine_key(cpus, gpus), {})[env_key(env, env_config)] = {
        "rows": [{k: row[k] for k in ("env_runners", "envs_per_runner", "vectorize", "env_steps_per_s")} for row in rows],
        "measured_by": str(source.resolve()),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    tmp.replace(path)
    return path


def best_layout(cpus: float, gpus: float, env: str, env_config: dict[str, Any], max_runners: int) -> Optional[dict[str, Any]]:
    """The measured layout with the most env steps/s per runner among those with at most `max_runners`."""
    entry = _read().get(machine_key(cpus, gpus), {}).get(env_key(env, env_config))
    rows = [r for r in (entry or {}).get("rows", []) if isinstance(r, dict) and r.get("env_runners", 0) <= max(1, max_runners)]
    if not rows:
        return None
    return max(rows, key=lambda r: r["env_steps_per_s"] / r["env_runners"])


def apply_best_layout(config: ExperimentConfig, cpus: float, gpus: float,
                      given_keys: set[str]) -> tuple[ExperimentConfig, Optional[str]]:
    """`--profile auto`: envs per runner and vectorisation from the best measured layout, if any, where
    `given_keys` (what the experiment's file, profile and --set give) leave them open (for sampling in
    the main process, the best one-runner layout: the same runner, the same envs).

    Returns the config and a line saying what was taken (None when nothing was cached).
    """
    scale = config.scale
    if config.multi_agent is not None:
        return config, None
    best = best_layout(cpus, gpus, config.env, dict(config.env_config), scale.env_runners)
    if best is None:
        return config, None
    chosen = {k: best[k] for k in ("envs_per_runner", "vectorize") if f"scale.{k}" not in given_keys}
    if not chosen:
        return config, None
    updated = config.model_copy(update={"scale": scale.model_copy(update=chosen)})
    note = (f"layout from `bench throughput` on this machine: {best['envs_per_runner']} envs per runner, {best['vectorize']} "
            f"({best['env_steps_per_s'] / best['env_runners']:,.0f} env steps/s per runner measured; {cache_file()})")
    return type(config).model_validate(updated.model_dump()), note

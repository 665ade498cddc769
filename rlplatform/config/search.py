"""The experiment file's `search:` section: what `rlplatform tune` varies, how it judges trials, how it schedules them.

Validated with the rest of the experiment (schema.py holds it as `ExperimentConfig.search`); Ray is not imported
here. Whether each key of `space` is a key the experiment takes is checked in `run/sweep.py`, by applying its
values to the experiment through the `--set` machinery, before Ray starts.
"""

from __future__ import annotations

import math
import re
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

from rlplatform.errors import did_you_mean

# The tags a sweep may optimise: what every run logs each iteration (adapter/results.py, run/metrics.py), plus the
# per-module learner statistics (`learner/<module>/<name>`) and per-policy returns (`return/<policy>/mean`).
METRIC_TAGS = (
    "return/mean", "return/min", "return/max", "episode/length_mean", "episodes/total",
    "eval/return_mean", "eval/episode_length_mean",
    "throughput/env_steps_sampled_per_s", "throughput/env_steps_trained_per_s",
    "time/iteration_s", "time/sample_s", "time/learn_s",
)
_METRIC_PATTERNS = (re.compile(r"learner/[^/]+/[A-Za-z0-9_]+"), re.compile(r"return/[^/]+/mean"))

# name -> what its argument is; the Tune sampler of the same name builds it (run/sweep.py).
DISTRIBUTIONS = {
    "choice": "a non-empty list of values",
    "uniform": "[low, high]",
    "loguniform": "[low, high], both > 0",
    "randint": "[low, high] (integers, high exclusive)",
}


Distribution = Annotated[Any, AfterValidator(lambda value: check_distribution(value))]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def check_distribution(value: Any) -> dict[str, Any]:
    """`{loguniform: [1e-4, 3e-3]}` and the like; raises ValueError saying what is wrong."""
    if not isinstance(value, dict) or len(value) != 1:
        raise ValueError(f"must be one distribution, e.g. {{loguniform: [1.0e-4, 3.0e-3]}} or {{choice: [5, 10]}}; "
                         f"known: {', '.join(DISTRIBUTIONS)}")
    (name, args), = value.items()
    if name not in DISTRIBUTIONS:
        raise ValueError(f"unknown distribution {name!r}{did_you_mean(str(name), DISTRIBUTIONS)}; known: {', '.join(DISTRIBUTIONS)}")
    if name == "choice":
        if not isinstance(args, list) or not args:
            raise ValueError("choice needs a non-empty list of values")
        return {name: args}
    if not isinstance(args, list) or len(args) != 2 or not all(_is_number(a) for a in args):
        raise ValueError(f"{name} needs {DISTRIBUTIONS[name]}")
    low, high = args
    if name == "randint" and not all(isinstance(a, int) for a in args):
        raise ValueError(f"randint needs {DISTRIBUTIONS[name]}")
    if not low < high:
        raise ValueError(f"{name}: low {low!r} must be below high {high!r}")
    if name == "loguniform" and low <= 0:
        raise ValueError(f"loguniform: low {low!r} must be > 0")
    return {name: [low, high]}


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def is_metric_tag(name: str) -> bool:
    return name in METRIC_TAGS or any(p.fullmatch(name) for p in _METRIC_PATTERNS)


class AshaSection(_Section):
    grace_period: int = Field(1, ge=1)  # iterations every trial gets before it can be stopped
    reduction_factor: float = Field(2, gt=1, allow_inf_nan=False)  # 1 in this many goes on at each rung
    max_t: Optional[int] = Field(None, ge=1)  # iterations at most; default: stop.iterations, else 1000


class PbtSection(_Section):
    interval: int = Field(5, ge=1)  # iterations between perturbations
    mutations: dict[str, Distribution] = Field(default_factory=dict)  # key -> distribution to resample from
    quantile_fraction: float = Field(0.25, gt=0, le=0.5)  # the bottom fraction copies the top fraction
    resample_probability: float = Field(0.25, ge=0, le=1)
    synchronous: bool = False  # wait for every trial to reach the perturbation point



class SearchSection(_Section):
    space: dict[str, Distribution] = Field(default_factory=dict)  # dotted experiment key -> distribution
    metric: str = "return/mean"
    mode: Literal["max", "min"] = "max"
    samples: int = Field(8, ge=1, le=100_000)  # trials (with grid: repeats of the whole grid)
    scheduler: Literal["fifo", "asha", "pbt"] = "fifo"
    searcher: Literal["random", "grid", "optuna"] = "random"
    concurrent: Union[Literal["auto"], int] = "auto"  # trials at once; auto: as many as the cluster holds
    asha: AshaSection = Field(default_factory=AshaSection)
    pbt: PbtSection = Field(default_factory=PbtSection)

    @field_validator("metric")
    @classmethod
    def _stable_tag(cls, value: str) -> str:
        if not is_metric_tag(value):
            raise ValueError(f"not one of our metric tags{did_you_mean(value, METRIC_TAGS)}; "
                             f"known: {', '.join(METRIC_TAGS)}, learner/<module>/<stat>")
        return value

    @field_validator("concurrent")
    @classmethod
    def _positive(cls, value: Union[str, int]) -> Union[str, int]:
        if isinstance(value, int) and value < 1:
            raise ValueError("must be a positive number of trials or 'auto'")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> "SearchSection":
        if self.searcher == "grid":
            ranged = [k for k, d in self.space.items() if "choice" not in d]
            if ranged:
                raise ValueError(f"searcher grid takes only choice distributions; space.{ranged[0]} is not one")
        if self.scheduler == "pbt":
            if not self.pbt.mutations:
                raise ValueError("scheduler pbt needs pbt.mutations (the keys it perturbs)")
            if self.searcher == "optuna":
                raise ValueError("scheduler pbt changes a trial's parameters while it runs; use searcher random or grid")
        if not self.space and not (self.scheduler == "pbt" and self.pbt.mutations):
            raise ValueError("space is empty: name at least one key to search")
        return self

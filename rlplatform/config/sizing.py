"""Fit an experiment to a cluster: what the cluster offers, `--profile auto`'s sizing, and the pre-flight
check that refuses, before anything starts, a request the cluster can never schedule."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

from rlplatform.config.schema import (
    AGGREGATOR_ALGORITHMS,
    ASYNCHRONOUS_ALGORITHMS,
    ExperimentConfig,
    HardwareSection,
    ScaleSection,
)
from rlplatform.errors import UserError


@dataclass
class Resources:
    """What the Ray cluster offers: totals and each node's share."""

    cpus: float
    gpus: float
    nodes: list[dict[str, float]] = field(default_factory=list)

    def describe(self) -> str:
        return f"{self.cpus:g} CPUs, {self.gpus:g} GPUs on {len(self.nodes)} node(s)"


def size_to_cluster(config: ExperimentConfig, resources: Resources, explicit_keys: set[str]) -> ExperimentConfig:
    """`--profile auto`: a GPU learner when there is a GPU, one learner per GPU when there are
    several, env runners over the CPUs left (none, sampling in the main process, where only one
    would fit and the algorithm is synchronous) after the main process, the learners and any
    aggregator actors; one aggregator per remote APPO/IMPALA learner where the CPUs allow. Keys given with
    --set are left as they are."""
    scale = config.scale.model_copy()
    hardware = config.hardware.model_copy()

    def choose(section: ScaleSection | HardwareSection, key: str, value: float) -> None:
        if f"{'scale' if section is scale else 'hardware'}.{key}" not in explicit_keys:
            setattr(section, key, value)

    gpus = int(resources.gpus)
    if gpus >= 2:
        choose(scale, "learners", gpus)
        choose(hardware, "gpus_per_learner", 1)
    elif gpus == 1:
        choose(scale, "learners", 0)
        choose(hardware, "gpus_per_learner", 1)
    learner_cpus = learner_cpu_demand(scale.learners, hardware.cpus_per_learner, hardware.gpus_per_learner, hardware.driver_cpus)
    if (config.algorithm in AGGREGATOR_ALGORITHMS and scale.learners >= 1 and not scale.aggregators_per_learner
            and resources.cpus - learner_cpus >= SPARE_CPUS_PER_AGGREGATOR * scale.learners):
        # docs/scale.md, cost model v2: an aggregator (1.6 us per env step) takes the learner connector off a remote
        # learner; worth its core where the runners keep the other cores.
        choose(scale, "aggregators_per_learner", 1)
    free = resources.cpus - learner_cpus - aggregator_cpu_demand(scale.learners, scale.aggregators_per_learner)
    if hardware.cpus_per_env_runner > 0:
        runners = max(0, math.floor(free / hardware.cpus_per_env_runner + 1e-9))
        if runners == 1 and scale.learners == 0 and config.algorithm not in ASYNCHRONOUS_ALGORITHMS:
            # A synchronous algorithm samples, then learns: a single remote runner would wait while the
            # learner works, and the learner while it samples. Sampling in the main process is as fast
            # and saves a process start (seconds) and a copy of every batch.
            runners = 0
        choose(scale, "env_runners", runners)
    sized = config.model_copy(update={"scale": scale, "hardware": hardware})
    return ExperimentConfig.model_validate(sized.model_dump())


# `--profile auto` gives each remote APPO/IMPALA learner one aggregator where this many CPUs per learner are left
# after the main process and the learners (the aggregator takes one of them).
SPARE_CPUS_PER_AGGREGATOR = 4


def learner_cpu_demand(learners: int, cpus_per_learner: float, gpus_per_learner: float, driver_cpus: float) -> float:
    """CPUs taken by the main process and the learners (RLlib's own bundle rule)."""
    if learners == 0:
        # The learner lives in the main process; RLlib gives a GPU learner no CPU of its own.
        return max(driver_cpus, 0 if gpus_per_learner else cpus_per_learner)
    return driver_cpus + learners * cpus_per_learner


def aggregator_cpu_demand(learners: int, aggregators_per_learner: int) -> float:
    """CPUs taken by APPO/IMPALA's aggregator actors: RLlib starts max(learners, 1) x aggregators_per_learner, 1 CPU each."""
    return float(max(learners, 1) * aggregators_per_learner)


def preflight(bundles: list[dict[str, float]], resources: Resources) -> None:
    """Refuse, with the missing resource named, a request the cluster can never schedule."""
    for kind, have in (("CPU", resources.cpus), ("GPU", resources.gpus)):
        need = sum(b.get(kind, 0.0) for b in bundles)
        if need > have + 1e-9:
            raise UserError(
                f"the run needs {need:g} {kind}s ({_breakdown(bundles, kind)}) but the cluster has {have:g} "
                f"({resources.describe()}); lower scale/hardware or use --profile auto"
            )
    for bundle in bundles:
        if not any(all(node.get(k, 0.0) + 1e-9 >= v for k, v in bundle.items() if k in ("CPU", "GPU")) for node in resources.nodes):
            raise UserError(f"no node can hold a bundle of {_format_bundle(bundle)} ({resources.describe()})")


def _breakdown(bundles: list[dict[str, float]], kind: str) -> str:
    """`1 main process + 64 actors x 1`: the main process, then the env runners and learners grouped by size."""
    sizes = Counter(b.get(kind, 0.0) for b in bundles[1:] if b.get(kind, 0.0))
    return " + ".join([f"{bundles[0].get(kind, 0.0):g} main process"] + [f"{n} actors x {v:g}" for v, n in sizes.items()])


def _format_bundle(bundle: dict[str, float]) -> str:
    return ", ".join(f"{v:g} {k}" for k, v in bundle.items() if k in ("CPU", "GPU"))

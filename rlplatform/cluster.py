"""Ray: a private local instance or an existing cluster, its resources, sizing and pre-flight.

A run without `--address` starts its own Ray instance (`address="local"`), so it never
joins a cluster that `ray start` left on the host. Token authentication stays on.
"""

from __future__ import annotations

import contextlib
import logging
from collections import Counter
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional

from rlplatform.config import ASYNCHRONOUS_ALGORITHMS, ExperimentConfig
from rlplatform.errors import UserError

TOKEN_FILE = Path.home() / ".ray" / "auth_token"


@dataclass
class Resources:
    """What the Ray cluster offers: totals and each node's share."""

    cpus: float
    gpus: float
    nodes: list[dict[str, float]] = field(default_factory=list)

    def describe(self) -> str:
        return f"{self.cpus:g} CPUs, {self.gpus:g} GPUs on {len(self.nodes)} node(s)"


def local_resources() -> Resources:
    """What a private local instance on this machine will have, known before Ray starts."""
    cpus = float(len(os.sched_getaffinity(0)))
    gpus = float(_local_gpu_count())
    return Resources(cpus=cpus, gpus=gpus, nodes=[{"CPU": cpus, "GPU": gpus}])


def _local_gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def use_token_auth_for_address() -> None:
    """A driver joining a cluster by explicit address sends the token only in token mode, and Ray
    reads the mode when it is imported: call before `import ray`."""
    if TOKEN_FILE.is_file() or os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH"):
        os.environ.setdefault("RAY_AUTH_MODE", "token")


# The raylet connects to its own object store over a socket and retries after
# `raylet_client_connect_timeout_milliseconds` (1000) when the store thread is not listening yet:
# measured here, half of all local starts lost exactly 1 s to that race. Retry every 100 ms
# instead, as often over the same 10 s as before (workers connecting to the raylet use both too).
FAST_LOCAL_START = {"raylet_client_connect_timeout_milliseconds": 100, "raylet_client_num_connect_attempts": 100}
# Every actor call's task events go to the GCS, which keeps up to 100k of them for the state API
# (`ray list tasks`) and the dashboard: measured here, the GCS grew 5 MB a minute in a CartPole run
# (58 -> 150 MB in 20 minutes, still rising). A private local instance has no dashboard head, the
# state API's only way in, so nothing could ever read them: workers do not record them.
NO_TASK_EVENTS = {"task_events_report_interval_ms": 0}


def connect(address: Optional[str], resources: Optional[Resources] = None, prestart_workers: bool = True) -> Resources:
    """Start a private local Ray instance (address None) or join the cluster at `address`.

    `prestart_workers=False` when the run will start no tasks or actors (the whole algorithm in
    the driver): Ray would otherwise start one idle worker process per CPU beside the driver.
    """
    import ray

    os.environ.setdefault("RAY_DEDUP_LOGS", "1")
    common = dict(logging_level=logging.ERROR, log_to_driver=False, configure_logging=True)
    if address is None:
        resources = resources or local_resources()
        with _lean_local_node():
            ray.init(
                address="local",
                num_cpus=int(resources.cpus),
                num_gpus=int(resources.gpus),
                include_dashboard=False,
                _system_config={**FAST_LOCAL_START, **NO_TASK_EVENTS, "prestart_worker_first_driver": prestart_workers},
                **common,
            )
    else:
        try:
            ray.init(address=address, **common)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            raise UserError(f"cannot connect to the Ray cluster at {address!r}: {str(exc).splitlines()[0]}") from None
    return cluster_resources()


@contextlib.contextmanager
def _lean_local_node() -> Iterator[None]:
    """While `ray.init` builds a private local node, build it without three Python processes.

    `ray.init` always starts the dashboard head (with the dashboard off it serves only usage
    statistics), the autoscaler monitor (nothing to scale on one fixed node) and the log monitor
    (it streams worker output to the driver, and we pass log_to_driver=False). Each imports Ray
    on start; on 2 cores they cost 2-3 s of a 10 s start-up, and `ray.init` waits for the
    dashboard head's address. `ray.init` has no switch for them, but builds its node from
    `ray._private.node.Node` (ray 2.60.0, pinned), whose RayParams have `no_monitor` and
    `include_log_monitor`: a subclass sets those and starts no API server.
    It also hands the raylet its agents' ports (AGENT_PORT_PARAMS), so that it registers with the GCS
    at once instead of after both agents have imported Ray, and tells whether the dashboard's
    packages are installed without importing them (DASHBOARD_PACKAGES).
    A cluster (`--address`, `ray start`, `ray up`) keeps all of them: the Jobs API needs the dashboard.
    """
    import ray._private.node as node_module
    import ray._private.utils as ray_utils

    original, original_dependency_check = node_module.Node, ray_utils.get_dashboard_dependency_error

    class LeanLocalNode(original):
        def __init__(self, ray_params, *args, **kwargs):
            ray_params.no_monitor = True
            ray_params.include_log_monitor = False
            for name, port in zip(AGENT_PORT_PARAMS, _free_ports(len(AGENT_PORT_PARAMS))):
                if not getattr(ray_params, name):
                    setattr(ray_params, name, port)
            super().__init__(ray_params, *args, **kwargs)

        def start_api_server(self, *, include_dashboard, raise_on_failure) -> None:
            pass

        def start_raylet(self, *args, **kwargs) -> None:
            _announce_agent_listen_port(self._session_dir, self._node_id, self._ray_params.dashboard_agent_listen_port)
            super().start_raylet(*args, **kwargs)

    node_module.Node = LeanLocalNode
    ray_utils.get_dashboard_dependency_error = dashboard_dependency_error
    try:
        yield
    finally:
        node_module.Node = original
        ray_utils.get_dashboard_dependency_error = original_dependency_check


# The top-level packages that `ray.dashboard.optional_deps` imports (ray 2.60.0). Ray decides
# whether to start the dashboard agent with `--minimal` by importing all of them in the driver,
# 0.2 s of a local start here; the agent imports them itself anyway.
DASHBOARD_PACKAGES = ("aiohttp", "aiohttp_cors", "grpc", "opencensus", "opentelemetry", "prometheus_client", "pydantic")


def dashboard_dependency_error() -> Optional[ImportError]:
    """Ray's `get_dashboard_dependency_error`, answered by finding the packages instead of importing them."""
    import importlib.util

    missing = [name for name in DASHBOARD_PACKAGES if importlib.util.find_spec(name) is None]
    return ImportError(f"No module named {missing[0]!r}") if missing else None


# The agents' ports, as RayParams name them. With a port left at 0 the agent binds one itself and
# writes it to a file in the session directory, and the raylet blocks until every such file is
# there: both agents import Ray first, which took 0.8-0.9 s of a 1.5 s `ray.init` here. Older Ray
# releases chose these ports in the driver, the same way. (The HTTP port has a fixed default, 52365.)
AGENT_PORT_PARAMS = ("metrics_agent_port", "metrics_export_port", "dashboard_agent_listen_port", "runtime_env_agent_port")


def _free_ports(count: int) -> list[int]:
    """Ports free now, all different (each socket stays bound until every port is chosen)."""
    import socket

    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for s in sockets:
            s.bind(("", 0))
        return [s.getsockname()[1] for s in sockets]


def _announce_agent_listen_port(session_dir: str, node_id: str, port: int) -> None:
    """The raylet takes no flag for the dashboard agent's HTTP port and always waits for its file:
    write that file with the port the agent is told to bind (the agent writes it again once bound)."""
    from ray._raylet import DASHBOARD_AGENT_LISTEN_PORT_NAME, persist_port

    persist_port(session_dir, node_id, DASHBOARD_AGENT_LISTEN_PORT_NAME, port)


def cluster_resources() -> Resources:
    import ray

    nodes = [
        {"CPU": float(n["Resources"].get("CPU", 0)), "GPU": float(n["Resources"].get("GPU", 0))}
        for n in ray.nodes()
        if n.get("Alive")
    ]
    totals = ray.cluster_resources()
    return Resources(cpus=float(totals.get("CPU", 0)), gpus=float(totals.get("GPU", 0)), nodes=nodes)


def size_to_cluster(config: ExperimentConfig, resources: Resources, explicit_keys: set[str]) -> ExperimentConfig:
    """`--profile auto`: a GPU learner when there is a GPU, one learner per GPU when there are
    several, env runners over the CPUs left (none, sampling in the main process, where only one
    would fit and the algorithm is synchronous). Keys given with --set are left as they are."""
    scale = config.scale.model_copy()
    hw = config.hardware.model_copy()

    def choose(section, key: str, value) -> None:
        if f"{'scale' if section is scale else 'hardware'}.{key}" not in explicit_keys:
            setattr(section, key, value)

    gpus = int(resources.gpus)
    if gpus >= 2:
        choose(scale, "learners", gpus)
        choose(hw, "gpus_per_learner", 1)
    elif gpus == 1:
        choose(scale, "learners", 0)
        choose(hw, "gpus_per_learner", 1)
    learner_cpus = learner_cpu_demand(scale.learners, hw.cpus_per_learner, hw.gpus_per_learner, hw.driver_cpus)
    free = resources.cpus - learner_cpus
    if hw.cpus_per_env_runner > 0:
        runners = max(0, math.floor(free / hw.cpus_per_env_runner + 1e-9))
        if runners == 1 and scale.learners == 0 and config.algorithm not in ASYNCHRONOUS_ALGORITHMS:
            # A synchronous algorithm samples, then learns: a single remote runner would wait while the
            # learner works, and the learner while it samples. Sampling in the main process is as fast
            # and saves a process start (seconds) and a copy of every batch.
            runners = 0
        choose(scale, "env_runners", runners)
    sized = config.model_copy(update={"scale": scale, "hardware": hw})
    return ExperimentConfig.model_validate(sized.model_dump())


def learner_cpu_demand(learners: int, cpus_per_learner: float, gpus_per_learner: float, driver_cpus: float) -> float:
    """CPUs taken by the main process and the learners (RLlib's own bundle rule)."""
    if learners == 0:
        # The learner lives in the main process; RLlib gives a GPU learner no CPU of its own.
        return max(driver_cpus, 0 if gpus_per_learner else cpus_per_learner)
    return driver_cpus + learners * cpus_per_learner


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


def shutdown() -> None:
    import ray

    if ray.is_initialized():
        ray.shutdown()

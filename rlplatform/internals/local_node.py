"""The lean local node start: a private local Ray node with fewer processes and waits, through Ray's private
API (ray 2.60.0), behind the speed-ups' switch.

`infra.local_ray.connect` uses `lean_local_node()` and `system_config()` only when
`internals.enabled(...)` says so; otherwise it calls plain `ray.init(address="local", ...)`.
"""

from __future__ import annotations

import contextlib
from typing import Any, Collection, Iterator, Optional

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


def system_config(prestart_workers: bool) -> dict[str, Any]:
    """`ray.init(_system_config=...)` for a private local instance. `prestart_workers=False` when the run
    starts no tasks or actors (the whole algorithm in the driver): Ray would otherwise start one idle
    worker process per CPU beside the driver."""
    return {**FAST_LOCAL_START, **NO_TASK_EVENTS, "prestart_worker_first_driver": prestart_workers}


def init(init_kwargs: dict[str, Any], prestart_workers: bool) -> None:
    """`ray.init(**init_kwargs)` of a private local instance, started by the lean local node start
    (`lean_local_node`, `system_config`)."""
    import ray

    with lean_local_node():
        ray.init(**init_kwargs, _system_config=system_config(prestart_workers))


@contextlib.contextmanager
def lean_local_node() -> Iterator[None]:
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

    original: Any  # a base class below: mypy takes no variable of another type as one
    original, original_dependency_check = node_module.Node, ray_utils.get_dashboard_dependency_error

    class LeanLocalNode(original):
        def __init__(self, ray_params, *args, **kwargs):
            ray_params.no_monitor = True
            ray_params.include_log_monitor = False
            unset = [name for name in AGENT_PORT_PARAMS if not getattr(ray_params, name)]
            taken = {getattr(ray_params, name) for name in AGENT_PORT_PARAMS} - {None, 0}
            for name, port in zip(unset, _free_ports(len(unset), avoid=taken)):
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


def _free_ports(count: int, avoid: Collection[int] = ()) -> list[int]:
    """Ports free now, all different and none in `avoid` (each socket stays bound until every port is
    chosen). `avoid` holds the ports already set: the HTTP agent's default 52365 is not bound until its
    agent starts, so the system may hand it out here, and Ray refuses a port given to two components."""
    import socket

    with contextlib.ExitStack() as stack:
        ports: list[int] = []
        while len(ports) < count:
            s = stack.enter_context(socket.socket())
            s.bind(("", 0))
            if s.getsockname()[1] not in avoid:
                ports.append(s.getsockname()[1])
        return ports


def _announce_agent_listen_port(session_dir: str, node_id: str, port: int) -> None:
    """The raylet takes no flag for the dashboard agent's HTTP port and always waits for its file:
    write that file with the port the agent is told to bind (the agent writes it again once bound)."""
    # ray's _raylet.pyi stub leaves out these two, which the compiled module has (ray 2.60.0).
    from ray._raylet import DASHBOARD_AGENT_LISTEN_PORT_NAME, persist_port  # type: ignore[attr-defined]

    persist_port(session_dir, node_id, DASHBOARD_AGENT_LISTEN_PORT_NAME, port)

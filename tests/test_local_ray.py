"""The private local Ray instance of a run without --address: what it starts, and that it works.

A local run starts the GCS, the raylet and its agents, but not the dashboard head, the autoscaler
monitor or the log monitor (internals.local_node.lean_local_node), and with `prestart_workers=False` no idle
workers, and its workers record no task events. The driver chooses the agents' ports, and the
agents bind them. Token authentication stays on. One real instance for the module.
"""

import psutil
import pytest
import ray
from ray._private import ray_constants

from rlplatform.config.sizing import Resources
from rlplatform.infra.local_ray import connect as connect_ray
from rlplatform.infra.local_ray import shutdown as shutdown_ray
from rlplatform.internals import local_node

pytestmark = pytest.mark.slow  # one real private Ray instance for the module

SKIPPED = (ray_constants.PROCESS_TYPE_DASHBOARD, ray_constants.PROCESS_TYPE_MONITOR, ray_constants.PROCESS_TYPE_LOG_MONITOR)


@pytest.fixture(scope="module")
def local_ray():
    node_class = ray._private.node.Node
    resources = connect_ray(None, Resources(2, 0, [{"CPU": 2, "GPU": 0}]), prestart_workers=False)
    yield resources, node_class
    shutdown_ray()


def _command_lines_of_this_session() -> list[str]:
    session = ray._private.worker._global_node.get_session_dir_path()
    command_lines = [" ".join(p.info["cmdline"] or []) for p in psutil.process_iter(["cmdline"])]
    return [line for line in command_lines if session in line]


def test_local_instance_has_the_machine_and_keeps_token_auth(local_ray):
    from ray._private.authentication.authentication_utils import is_token_auth_enabled

    resources, _ = local_ray
    assert resources.cpus == 2 and resources.gpus == 0 and len(resources.nodes) == 1
    assert is_token_auth_enabled()


def test_local_instance_starts_no_dashboard_monitor_or_log_monitor(local_ray):
    processes = set(ray._private.worker._global_node.all_processes)  # Ray's process types on this node
    assert ray_constants.PROCESS_TYPE_GCS_SERVER in processes and ray_constants.PROCESS_TYPE_RAYLET in processes
    assert not set(SKIPPED) & processes, sorted(processes)
    of_this_session = _command_lines_of_this_session()
    assert any("raylet" in line for line in of_this_session)
    for script in ("dashboard/dashboard.py", "autoscaler/_private/monitor.py", "_private/log_monitor.py"):
        assert not any(script in line for line in of_this_session), script


def test_ray_init_builds_other_nodes_from_rays_own_class_again(local_ray):
    _, node_class = local_ray
    assert ray._private.node.Node is node_class
    assert type(ray._private.worker._global_node) is not node_class  # the lean subclass built this one
    assert type(ray._private.worker._global_node).__name__ == "LeanLocalNode"


def test_tasks_and_actors_run_without_prestarted_workers(local_ray):
    @ray.remote(num_cpus=1)
    def square(x: int) -> int:
        return x * x

    @ray.remote(num_cpus=1)
    class Counter:
        def __init__(self) -> None:
            self.n = 0

        def add(self, k: int) -> int:
            self.n += k
            return self.n

    assert ray.get([square.remote(i) for i in range(4)], timeout=60) == [0, 1, 4, 9]
    counter = Counter.remote()
    assert ray.get([counter.add.remote(2), counter.add.remote(3)], timeout=60) == [2, 5]


def test_the_gcs_keeps_no_task_events_of_tasks_and_actor_calls(local_ray):
    """Workers record no task events on a private instance (internals.local_node.NO_TASK_EVENTS): with them,
    5000 actor calls grew the GCS by 19 MB (measured), by 0.2 MB without. Asked of the GCS itself, which
    keeps every recorded event (up to 100,000 tasks), rather than read off its memory, which more moves."""
    import time

    from ray._private.grpc_utils import init_grpc_channel
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

    @ray.remote(num_cpus=1)
    class Echo:
        def ping(self, x: int) -> int:
            return x

    @ray.remote(num_cpus=1)
    def square(x: int) -> int:
        return x * x

    echo = Echo.remote()
    assert ray.get([echo.ping.remote(i) for i in range(500)], timeout=60) == list(range(500))
    assert ray.get([square.remote(i) for i in range(20)], timeout=60) == [i * i for i in range(20)]
    time.sleep(2.5)  # more than one report interval (1 s by default) for events that were recorded
    channel = init_grpc_channel(ray._private.worker._global_node.gcs_address, ray_constants.GLOBAL_GRPC_OPTIONS)
    try:
        reply = gcs_service_pb2_grpc.TaskInfoGcsServiceStub(channel).GetTaskEvents(
            gcs_service_pb2.GetTaskEventsRequest(limit=10_000), timeout=30)
    finally:
        channel.close()
    assert reply.status.code == 0, reply.status
    assert reply.num_total_stored == 0 and not reply.events_by_task, (reply.num_total_stored, reply.events_by_task[:3])


def test_agents_listen_on_the_ports_the_raylet_was_given(local_ray):
    """The driver picks the agents' ports so that the raylet need not wait for them (internals.local_node.AGENT_PORT_PARAMS)."""
    import time

    node = ray._private.worker._global_node
    (registered,) = [n for n in ray.nodes() if n["NodeID"] == node.node_id]
    assert registered["MetricsAgentPort"] == node.metrics_agent_port != 0
    assert registered["RuntimeEnvAgentPort"] == node.runtime_env_agent_port != 0
    assert registered["DashboardAgentListenPort"] == node.dashboard_agent_listen_port != 0
    ports = [getattr(node._ray_params, name) for name in local_node.AGENT_PORT_PARAMS]
    assert len(set(ports)) == len(ports), ports
    expected = {
        "ray::DashboardAgent": {node.metrics_agent_port, node.metrics_export_port, node.dashboard_agent_listen_port},
        "ray::RuntimeEnvAgent": {node.runtime_env_agent_port},
    }
    raylet = psutil.Process(node.all_processes[ray_constants.PROCESS_TYPE_RAYLET][0].process.pid)
    deadline, listening = time.time() + 60, {}
    while time.time() < deadline:
        listening = {
            child.name(): {c.laddr.port for c in child.net_connections() if c.status == psutil.CONN_LISTEN}
            for child in raylet.children()
            if child.name() in expected
        }
        if all(ports <= listening.get(name, set()) for name, ports in expected.items()):
            break
        time.sleep(0.2)
    for name, ports in expected.items():
        assert ports <= listening.get(name, set()), (name, ports, listening)


def test_chosen_agent_ports_skip_the_ports_already_set(monkeypatch):
    """CI once failed to start Ray: the system handed out 52365, the HTTP agent's default port, which is
    set but not bound until the agent starts, and Ray refuses one port for two components. Here the
    system is made to offer that port first, twice."""
    import socket

    offered = iter([52365, 52365, 40001, 40002])

    class ScriptedSocket(socket.socket):
        def bind(self, address) -> None:
            self.port = next(offered)

        def getsockname(self):
            return ("0.0.0.0", self.port)

    monkeypatch.setattr(socket, "socket", ScriptedSocket)
    assert local_node._free_ports(2, avoid={52365}) == [40001, 40002]


def test_dashboard_dependency_check_finds_what_rays_own_check_imports(local_ray):
    """local_node.dashboard_dependency_error finds the packages instead of importing them; both must agree."""
    import ast
    import pathlib

    import ray.dashboard

    source = pathlib.Path(ray.dashboard.__file__).with_name("optional_deps.py").read_text()
    imported = set()
    for statement in ast.parse(source).body:
        if isinstance(statement, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in statement.names}
        elif isinstance(statement, ast.ImportFrom):
            imported.add(statement.module.split(".")[0])
    assert imported == set(local_node.DASHBOARD_PACKAGES)
    assert local_node.dashboard_dependency_error() is None
    assert ray._private.utils.get_dashboard_dependency_error() is None  # Ray's own check is back after the start
    assert ray._private.utils.get_dashboard_dependency_error is not local_node.dashboard_dependency_error
    agent_lines = [line for line in _command_lines_of_this_session() if "dashboard/agent.py" in line]
    assert agent_lines and all("--minimal" not in line for line in agent_lines)

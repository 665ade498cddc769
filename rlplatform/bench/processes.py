"""The processes of a benchmark's training run, and what each one is: the `train` process, everything below it,
and every process of the loopback nodes a benchmark starts for it (`bench soak --nodes`, `bench scale --nodes`)."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from rlplatform import console
from rlplatform.errors import TrainingFailed, UserError
from rlplatform.infra.loopback import LoopbackCluster

DEFAULT_NODE_CPUS = 2.0


def add_node_arguments(q) -> None:
    """`--nodes N` and `--node-cpus C`, one meaning in every benchmark that has them (checked by `check_nodes`)."""
    q.add_argument("--nodes", type=int, default=0, metavar="N",
                   help="run on a cluster of N Ray nodes on loopback addresses started for the benchmark: a head and N-1 "
                        "workers, N >= 2 (default: 0, a private local instance)")
    q.add_argument("--node-cpus", type=float, default=DEFAULT_NODE_CPUS, metavar="C",
                   help=f"CPUs each loopback node offers (default: {DEFAULT_NODE_CPUS:g})")


def check_nodes(args) -> None:
    """`--nodes N`, one meaning in every benchmark: N nodes in all, the head included (0: none)."""
    if args.nodes < 0 or args.nodes == 1 or args.node_cpus <= 0:
        raise UserError("--nodes must be 0 (a private local instance) or 2 or more (a head and workers), and --node-cpus > 0")


ROLES = {  # Ray's process title of an actor is "ray::<ClassName>[.method]"
    "AlgorithmHost": "algorithm + local learner",
    "LeanEnvRunner": "env runner",
    "SlimEnvRunner": "env runner",
    "SingleAgentEnvRunner": "env runner",
    "MultiAgentEnvRunner": "env runner",
    "Learner": "learner",
    "AggregatorActor": "aggregator",
    "SampleRelay": "relay",
    "_WrappedExecutable": "learner",  # RLlib's LearnerGroup runs remote learners in Ray Train's worker actors
    "NodeProbe": "system monitor",
    "DashboardAgent": "ray dashboard agent",
    "RuntimeEnvAgent": "ray runtime env agent",
}
RAY_EXECUTABLES = {"gcs_server": "ray gcs server", "raylet": "ray raylet"}
RAY_SCRIPTS = {  # Ray's Python daemons of a node started by `ray start`, by the script they run
    "dashboard/dashboard.py": "ray dashboard", "dashboard/agent.py": "ray dashboard agent",
    "runtime_env/agent/main.py": "ray runtime env agent", "autoscaler/_private/monitor.py": "ray autoscaler monitor",
    "_private/log_monitor.py": "ray log monitor",
}


@contextlib.contextmanager
def loopback_cluster(nodes: int, cpus: float) -> Iterator[Optional[LoopbackCluster]]:
    """`nodes` Ray nodes in all (a head and nodes-1 workers), `cpus` each; None for 0 (a private local instance)."""
    if not nodes:
        yield None
        return
    try:
        cluster = LoopbackCluster(workers=nodes - 1, cpus=cpus)
    except RuntimeError as exc:  # `ray start` failed or a node did not come up: one line, not a traceback
        lines = str(exc).strip().splitlines() or [""]
        raise TrainingFailed(f"the loopback cluster did not start: {' '.join(dict.fromkeys([lines[0], lines[-1]]))}") from None
    with cluster:
        yield cluster


@contextlib.contextmanager
def node_cluster(args: Any, verb: str) -> Iterator[Optional[LoopbackCluster]]:
    """`--nodes N --node-cpus C` of a benchmark: its loopback cluster (None for 0), whose address the benchmark's
    `train` runs join (`args.address`), said once."""
    with loopback_cluster(args.nodes, args.node_cpus) as cluster:
        if cluster is not None:
            args.address = cluster.address
            console.say(f"{verb}: a cluster of {args.nodes} loopback nodes at {cluster.address}, {args.node_cpus:g} CPUs each")
        yield cluster


def run_processes(driver_pid: int, cluster: Optional[LoopbackCluster]) -> list[tuple[Any, str]]:
    """(process, node) for the driver and its descendants, and every process of every node of the cluster."""
    import psutil

    driver = psutil.Process(driver_pid)
    found = [(p, "driver") for p in [driver, *driver.children(recursive=True)]]
    for i, node in enumerate(cluster.nodes if cluster else []):
        found += [(p, "head" if i == 0 else f"worker {i}") for p in node.processes()]
    return found


def role_of(proc) -> Optional[str]:
    """What a process under the driver is, from Ray's process title or executable; None for idle workers."""
    try:
        cmdline = proc.cmdline()
    except Exception:  # gone, or not ours to read
        return None
    title = cmdline[0] if cmdline else ""
    script = next((RAY_SCRIPTS[k] for part in cmdline[1:3] for k in RAY_SCRIPTS if part.endswith(k)), None)
    if script:
        return script
    if title.startswith("ray-dashboard-"):  # the dashboard's modules, each a process: "ray-dashboard-JobHead-0 (...)"
        return f"ray dashboard {title[len('ray-dashboard-'):].split('-', 1)[0]}"
    if "ray.dashboard.subprocesses.module" in " ".join(cmdline):
        return "ray dashboard forkserver"
    if "ray.util.client.server" in cmdline:
        return "ray client server"
    if title.startswith("ray::"):
        name = title[5:].split(".", 1)[0].split(" ", 1)[0]
        if name in ROLES:
            return ROLES[name]
        if name.endswith("Learner"):  # PPOTorchLearner and friends, when remote
            return "learner"
        return None if name == "IDLE" else f"ray {name}"
    return RAY_EXECUTABLES.get(Path(title).name, "other")


def read_cpu(proc: Any, role: str) -> dict[str, Any]:
    """A process's CPU seconds so far, user and system (`/proc`): `sample_processes`' simplest `read`."""
    cpu = proc.cpu_times()
    return {"cpu_s": cpu.user + cpu.system}


def sample_processes(processes: Callable[[], list[tuple[Any, str]]], read: Callable[[Any, str], dict[str, Any]],
                     started: float, interval_s: float, poll: Callable[[], Optional[int]],
                     machine: Optional[Callable[[], dict[str, Any]]] = None) -> list[dict[str, Any]]:
    """Every `interval_s` until `poll()` says the run has exited: `read(process, role)` of every process that
    `processes()` names (process, node) and that has a role (the first one named is the driver), as
    `{"t": seconds since started, "processes": {pid: {"role", "node", **read(...)}}, **machine()}`."""
    import psutil

    samples = []
    while poll() is None:
        t = time.time() - started
        found: dict[str, dict[str, Any]] = {}
        try:
            procs = processes()
        except psutil.NoSuchProcess:
            break
        for i, (p, node) in enumerate(procs):
            role = "driver" if i == 0 else role_of(p)
            if role is None or str(p.pid) in found:
                continue
            try:
                found[str(p.pid)] = {"role": role, "node": node, **read(p, role)}
            except psutil.Error:
                continue
        samples.append({"t": t, "processes": found, **(machine() if machine else {})})
        deadline = time.time() + interval_s
        while poll() is None and time.time() < deadline:
            time.sleep(0.1)
    return samples

"""Everything decided about a run before it trains: the sized experiment, the resources and bundles
it asks for, where the algorithm lives, the checkpoint it resumes from. Bad input fails here."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from rlplatform.adapter import speedups
from rlplatform.config.experiment import ResolvedExperiment
from rlplatform.config.schema import DataSection, ExperimentConfig
from rlplatform.config.sizing import Resources, preflight, size_to_cluster
from rlplatform.errors import UserError
from rlplatform.run.checkpoints import CheckpointInfo, first_usable, list_checkpoints, newest_first


@dataclass
class Plan:
    """Everything decided before training starts."""

    config: ExperimentConfig
    resources: Resources
    bundles: list[dict[str, float]]
    main_process_resources: dict[str, float] = field(default_factory=dict)
    resume_from: Optional[CheckpointInfo] = None
    run_dir: Optional[Path] = None
    layout_note: Optional[str] = None  # where `--profile auto` took a measured layout from
    envs_choice: dict = field(default_factory=dict)  # envs per runner: value, source, measured step cost
    envs_note: Optional[str] = None  # the start-up line of a choice from the step-cost measurement
    ray_ready_at: Optional[float] = None  # time.time() when Ray was up
    algorithm_in_driver: bool = False  # scale.algorithm_in, resolved: see runs_algorithm_in_driver

    def require_run_dir(self) -> Path:
        """The run directory, which `train` and `tune` make once the plan holds (after `--print-config`)."""
        if self.run_dir is None:
            raise RuntimeError("the plan has no run directory yet")
        return self.run_dir


def make_plan(resolved: ResolvedExperiment, resources: Resources, joined_cluster: bool, resize: bool) -> Plan:
    from rlplatform.adapter import algorithm_config
    from rlplatform.config import layouts, step_cost

    config = speedups.gated(resolved.config)  # the version gate decides once, here, for every process of the run
    algorithm_config.check(config)
    try:
        config = _with_inputs(config, resize)
    except (OSError, ValueError) as exc:  # a path the OS refuses: too long, a NUL byte, no permission
        given = (config.init_from if config.data is None else (config.data.paths or config.data.minari)) or (
            config.record.path if config.record else None)
        raise UserError(f"data, init_from or record: {str(given)[:200]}: not a path this machine can use ({exc})"[:400]) from None
    layout_note = envs_note = None
    measured = None
    if config.external is not None and config.external.ports is None:
        config = _with_external_ports(config)
    # A resumed run keeps the size it was started with; an external run's size is its simulators'; an offline run
    # samples nothing.
    if config.profile == "auto" and resize and config.external is None and config.data is None:
        config = size_to_cluster(config, resources, resolved.explicit_keys)
        config, layout_note = layouts.apply_best_layout(config, resources.cpus, resources.gpus, resolved.given_keys)
        if layout_note is None:  # no cached layout for this machine and env: measure the env's step cost
            config, measured = step_cost.apply_step_cost(config, resolved.given_keys,
                                                          algorithm_config.total_train_batch(config))
            envs_note = step_cost.describe(measured) if measured else None
    envs_choice = _envs_choice(config, resolved, resize, layout_note, measured)
    main_resources = _driver_node_resource() if joined_cluster else {}
    bundles = algorithm_config.resource_bundles(algorithm_config.build_algorithm_config(config, main_resources))
    preflight(bundles, resources)
    return Plan(config=config, resources=resources, bundles=bundles, main_process_resources=main_resources,
                layout_note=layout_note, envs_choice=envs_choice, envs_note=envs_note,
                algorithm_in_driver=runs_algorithm_in_driver(config, bundles, joined_cluster))


def _with_inputs(config: ExperimentConfig, resize: bool) -> ExperimentConfig:
    """The data an offline run reads and the checkpoint `init_from` names, resolved and checked before Ray starts."""
    from rlplatform.adapter import algorithm_config

    if config.data is not None:  # the run's config.yaml keeps them absolute: a resume reads the same data from anywhere
        config = config.model_copy(update={"data": config.data.model_copy(update={"paths": _data_paths(config.data)})})
        algorithm_config.check_data(config)
        if config.data is not None and config.data.read_batch_size is None and config.data.columns is None:
            config = config.model_copy(update={"data": config.data.model_copy(update={"read_batch_size": _read_batch(config)})})
    if config.init_from is not None and resize:  # a resume restores its own checkpoint instead
        config = config.model_copy(update={"init_from": init_checkpoint(config)})
    if config.record is not None and config.record.path is not None:
        config = config.model_copy(update={"record": config.record.model_copy(update={
            "path": str(_record_directory(config.record.path, fresh=resize))})})
    return config


def _record_directory(given: str, fresh: bool) -> Path:
    """`record.path`, absolute; a fresh run's must not hold a dataset already (a resumed run adds to its own)."""
    from rlplatform.run.run_dir import check_new_dataset_directory, check_writable

    path = Path(given).expanduser().absolute()
    if fresh:
        check_new_dataset_directory(path, "record.path", " (a resumed run adds to its own)")
    else:
        check_writable(path)
    return path


def with_record_directory(config: ExperimentConfig, run_dir: Path) -> ExperimentConfig:
    """A `record` section without a path records into `episodes/` in the run directory."""
    if config.record is None or config.record.path is not None:
        return config
    return config.model_copy(update={"record": config.record.model_copy(update={"path": str((run_dir / "episodes").absolute())})})


def _data_paths(data: DataSection) -> list[str]:
    """The data's paths, absolute; a Minari dataset's are those of its conversion to RLlib's format (made once)."""
    from rlplatform.adapter.minari_data import converted
    from rlplatform.adapter.offline_data import resolved_paths

    return resolved_paths(data.paths if data.paths is not None else [str(converted(str(data.minari)))])


def _read_batch(config: ExperimentConfig) -> int:
    """Episodes per read: about one train batch of env steps (the mean length of the first episodes)."""
    from rlplatform.adapter import algorithm_config
    from rlplatform.adapter.offline_data import mean_episode_length

    assert config.data is not None and config.data.paths is not None
    length = mean_episode_length(config.data.paths)
    batch = (algorithm_config.total_train_batch(config) or 0) / max(1, config.scale.learners)
    return max(1, round(batch / length)) if length else 1


def init_checkpoint(config: ExperimentConfig) -> str:
    """`init_from` as the checkpoint it names (a run directory's best that verifies and loads), checked against this
    run's env and network widths before Ray starts; the checkpoint's absolute path."""
    from rlplatform.run.checkpoints import find_checkpoint

    assert config.init_from is not None
    info = find_checkpoint(Path(config.init_from).expanduser(), "best")
    source = info.meta.get("config") or {}
    if source.get("multi_agent") is not None:
        raise UserError(f"init_from {info.path}: a multi-agent run's checkpoint; init_from takes a single policy's")
    if source.get("env") not in (None, config.env) or source.get("env_config", {}) != config.env_config:
        raise UserError(f"init_from {info.path}: its policy was trained on {source['env']} {source.get('env_config') or ''}, "
                        f"this run is on {config.env} {config.env_config or ''}".rstrip())
    model = source.get("model") or {}
    for key in ("hidden", "activation", "head_hidden", "conv_filters", "use_lstm"):
        if key in model and model[key] != getattr(config.model, key):
            raise UserError(f"init_from {info.path}: its network's model.{key} is {model[key]}, this run's is "
                            f"{getattr(config.model, key)}: they must agree for its weights to fit and act the same")
    return str(info.path.resolve())


def runs_algorithm_in_driver(config: ExperimentConfig, bundles: list[dict[str, float]], joined_cluster: bool) -> bool:
    """`scale.algorithm_in`. On a private local instance (one node) a placement group has nothing to place, and the
    actor that holds the Algorithm costs a fresh process importing RLlib and torch (3-4 s of a 2-core machine's
    start-up): "auto" builds the Algorithm in the driver there, as plain RLlib scripts do, unless its process needs
    a GPU or the run has aggregator actors (both kept in the group's bundles). On a cluster the actor places the
    run's actors as `scale.placement` says."""
    choice = config.scale.algorithm_in
    if choice == "actor":
        return False
    if joined_cluster:
        if choice == "driver":
            raise UserError("scale.algorithm_in: driver needs a private local instance (no --address); on a cluster the "
                            "algorithm's actor places the run's actors (scale.placement)")
        return False
    return choice == "driver" or (not bundles[0].get("GPU", 0) and not config.scale.aggregators_per_learner)


def _with_external_ports(config: ExperimentConfig) -> ExperimentConfig:
    """The ports the external runners listen on, fixed once for the run (a resume keeps them): `external.port` and
    the ones after it, or, where it is 0, ports free on this machine now (`_listen_ports`)."""
    ext = config.external
    assert ext is not None
    count = config.scale.env_runners
    ports = list(range(ext.port, ext.port + count)) if ext.port else _listen_ports(ext.host, count)
    if max(ports) > 65535:
        raise UserError(f"external.port {ext.port} + {count} runners goes past port 65535")
    return config.model_copy(update={"external": ext.model_copy(update={"ports": ports})})


RAY_WORKER_PORTS = (10002, 19999)  # Ray's default min_worker_port..max_worker_port


def _listen_ports(host: str, count: int) -> list[int]:
    """`count` ports free on this machine now, outside the kernel's ephemeral range and Ray's worker ports.

    The runners bind them only once Ray has started them, after dozens of Ray's processes took ports of their own:
    a port the kernel hands out for `bind(0)` could be handed out again in between (seen: "Address already in use").
    """
    import random
    import socket

    low, high = _ephemeral_ports()
    ranges = [r for r in ((1024, low - 1), (high + 1, 65535)) if r[1] >= r[0]]
    candidates = [p for lo, hi in ranges for p in range(lo, hi + 1) if not RAY_WORKER_PORTS[0] <= p <= RAY_WORKER_PORTS[1]]
    ports: list[int] = []
    for port in random.sample(candidates, min(len(candidates), 2000)):
        try:
            socket.create_server((host, port)).close()
        except OSError:
            continue
        ports.append(port)
        if len(ports) == count:
            return ports
    raise UserError(f"found no {count} free ports for the external runners on {host}; set external.port")


def _ephemeral_ports() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def _envs_choice(config: ExperimentConfig, resolved: ResolvedExperiment, resize: bool, layout_note: Optional[str],
                 measured: Optional[dict]) -> dict:
    """What the manifest records of envs per runner: the value, where it came from, the measured step cost."""
    from rlplatform.config import step_cost

    if not resize:
        source = step_cost.SOURCE_RESUMED
    elif "scale.envs_per_runner" in resolved.given_keys:
        source = step_cost.SOURCE_EXPERIMENT
    elif measured:
        source = step_cost.SOURCE_MEASURED
    elif layout_note is not None:
        source = step_cost.SOURCE_CACHE
    else:
        source = step_cost.SOURCE_DEFAULT
    return {"envs_per_runner": config.scale.envs_per_runner, "source": source,
            "step_cost_us": round(measured["step_cost_s"] * 1e6, 2) if measured else None}


def _driver_node_resource() -> dict[str, float]:
    """Pin the algorithm (and its checkpoints) to the driver's node, when the driver is a cluster node."""
    import ray

    key = f"node:{ray.util.get_node_ip_address()}"
    return {key: 0.001} if key in ray.cluster_resources() else {}


def checkpoint_to_resume(run_dir: Path) -> CheckpointInfo:
    """The newest checkpoint that verifies and whose policy loads: a torn or corrupt one is skipped
    (and named) here, before Ray starts."""
    from rlplatform.adapter.policy import check_loads

    directory = run_dir / "checkpoints"
    return first_usable(newest_first(list_checkpoints(directory)), lambda info: check_loads(info.path), directory)

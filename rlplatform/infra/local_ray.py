"""Ray for a run: a private local instance or an existing cluster, and the resources it offers.

A run without `--address` starts its own Ray instance (`address="local"`), so it never
joins a cluster that `ray start` left on the host. Token authentication stays on.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Optional

from rlplatform.adapter.speedups import init_local_ray
from rlplatform.config.sizing import Resources
from rlplatform.errors import UserError

TOKEN_FILE = Path.home() / ".ray" / "auth_token"


def use_token_auth_for_address() -> None:
    """A driver joining a cluster by explicit address sends the token only in token mode, and Ray
    reads the mode when it is imported: call before `import ray`."""
    if TOKEN_FILE.is_file() or os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH"):
        os.environ.setdefault("RAY_AUTH_MODE", "token")


def connect(address: Optional[str], resources: Optional[Resources] = None, prestart_workers: bool = True,
            speedups: bool = True) -> Resources:
    """Start a private local Ray instance (address None) or join the cluster at `address`.

    With the speed-ups on, the local instance starts lean (`adapter.speedups.init_local_ray`; `prestart_workers`
    is passed on there); off, it is plain `ray.init(address="local")`.
    """
    import ray

    os.environ.setdefault("RAY_DEDUP_LOGS", "1")
    common = dict(logging_level=logging.ERROR, log_to_driver=False, configure_logging=True)
    if address is None:
        resources = resources or local_resources()
        local = dict(address="local", num_cpus=int(resources.cpus), num_gpus=int(resources.gpus), include_dashboard=False)
        init_local_ray({**local, **common}, speedups, prestart_workers)
    else:
        try:
            ray.init(address=address, **common)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            raise UserError(f"cannot connect to the Ray cluster at {address!r}: {str(exc).splitlines()[0]}") from None
    return cluster_resources()


def local_resources() -> Resources:
    """What a private local instance on this machine will have, known before Ray starts."""
    cpus = float(len(os.sched_getaffinity(0)))
    gpus = float(_local_gpu_count())
    return Resources(cpus=cpus, gpus=gpus, nodes=[{"CPU": cpus, "GPU": gpus}])


def _local_gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def cluster_resources() -> Resources:
    import ray

    nodes = [
        {"CPU": float(n["Resources"].get("CPU", 0)), "GPU": float(n["Resources"].get("GPU", 0))}
        for n in ray.nodes()
        if n.get("Alive")
    ]
    totals = ray.cluster_resources()
    return Resources(cpus=float(totals.get("CPU", 0)), gpus=float(totals.get("GPU", 0)), nodes=nodes)


def shutdown() -> None:
    import ray

    if ray.is_initialized():
        ray.shutdown()

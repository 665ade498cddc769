"""Cluster launch configs in cluster/: Ray's own validator for the launcher YAMLs, KubeRay's required
fields for the Kubernetes manifests, and the properties we promise (groups, image, idle timeout,
token auth, dashboard on the head's loopback only). No cloud account is touched."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import yaml

from rlplatform.infra.loopback import CLUSTER_RAY_ENV

ROOT = Path(__file__).resolve().parent.parent
CLUSTER = ROOT / "cluster"
LAUNCHER = {"aws": CLUSTER / "aws.yaml", "gcp": CLUSTER / "gcp.yaml", "onprem": CLUSTER / "onprem.yaml"}
KUBERAY = {"RayCluster": CLUSTER / "kuberay-cluster.yaml", "RayJob": CLUSTER / "kuberay-job.yaml"}


def load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def prepared(path: Path) -> dict:
    """What `ray up` validates: the file merged with the provider's defaults.yaml."""
    from ray.autoscaler._private.util import prepare_config

    return prepare_config(load(path))


@pytest.mark.parametrize("name", LAUNCHER)
def test_launcher_yaml_passes_rays_validator(name: str) -> None:
    from ray.autoscaler._private.util import validate_config

    validate_config(prepared(LAUNCHER[name]))  # jsonschema against ray-schema.json + Ray's own checks


def test_validator_catches_mistakes() -> None:
    """The check above is real: a misspelt key fails it."""
    import jsonschema
    from ray.autoscaler._private.util import validate_config

    config = load(LAUNCHER["aws"])
    config["idle_timeout_minute"] = 5
    with pytest.raises(jsonschema.ValidationError):
        validate_config(prepared_dict(config))


def prepared_dict(config: dict) -> dict:
    from ray.autoscaler._private.util import prepare_config

    return prepare_config(config)


@pytest.mark.parametrize("name", ["aws", "gcp"])
def test_cloud_groups(name: str) -> None:
    config = prepared(LAUNCHER[name])
    types = config["available_node_types"]
    head = types[config["head_node_type"]]
    assert head["max_workers"] == 0 and head["resources"].get("CPU", 0) >= 1  # the driver runs on the head
    cpu, gpu = types["cpu_workers"], types["gpu_workers"]
    assert cpu["max_workers"] > cpu["min_workers"] and "GPU" not in cpu["resources"], "autoscaling CPU group"
    assert gpu["max_workers"] >= gpu["min_workers"] and gpu["resources"]["GPU"] >= 1, "GPU group"
    assert gpu["docker"]["worker_image"].endswith("-gpu")
    assert config["max_workers"] >= cpu["max_workers"] + gpu["max_workers"]
    if name == "aws":
        assert config["provider"]["security_group"]["IpPermissions"] == [], "no port beyond SSH opened to the world"


@pytest.mark.parametrize("name", LAUNCHER)
def test_common_launcher_properties(name: str) -> None:
    raw = load(LAUNCHER[name])
    config = prepared(LAUNCHER[name])
    assert config["idle_timeout_minutes"] == raw["idle_timeout_minutes"] > 0
    docker = config["docker"]
    assert "rlplatform" in docker["image"] and docker["container_name"]
    options = " ".join(docker["run_options"])
    assert "--env RAY_AUTH_MODE=token" in options
    assert all(f"--env {k}={v}" in options for k, v in CLUSTER_RAY_ENV.items())  # the soak's settings (bench soak --nodes)
    assert "--entrypoint ''" in options  # the image's entrypoint is `python -m rlplatform`; the launcher runs bash
    assert config["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"
    # Nothing from the provider defaults (their setup commands pip-install a Ray nightly).
    assert config["setup_commands"] == [] and config["worker_setup_commands"] == []
    head_start = " ".join(config["head_start_ray_commands"])
    assert "--head" in head_start and "--autoscaling-config=~/ray_bootstrap_config.yaml" in head_start
    assert "--dashboard-host=127.0.0.1" in head_start and "0.0.0.0" not in head_start
    worker_start = " ".join(config["worker_start_ray_commands"])
    assert "--address=$RAY_HEAD_IP:6379" in worker_start


def test_onprem_pool() -> None:
    raw = load(LAUNCHER["onprem"])
    provider = raw["provider"]
    assert provider["type"] == "local" and provider["head_ip"] not in provider["worker_ips"]
    assert "available_node_types" not in raw  # Ray's on-prem provider refuses node types
    config = prepared(LAUNCHER["onprem"])
    (node_type,) = config["available_node_types"].values()
    assert node_type["max_workers"] == len(provider["worker_ips"])


def _commands(entrypoint: str) -> list[str]:
    return shlex.split(entrypoint)


def kuberay_specs() -> list[tuple[str, dict]]:
    out = [("RayCluster", load(KUBERAY["RayCluster"])["spec"])]
    out.append(("RayJob", load(KUBERAY["RayJob"])["spec"]["rayClusterSpec"]))
    return out


@pytest.mark.parametrize("kind", KUBERAY)
def test_kuberay_manifest_header(kind: str) -> None:
    doc = load(KUBERAY[kind])
    assert doc["apiVersion"] == "ray.io/v1" and doc["kind"] == kind
    assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", doc["metadata"]["name"])  # a DNS-1123 name


@pytest.mark.parametrize("where,spec", kuberay_specs(), ids=lambda v: v if isinstance(v, str) else "")
def test_kuberay_cluster_spec(where: str, spec: dict) -> None:
    import ray

    assert spec["rayVersion"] == ray.__version__
    assert spec["authOptions"]["mode"] == "token"
    assert spec["enableInTreeAutoscaling"] is True and spec["autoscalerOptions"]["idleTimeoutSeconds"] > 0
    head = spec["headGroupSpec"]
    assert isinstance(head["rayStartParams"], dict)
    assert head.get("serviceType", "ClusterIP") == "ClusterIP"  # GCS and dashboard inside the cluster only
    head_containers = head["template"]["spec"]["containers"]
    assert head_containers and head_containers[0]["image"] and head_containers[0]["name"]
    assert {e["name"]: e["value"] for e in head_containers[0].get("env", [])}.items() >= CLUSTER_RAY_ENV.items()
    groups = {g["groupName"]: g for g in spec["workerGroupSpecs"]}
    assert set(groups) == {"cpu-workers", "gpu-workers"}
    for group in groups.values():
        assert isinstance(group["rayStartParams"], dict)
        assert 0 <= group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
        containers = group["template"]["spec"]["containers"]
        assert containers and containers[0]["image"] and containers[0]["name"]
        for value in group["rayStartParams"].values():
            assert isinstance(value, str), "rayStartParams values must be strings"
    assert groups["cpu-workers"]["maxReplicas"] > groups["cpu-workers"]["minReplicas"], "autoscaling CPU group"
    gpu_container = groups["gpu-workers"]["template"]["spec"]["containers"][0]
    assert gpu_container["resources"]["limits"]["nvidia.com/gpu"] >= 1
    assert gpu_container["image"].endswith("-gpu")
    assert "nvidia.com/gpu" not in groups["cpu-workers"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert groups["gpu-workers"]["rayStartParams"]["num-gpus"] == str(gpu_container["resources"]["limits"]["nvidia.com/gpu"])


def test_rayjob_runs_training() -> None:
    spec = load(KUBERAY["RayJob"])["spec"]
    argv = _commands(spec["entrypoint"])
    assert argv[:4] == ["python", "-m", "rlplatform", "train"]
    assert "--address" in argv
    assert spec["shutdownAfterJobFinishes"] is True
    # The same groups as the RayCluster manifest.
    cluster = load(KUBERAY["RayCluster"])["spec"]
    assert spec["rayClusterSpec"]["workerGroupSpecs"] == cluster["workerGroupSpecs"]
    # The entrypoint parses as our CLI would parse it.
    from rlplatform.cli import build_parser

    args = build_parser().parse_args(argv[3:])
    assert args.verb == "train" and args.address == "auto"
    assert (ROOT / args.experiment).is_file()


@pytest.mark.parametrize("path", [*LAUNCHER.values(), *KUBERAY.values()], ids=lambda p: p.name)
def test_images_are_ours(path: Path) -> None:
    images = re.findall(r"(?:image|worker_image):\s*(\S+)", path.read_text())
    assert images and all(re.search(r"/rlplatform:[\w.]+-(cpu|gpu)$", image) for image in images), images

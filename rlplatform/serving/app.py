"""The Ray Serve application behind `rlplatform serve`: one deployment, onnxruntime in every replica.

The policy arrives as an export directory (`rlplatform export`'s files: one ONNX model per policy and
mode, greedy and, where the algorithm has one, stochastic, with export.json). Its bytes travel to the
replicas with the deployment, so a replica on another node needs no shared disk, and no replica loads
Ray's RLlib or torch.

Routes: `POST /v1/act` (requests batched across clients with `@serve.batch`), `GET /v1/policy`;
Serve's own health check calls `check_health`, which runs each model once.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np
from ray import serve

from rlplatform.export.spec import SPEC_FILE, space_from_json
from rlplatform.serving.requests import DEFAULT_MAX_BODY_BYTES, ActRequest, BadRequest, ObservationSpec, parse_act

logger = logging.getLogger("rlplatform.serve")
MODES = ("greedy", "stochastic")
DEFAULT_MAX_BATCH_SIZE = 64
DEFAULT_BATCH_WAIT_S = 0.002


@dataclass
class ServedPolicy:
    """One policy as the replicas get it: its export.json entry and each mode's model file's bytes."""

    description: dict[str, Any]  # the first mode's (spaces, preprocessing)
    models: dict[str, bytes]  # mode -> model file bytes; a mode absent where the export has none
    mode_descriptions: dict[str, dict[str, Any]]  # mode -> that model's export.json entry (its noise input)
    suffix: str


@dataclass
class Bundle:
    """Everything a replica needs, picklable: the policies, which one a request without `policy` gets, the version."""

    policies: dict[str, ServedPolicy]
    default_policy: str
    version: dict[str, Any]
    token: Optional[str] = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    settings: dict[str, Any] = field(default_factory=dict)

    def describe(self) -> dict[str, Any]:
        return {"policies": {name: {"observation_space": p.description["observation_space"],
                                    "action_space": p.description["action_space"],
                                    "modes": sorted(p.models)}
                             for name, p in self.policies.items()},
                "default_policy": self.default_policy, "version": self.version}


def bundle_from_exports(exports: dict[str, Path], version: dict[str, Any], **kwargs: Any) -> Bundle:
    """A bundle from export directories by mode ({"greedy": dir, "stochastic": dir}, either or both)."""
    specs = {mode: json.loads((path / SPEC_FILE).read_text()) for mode, path in exports.items()}
    policies = {}
    for name, entry in next(iter(specs.values()))["policies"].items():
        entries = {mode: spec["policies"][name] for mode, spec in specs.items() if name in spec["policies"]}
        models = {mode: (exports[mode] / e["file"]).read_bytes() for mode, e in entries.items()}
        policies[name] = ServedPolicy(entry, models, entries, Path(entry["file"]).suffix)
    return Bundle(policies, next(iter(policies)), version, **kwargs)


class PolicyServer:
    """The deployment's class (made a Serve deployment in `deployment`)."""

    def __init__(self, bundle: Bundle):
        from rlplatform.export.runtime import ExportedPolicy

        self.bundle = bundle
        self._dir = tempfile.TemporaryDirectory(prefix="rlplatform-serve-")
        self._models: dict[tuple[str, str], Any] = {}
        self._specs: dict[str, ObservationSpec] = {}
        for name, policy in bundle.policies.items():
            self._specs[name] = ObservationSpec.of(space_from_json(policy.description["observation_space"]))
            for mode, data in policy.models.items():
                path = Path(self._dir.name) / f"{name}-{mode}{policy.suffix}"
                path.write_bytes(data)
                self._models[(name, mode)] = ExportedPolicy(path, policy.mode_descriptions[mode], seed=int.from_bytes(os.urandom(4), "little"))
        self._probe = {name: np.zeros((1, *spec.shape), spec.dtype) if spec.low is None
                       else np.clip(np.zeros((1, *spec.shape)), spec.low, spec.high).astype(spec.dtype)
                       for name, spec in self._specs.items()}
        self.act_batch.set_max_batch_size(int(bundle.settings.get("max_batch_size", DEFAULT_MAX_BATCH_SIZE)))
        self.act_batch.set_batch_wait_timeout_s(float(bundle.settings.get("batch_wait_s", DEFAULT_BATCH_WAIT_S)))

    async def __call__(self, request: Any) -> Any:
        from starlette.responses import JSONResponse

        try:
            self._authorize(request.headers.get("authorization"))
            path = request.url.path.rstrip("/")
            if path == "/v1/policy" and request.method == "GET":
                return JSONResponse(self.bundle.describe())
            if path == "/v1/act" and request.method == "POST":
                declared = request.headers.get("content-length", "0")
                if declared.isdigit() and int(declared) > self.bundle.max_body_bytes:
                    async for _ in request.stream():  # read away, not kept: the client gets the answer, not a reset
                        pass
                    raise BadRequest(413, "body", f"the body is {int(declared):,} bytes; at most "
                                     f"{self.bundle.max_body_bytes:,} are taken")
                act = parse_act(await request.body(), request.headers.get("content-type", ""), request.query_params,
                                self._specs, self.bundle.default_policy, self.bundle.max_body_bytes)
                if (act.policy, MODES[act.stochastic]) not in self._models:
                    raise BadRequest(422, "stochastic", f"policy {act.policy!r} is served "
                                     f"{'greedy' if act.stochastic else 'stochastic'} only")
                actions = await self.act_batch(act)
                return JSONResponse({"actions": actions.tolist(), "policy": act.policy,
                                     "stochastic": act.stochastic, "version": self.bundle.version})
            raise BadRequest(404, "path", f"no route {request.method} {path or '/'}; routes: POST /v1/act, GET /v1/policy")
        except BadRequest as exc:
            return JSONResponse(exc.body(), status_code=exc.status)

    def _authorize(self, header: Optional[str]) -> None:
        token = self.bundle.token
        if token is None:
            return
        given = (header or "").removeprefix("Bearer ").strip()
        if not hmac.compare_digest(given.encode(), token.encode()):
            raise BadRequest(401, "authorization", "a bearer token is required (Authorization: Bearer TOKEN)")

    @serve.batch(max_batch_size=DEFAULT_MAX_BATCH_SIZE, batch_wait_timeout_s=DEFAULT_BATCH_WAIT_S)
    async def act_batch(self, requests: list[ActRequest]) -> list[np.ndarray]:
        """Requests batched across clients: one model call per (policy, mode) in the batch."""
        results: list[Optional[np.ndarray]] = [None] * len(requests)
        groups: dict[tuple[str, str], list[int]] = {}
        for i, r in enumerate(requests):
            groups.setdefault((r.policy, MODES[r.stochastic]), []).append(i)
        for key, indices in groups.items():
            obs = np.concatenate([requests[i].observations for i in indices])
            actions, _ = self._models[key].act(obs)
            start = 0
            for i in indices:
                n = len(requests[i].observations)
                results[i] = actions[start:start + n]
                start += n
        return results  # type: ignore[return-value]  # every slot filled above

    def check_health(self) -> None:
        """Serve's health check: every model answers a valid observation (a replica that cannot is replaced)."""
        for (name, _mode), model in self._models.items():
            model.act(self._probe[name])


def deployment(bundle: Bundle, replicas: int, max_replicas: Optional[int], replica_cpus: float) -> Any:
    """The Serve application: fixed replicas, or autoscaling between `replicas` and `max_replicas` on Serve's own policy."""
    options: dict[str, Any] = {"name": "policy", "ray_actor_options": {"num_cpus": replica_cpus},
                               "health_check_period_s": 5.0, "health_check_timeout_s": 10.0,
                               "max_ongoing_requests": 256}
    if max_replicas and max_replicas > replicas:
        options["autoscaling_config"] = {"min_replicas": replicas, "max_replicas": max_replicas,
                                         "target_ongoing_requests": 32}
    else:
        options["num_replicas"] = replicas
    return serve.deployment(PolicyServer).options(**options).bind(bundle)

"""A run's remote learners: where they run, and whether they hold the same weights.

Several learners train one policy by all-reducing their gradients (NCCL on GPUs, Gloo on CPUs) every
step; after the same steps each must hold the same trained weights, bit for bit. `weight_digests` reads a
digest of each learner's trained parameters once they stop changing: APPO and IMPALA learners train in a
thread of their own, so a learner may still be working through queued batches when training has stopped.
Target networks (APPO's old policy) are left out: nothing all-reduces them, and each learner copies its
main network into them on its own count of trained steps, which its own shards of the batches make.
"""

from __future__ import annotations

import hashlib
import time
from typing import Any

SETTLE_S = 0.5  # between two reads of the digests: unchanged means the learners are idle
SETTLE_TIMEOUT_S = 30.0


def learner_node_ids(algo: Any) -> list[str]:
    """The node of each remote learner; [] where the learner is in the algorithm's process."""
    if not algo.config.num_learners:
        return []
    return _each(algo, _node_id)


def weight_digests(algo: Any) -> list[str]:
    """A SHA-256 of each learner's module weights, read once two reads `SETTLE_S` apart agree and the learners agree
    with each other, or after `SETTLE_TIMEOUT_S`.

    APPO's learners update in a thread of their own from a queue: on a loaded host one can sit a step behind the
    other for longer than `SETTLE_S` (a mismatch seen once in the full suite, gone on the rerun), so two equal reads
    alone do not show that both have finished."""
    deadline = time.time() + SETTLE_TIMEOUT_S
    digests = _each(algo, _digest)
    while time.time() < deadline:
        time.sleep(SETTLE_S)
        again = _each(algo, _digest)
        if again == digests and len(set(again)) == 1:
            break
        digests = again
    return digests


def _each(algo: Any, fn: Any) -> list:
    return [r.get() if hasattr(r, "get") else r for r in algo.learner_group.foreach_learner(fn)]


def _node_id(_learner: Any) -> str:
    import ray

    return ray.get_runtime_context().get_node_id()


def _digest(learner: Any) -> str:
    """The trained parameters (those the all-reduce keeps equal), by name."""
    sha = hashlib.sha256()
    for module_id in sorted(learner.module.keys()):
        for name, tensor in sorted(learner.module[module_id].named_parameters()):
            if tensor.requires_grad:
                sha.update(f"{module_id}/{name}".encode())
                sha.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return sha.hexdigest()

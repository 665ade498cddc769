"""Ray's object-store usage from each raylet's own stats (`ray._private.internal_api.node_stats`).

Ray's public state API answers this only through the dashboard head, which a private local
instance does not start. With the speed-ups off, the system monitor leaves the figure out.
"""

from __future__ import annotations

from typing import Any, Optional


def object_store_used_bytes(nodes: list[dict[str, Any]]) -> Optional[float]:
    """Bytes held in the object stores of all `nodes` (entries of `ray.nodes()`); None if none answered."""
    from ray._private.internal_api import node_stats

    total, answered = 0.0, False
    for node in nodes:
        try:
            reply = node_stats(node["NodeManagerAddress"], node["NodeManagerPort"], include_memory_info=False)
        except Exception:  # a node going away mid-call: its share is simply missing this iteration
            continue
        total += reply.store_stats.object_store_bytes_used
        answered = True
    return total if answered else None

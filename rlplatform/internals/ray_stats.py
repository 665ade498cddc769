"""Ray's object-store usage and traffic from each raylet's own stats (`ray._private.internal_api.node_stats`).

Ray's public state API answers this only through the dashboard head, which a private local
instance does not start. With the speed-ups off, the system monitor leaves the figure out.
"""

from __future__ import annotations

from typing import Any, Optional


def object_store_bytes(nodes: list[dict[str, Any]]) -> Optional[tuple[float, float]]:
    """(bytes held now, bytes created since the nodes started) in the object stores of all `nodes` (entries
    of `ray.nodes()`); None if none answered. A store creates an object when a task or actor returns it, when
    `ray.put` puts it and when a node pulls a copy from another node, so the growth of the second figure is
    what the run moved through the object stores."""
    from ray._private.internal_api import node_stats

    used, created, answered = 0.0, 0.0, False
    for node in nodes:
        try:
            reply = node_stats(node["NodeManagerAddress"], node["NodeManagerPort"], include_memory_info=False)
        except Exception:  # a node going away mid-call: its share is simply missing this iteration
            continue
        used += reply.store_stats.object_store_bytes_used
        created += reply.store_stats.cumulative_created_bytes
        answered = True
    return (used, created) if answered else None

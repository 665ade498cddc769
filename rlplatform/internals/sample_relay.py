"""Sample requests fanned out by relay actors, one per group of runners on a node, so the driver sends one request
per relay instead of one per runner and never receives an episode.

Each Ray actor call costs its caller 0.4-0.65 ms of CPU on this machine, whatever its payload (docs/scale.md),
and the driver of a synchronous algorithm makes its calls one after another: at 1,000 runners that alone is
0.4-0.65 s per iteration, a fifth to a third of a 2 s sampling round. A relay makes its runners' calls on their
node, in parallel with the other relays, and puts all their episodes, in runner order, into one object (packed
column by column, `episode_transport.PackedEpisodes`) whose reference it returns with the runners' metrics. The
driver passes the relays' references to a single learner, which fetches the episodes itself (RLlib's
`LearnerGroup.update(episodes_refs=...)`). Its cost per runner is then the metrics' (~0.2 ms of CPU), per env
step nothing: a reference per runner would cost it ~0.1 ms more (Ray's borrowing protocol, mostly on its
I/O threads), and the learner as much again.

The relay's process loads RLlib's episode classes only when the first episodes come (~140 MB, as a runner's).
"""

from __future__ import annotations

from itertools import chain
from typing import Any, Optional

import ray
from ray.exceptions import RayError

# (runner id, its metrics, error text): one per runner that answered in time.
RunnerReply = tuple[int, Optional[dict], Optional[str]]


def sample_with_state(runner: Any, state: Optional[dict] = None) -> tuple[list, dict]:
    """On a runner: take the driver's state (new weights, the run's env-step count), then sample as RLlib's PPO asks.

    A module-level function, so that Ray pickles it by name: a lambda is pickled by value on every call.
    """
    if state is not None:
        runner.set_state(state)
    return runner.sample(), runner.get_metrics()


def node_of_runner(runner: Any) -> str:
    return ray.get_runtime_context().get_node_id()


@ray.remote(num_cpus=0, max_restarts=0)
class SampleRelay:
    """Holds the handles of some runners on its node; `sample` asks each of them for one sample."""

    def __init__(self, runners: dict[int, Any]) -> None:
        self._runners = runners

    def sample(self, state: list[Optional[ray.ObjectRef]], runner_ids: list[int],
               timeout_s: Optional[float]) -> tuple[Optional[ray.ObjectRef], list[RunnerReply]]:
        """`state` holds the driver's state reference, boxed so that Ray does not fetch it here: each runner does.

        Returns a reference to the episodes of the runners that answered (None if none did), in `runner_ids`'
        order, and a reply per runner. A runner still sampling after `timeout_s` is left out, as RLlib's sampling
        leaves it out (its request stays queued on it); one whose call failed is named with its error.
        """
        calls = [(runner_id, *self._runners[runner_id].apply.options(num_returns=2).remote(sample_with_state, state=state[0]))
                 for runner_id in runner_ids]
        if not calls:
            return None, []
        # Both of a call's returns are ready together; waiting on the episodes also brings them to this node.
        ready = set(ray.wait([episodes for _, episodes, _ in calls], num_returns=len(calls), timeout=timeout_s,
                             fetch_local=True)[0])
        replies: list[RunnerReply] = []
        fragments: list[list] = []
        for runner_id, episodes, metrics in calls:
            if episodes not in ready:
                continue
            try:  # runner by runner: one lost object costs that runner's sample only
                runner_metrics, runner_episodes = ray.get([metrics, episodes])
            except RayError as exc:
                replies.append((runner_id, None, f"{type(exc).__name__}: {str(exc).strip()[:2000]}"))
                continue
            replies.append((runner_id, runner_metrics, None))
            fragments.append(runner_episodes)
        return (_put_together(fragments) if fragments else None), replies


def _put_together(fragments: list[list]) -> ray.ObjectRef:
    from rlplatform.internals.episode_transport import PackedEpisodes

    return ray.put(PackedEpisodes(chain.from_iterable(fragments)))

"""A remote env runner's episodes, pickled column by column on their way to the driver.

Ray pickles what `EnvRunner.sample()` returns. A list of RLlib SingleAgentEpisodes pickles each
array, numpy scalar and lookback buffer of each episode through cloudpickle's Python-level hooks
(`reducer_override`, then its ChainMap dispatch table) and gives each array its own out-of-band
buffer, which the driver rebuilds one by one. An untrained CartPole policy ends about 200 episodes
per 3,200-step fragment: profiled in a 1x64 runner, that was 19 % of the runner's time, half of it
in ChainMap lookups.

`PackedEpisodes` is a list whose pickled form puts every array of the same dtype and row shape,
from all episodes, into one array, and each other attribute into a plain list, one per attribute
(lists, dicts and strings pickle in C). Unpickled, it is a plain list of SingleAgentEpisodes with
the same attributes and values; their arrays are views into those few arrays, read-only where
Ray's zero-copy arrays are.
Anything but SingleAgentEpisodes pickles as a plain list.
"""

from __future__ import annotations

import copyreg
from itertools import accumulate

import numpy as np
from ray.rllib.env.single_agent_episode import SingleAgentEpisode
from ray.rllib.env.utils.infinite_lookback_buffer import InfiniteLookbackBuffer

EPISODE_SLOTS = tuple(copyreg._slotnames(SingleAgentEpisode))  # type: ignore[attr-defined]  # not in typeshed
# How a column (one attribute across all episodes) is packed.
INLINE, ARRAYS, SCALARS, BUFFERS, BUFFER_DICTS = range(5)


class PackedEpisodes(list):
    def __reduce__(self):
        episodes = list(self)
        if not episodes or not all(type(e) is SingleAgentEpisode for e in episodes):
            return list, (episodes,)
        try:
            columns = [pack_column([getattr(e, slot) for e in episodes]) for slot in EPISODE_SLOTS]
        except AttributeError:  # a slot left unset: nothing to gain from packing it
            return list, (episodes,)
        return unpack_episodes, (EPISODE_SLOTS, len(episodes), columns)


def pack_column(values: list) -> tuple:
    """One attribute of every episode, as one array where the values are arrays of one dtype and row shape."""
    first = values[0]
    kind = type(first)
    if kind is np.ndarray and first.ndim and _same_rows(values):
        return ARRAYS, np.concatenate(values), list(accumulate(len(v) for v in values[:-1]))
    if isinstance(first, np.generic) and first.dtype.kind in "biufc" and all(type(v) is kind for v in values):
        return SCALARS, np.array(values, dtype=first.dtype)
    if kind is InfiniteLookbackBuffer and all(type(v) is kind for v in values):
        states = [vars(v) for v in values]
        names = tuple(states[0])
        if names and all(tuple(s) == names for s in states):
            return BUFFERS, names, [pack_column([s[name] for s in states]) for name in names]
    if kind is dict and all(type(v) is dict for v in values):
        keys = tuple(first)
        if keys and all(tuple(v) == keys for v in values) and all(type(b) is InfiniteLookbackBuffer for v in values for b in v.values()):
            return BUFFER_DICTS, keys, [pack_column([v[k] for v in values]) for k in keys]
    return INLINE, values


def _same_rows(values: list) -> bool:
    first = values[0]
    if first.dtype.hasobject:
        return False
    dtype, rows = first.dtype, first.shape[1:]
    return all(type(v) is np.ndarray and v.ndim and v.dtype == dtype and v.shape[1:] == rows and v.flags.c_contiguous
               for v in values)


def unpack_column(column: tuple) -> list:
    tag = column[0]
    if tag == INLINE:
        return column[1]
    if tag == ARRAYS:
        return np.split(column[1], column[2])
    if tag == SCALARS:
        return list(column[1])
    if tag == BUFFERS:
        names, states = column[1], zip(*(unpack_column(c) for c in column[2]))
        buffers = []
        for state in states:
            buffer = InfiniteLookbackBuffer.__new__(InfiniteLookbackBuffer)
            buffer.__dict__.update(zip(names, state))
            buffers.append(buffer)
        return buffers
    if tag == BUFFER_DICTS:
        keys = column[1]
        return [dict(zip(keys, values)) for values in zip(*(unpack_column(c) for c in column[2]))]
    raise ValueError(f"unknown episode column tag {tag!r}")


def unpack_episodes(slots: tuple[str, ...], count: int, columns: list[tuple]) -> list[SingleAgentEpisode]:
    episodes = [SingleAgentEpisode.__new__(SingleAgentEpisode) for _ in range(count)]
    for slot, column in zip(slots, columns):
        for episode, value in zip(episodes, unpack_column(column)):
            setattr(episode, slot, value)
    return episodes

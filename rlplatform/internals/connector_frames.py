"""RLlib's connector constructors, without reading the source of every frame on the stack.

`ConnectorV2.__init__` (ray 2.60.0, pinned) records the arguments its subclass's constructor was
called with, for checkpoints, by taking the caller's frame from `inspect.stack()[1].frame`.
`inspect.stack()` builds a FrameInfo for every frame up to the interpreter's top, each with its
source file looked up and a line of source read: 0.05-0.1 s per connector piece here, and an
algorithm builds about twenty pieces (env-to-module, module-to-env, learner pipelines), most of
half a second to a second of each process's start. Only the frame is used.

`install()` gives the connector module an `inspect` whose `stack()` walks the frames without
their source (every FrameInfo field but the code context, which RLlib does not read); everything
else is Python's `inspect`. `internals.install_in_process()` installs it where an algorithm, a lean
env runner or a lean learner is built.
"""

from __future__ import annotations

import inspect
import sys
import types
from typing import Callable, Optional


def _stack_without_source(context: int = 1) -> list[inspect.FrameInfo]:
    frames = []
    frame: Optional[types.FrameType] = sys._getframe(1)
    while frame is not None:
        frames.append(inspect.FrameInfo(frame, frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name, None, None))
        frame = frame.f_back
    return frames


class _InspectWithoutSource(types.ModuleType):
    stack: Callable[..., list[inspect.FrameInfo]]  # set on the instance by install() (an annotation only)

    def __getattr__(self, name: str):
        return getattr(inspect, name)


def install() -> None:
    from ray.rllib.connectors import connector_v2

    if isinstance(connector_v2.inspect, _InspectWithoutSource):
        return
    lean_inspect = _InspectWithoutSource("inspect")
    lean_inspect.stack = _stack_without_source
    connector_v2.inspect = lean_inspect

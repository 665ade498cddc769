"""RLlib's torch seeding, without loading the torch compiler in every process.

With a CPU build of torch, RLlib's `set_torch_seed` (run by the algorithm, every env runner and
every learner when a seed is set) calls `torch.use_deterministic_algorithms(True)`. The first call
of that function imports `torch._inductor` and `torch._dynamo`, only to set the compiler's own
`deterministic` flag: 1.7 s of CPU per process on a 2-core machine, the largest single part of
building the algorithm and of starting each env runner. Eager torch, which is all RLlib runs
unless `torch_compile_*` is asked for, takes the same switch from `torch._C`.

`install()` swaps in a seeding function that does what RLlib's does for a CPU build (same seed,
deterministic algorithms on) through that switch; CUDA builds, and processes in which the compiler
is already loaded, get RLlib's own function. `internals.install_in_process()` installs it where an
algorithm, a lean env runner or a lean learner is built.
"""

from __future__ import annotations

import os
import sys
from typing import Optional


def install() -> None:
    from ray.rllib.utils import torch_utils
    from ray.rllib.utils.debug import deterministic

    if deterministic.set_torch_seed is not torch_utils.set_torch_seed:
        return  # installed already
    rllib_set_torch_seed = torch_utils.set_torch_seed

    def set_torch_seed(seed: Optional[int] = None) -> None:
        if "torch" not in sys.modules and "RLLIB_TEST_NO_TORCH_IMPORT" in os.environ:
            return  # a torch-free env runner (internals/slim_env_runner.py): no torch to seed
        import torch

        if seed is None or torch.version.cuda is not None or "torch._inductor.config" in sys.modules:
            rllib_set_torch_seed(seed)
            return
        torch.manual_seed(seed)
        torch._C._set_deterministic_algorithms(True, warn_only=False)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False

    deterministic.set_torch_seed = set_torch_seed  # the name update_global_seed_if_necessary calls

"""RLlib's torch seeding without the torch compiler: the same seed and deterministic mode, but
torch._inductor is not imported (1.7 s per process on a CPU build). Each case runs in a fresh process."""

import json
import subprocess
import sys

import pytest
from conftest import ROOT

pytestmark = pytest.mark.slow  # two Python processes that import RLlib and torch's compiler (9-15 s on 2 cores)

SEED_THEN_REPORT = """
import json, sys, torch
{install}
from ray.rllib.utils.debug.deterministic import update_global_seed_if_necessary
update_global_seed_if_necessary("torch", 7)
print(json.dumps({{"inductor": "torch._inductor" in sys.modules, "deterministic": torch.are_deterministic_algorithms_enabled(),
                  "initial_seed": torch.initial_seed(), "draw": torch.rand(3).tolist()}}))
"""


def seeded(install: str) -> dict:
    out = subprocess.run([sys.executable, "-c", SEED_THEN_REPORT.format(install=install)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_same_seed_and_deterministic_mode_as_rllib_without_the_compiler():
    ours = seeded("from rlplatform.internals import torch_seed; torch_seed.install()")
    rllibs = seeded("")
    assert rllibs["inductor"] and not ours["inductor"]
    assert ours["deterministic"] and rllibs["deterministic"]
    assert ours["initial_seed"] == rllibs["initial_seed"] == 7
    assert ours["draw"] == rllibs["draw"]

"""Experiment files, profiles and --set: parsing and validation (no Ray)."""

from pathlib import Path

import pytest

from rlplatform.config import parse_override
from rlplatform.errors import UserError
from rlplatform.experiment import resolve_experiment

ROOT = Path(__file__).resolve().parent.parent


def test_default_experiment_resolves():
    resolved = resolve_experiment(None)
    assert resolved.config.algorithm == "PPO"
    assert resolved.config.env == "CartPole-v1"
    assert resolved.config.profile == "auto"


def test_set_overrides_are_parsed_as_yaml():
    resolved = resolve_experiment(None, ["training.lr=1e-3", "scale.envs_per_runner=4", "stop.env_steps=5000"])
    assert resolved.config.training["lr"] == pytest.approx(1e-3)
    assert resolved.config.scale.envs_per_runner == 4
    assert resolved.explicit_keys == {"training.lr", "scale.envs_per_runner", "stop.env_steps"}


def test_profile_overlays_scale_and_hardware_and_set_wins():
    resolved = resolve_experiment(None, ["scale.env_runners=3"], profile="workstation-1gpu")
    assert resolved.config.hardware.gpus_per_learner == 1
    assert resolved.config.scale.env_runners == 3


def test_bad_override_is_refused():
    with pytest.raises(UserError, match="bad --set"):
        parse_override("training.lr")

"""Experiment files, profiles and --set: parsing and validation (no Ray)."""

from pathlib import Path

import pytest

from rlplatform.config.experiment import resolve_experiment
from rlplatform.config.files import parse_override
from rlplatform.errors import UserError

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


def test_speedups_is_one_switch_settable_with_set():
    assert resolve_experiment(None).config.speedups is True
    assert resolve_experiment(None, ["speedups=false"]).config.speedups is False


def test_run_configs_with_the_old_sampler_and_update_keys_still_load():
    from rlplatform.config.schema import validate

    assert validate({"scale": {"sampler": "rllib", "update": "lean", "env_runners": 2}}).speedups is False
    old = validate({"scale": {"sampler": "lean", "update": "lean"}})
    assert old.speedups is True and "sampler" not in old.scale.model_dump()


def test_unknown_key_names_the_closest_known_one():
    from rlplatform.config.schema import validate

    with pytest.raises(UserError, match=r"unknown key 'scale.env_runner' \(did you mean 'env_runners'\?\)"):
        validate({"scale": {"env_runner": 2}})


def test_the_default_experiment_and_the_profiles_are_found_from_any_directory(tmp_path, monkeypatch):
    """`python -m rlplatform train` run outside the project: the installed package finds its experiments."""
    monkeypatch.chdir(tmp_path)
    resolved = resolve_experiment(None, profile="workstation-1gpu")
    assert resolved.source.resolve() == (ROOT / "experiments" / "cartpole_ppo.yaml").resolve()
    assert resolved.config.hardware.gpus_per_learner == 1  # the profile was found too


def test_conv_layers_take_an_optional_padding_and_refuse_anything_else():
    from rlplatform.config.schema import validate

    nature = [[32, [8, 8], 4, "valid"], [64, [4, 4], 2, "valid"], [64, [3, 3], 1]]
    assert validate({"model": {"conv_filters": nature}}).model.conv_filters == nature
    for bad in ([[32, 8, 4, "full"]], [[32, 8, "valid"]], [[32, 8]]):
        with pytest.raises(UserError, match=r"model\.conv_filters = .*: layer 0: \[out_channels, kernel, stride\]"):
            validate({"model": {"conv_filters": bad}})

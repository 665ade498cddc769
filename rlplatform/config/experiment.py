"""Resolve an experiment: file < profile (scale + hardware) < --set overrides.

Returns the validated config and the set of keys the user fixed on the command line,
so that `--profile auto` never resizes what the user asked for explicitly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

from rlplatform.config.files import apply_override, deep_merge, parse_override, read_yaml
from rlplatform.config.schema import DEFAULT_PROFILE, ExperimentConfig, validate
from rlplatform.errors import UserError

PROJECT_ROOT = Path(__file__).resolve().parents[2]  # the checkout: rlplatform/config/experiment.py
DEFAULT_EXPERIMENT = "experiments/cartpole_ppo.yaml"
PROFILE_SECTIONS = ("scale", "hardware")


@dataclass
class ResolvedExperiment:
    config: ExperimentConfig
    source: Path
    explicit_keys: set[str] = field(default_factory=set)  # dotted keys given with --set
    given_keys: set[str] = field(default_factory=set)  # dotted keys the file, the profile or --set give


def default_experiment_path() -> Path:
    for root in (Path.cwd(), PROJECT_ROOT):
        candidate = root / DEFAULT_EXPERIMENT
        if candidate.is_file():
            return candidate
    raise UserError(f"no experiment given and the default {DEFAULT_EXPERIMENT} was not found")


def profile_dirs(experiment_path: Path) -> list[Path]:
    dirs = [experiment_path.parent / "profiles", Path.cwd() / "experiments" / "profiles", PROJECT_ROOT / "experiments" / "profiles"]
    unique: list[Path] = []
    for d in dirs:
        if d.resolve() not in [u.resolve() for u in unique]:
            unique.append(d)
    return unique


def available_profiles(experiment_path: Path) -> list[str]:
    names = {DEFAULT_PROFILE}
    for d in profile_dirs(experiment_path):
        names.update(p.stem for p in d.glob("*.yaml"))
    return sorted(names)


def load_profile(name: str, experiment_path: Path) -> dict[str, Any]:
    as_path = Path(name)
    if as_path.suffix in (".yaml", ".yml"):
        candidates = [as_path]
    else:
        candidates = [d / f"{name}.yaml" for d in profile_dirs(experiment_path)]
    for candidate in candidates:
        if candidate.is_file():
            data = read_yaml(candidate, what="profile")
            extra = sorted(set(data) - set(PROFILE_SECTIONS))
            if extra:
                raise UserError(f"profile {candidate}: only {' and '.join(PROFILE_SECTIONS)} may be set, not {extra[0]!r}")
            return data
    known = ", ".join(available_profiles(experiment_path))
    raise UserError(f"unknown profile {name!r}; known: {known}")


def resolve_experiment(
    path: Optional[Path],
    overrides: Sequence[str] = (),
    profile: Optional[str] = None,
) -> ResolvedExperiment:
    source = path if path is not None else default_experiment_path()
    data = read_yaml(source)
    parsed = [parse_override(text) for text in overrides]
    for keys, value in parsed:
        apply_override(data, keys, value)
    if profile is not None:
        data["profile"] = profile
    profile_name = data.get("profile", DEFAULT_PROFILE)
    if not isinstance(profile_name, str):
        raise UserError(f"{source}: profile = {profile_name!r}: must be a profile name")
    if profile_name != DEFAULT_PROFILE:
        data = deep_merge(data, load_profile(profile_name, source))
        for keys, value in parsed:  # the command line wins over the profile
            apply_override(data, keys, value)
    data.setdefault("name", source.stem.replace("_", "-"))
    config = validate(data, source=str(source))
    return ResolvedExperiment(config=config, source=source, explicit_keys={".".join(k) for k, _ in parsed},
                              given_keys=set(_dotted_keys(data)))


def _dotted_keys(data: dict[str, Any], prefix: str = "") -> Iterator[str]:
    for key, value in data.items():
        yield prefix + str(key)
        if isinstance(value, dict):
            yield from _dotted_keys(value, f"{prefix}{key}.")

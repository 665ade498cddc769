"""Bad input at random (hypothesis): mutated experiment files, garbage files and `--set` values never give a traceback.

Every example either resolves (exit 0) or is refused with exit 2 and one line `error: ...`, and a refused config
creates no run directory. The CLI runs in this process, and no Ray starts: each example runs with `--print-config`
(which writes nothing), and only an example refused there runs again without it (`local_ray.connect` is replaced,
so a refusal that came too late could not start Ray either). One test runs the real process on fixed nasty inputs.

Hunting: `RLPLATFORM_FUZZ_SCALE=20 python -m pytest tests/test_bad_input_property.py` runs 20 times the examples.
"""

from __future__ import annotations

import contextlib
import copy
import io
import math
import os
import re
import subprocess
import traceback
from pathlib import Path
from typing import Any, Callable, get_args
from unittest import mock

import yaml
from conftest import ROOT, assert_user_error, run_cli
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from rlplatform import cli
from rlplatform.config.files import load_yaml_text
from rlplatform.config.schema import ExperimentConfig
from rlplatform.infra import local_ray

EXPERIMENTS = sorted((ROOT / "experiments").glob("*.yaml"))
DEFAULT = ROOT / "experiments" / "cartpole_ppo.yaml"
PARSED = {path: load_yaml_text(path.read_text()) for path in EXPERIMENTS}
SCALE = float(os.environ.get("RLPLATFORM_FUZZ_SCALE", "1"))


def fuzz(examples: int) -> settings:
    return settings(max_examples=max(1, round(examples * SCALE)), deadline=None, database=None, print_blob=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                           HealthCheck.data_too_large, HealthCheck.large_base_example])


# --- the CLI in this process ----------------------------------------------------------------------------------

def run_train(*args: Any) -> tuple[int, str, str]:
    """`rlplatform train ARGS` in this process: (exit code, stdout, stderr). Any other exception escapes: a bug."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main(["train", *map(str, args)])
        except SystemExit as exc:  # argparse's own refusals end this way, as in the real process
            code = exc.code
    return code, out.getvalue(), err.getvalue()


def _no_ray(*_: Any, **__: Any) -> None:
    raise AssertionError("a config that --print-config refuses got as far as starting Ray")


def check_cli(experiment: Path, options: list[str], runs: Path) -> int:
    """The property: exit 0, or exit 2 with one `error:` line; never a traceback; never a run directory."""
    args = [experiment, "--runs-dir", runs, *options]
    code, out, err = run_train(*args, "--print-config")
    seen = f"exit {code}\nstdout: {out[-1500:]!r}\nstderr: {err[-1500:]!r}"
    assert code in (0, 2), seen
    assert "Traceback" not in out + err, seen
    if code == 2:
        assert_user_error(subprocess.CompletedProcess(args, code, out, err))
        with mock.patch.object(local_ray, "connect", _no_ray):  # the same refusal without --print-config
            again = run_train(*args)
        assert again == (2, "", err), (again, seen)
    elif not out.startswith("usage:"):  # (`--set -h` asks argparse for help) what --print-config shows is what a
        ExperimentConfig.model_validate(load_yaml_text(out))  # run's config.yaml holds: `train --resume` reads it back
    assert not runs.exists(), sorted(runs.rglob("*"))
    return code


def each_one(check: Callable[[Any], None], inputs: list[Any]) -> None:
    """`check` every input; then fail with every input that failed, each with the end of its traceback."""
    failed = []
    for value in inputs:
        try:
            check(value)
        except Exception:  # an AssertionError of the property, or the traceback it forbids
            failed.append(f"{value!r:.300}\n{traceback.format_exc(limit=-4)}")
    assert not failed, f"{len(failed)} of {len(inputs)} inputs failed:\n\n" + "\n\n".join(failed)


# --- values ---------------------------------------------------------------------------------------------------

def dotted_fields(model: type[BaseModel] = ExperimentConfig, prefix: str = "") -> list[str]:
    keys = []
    for name, field in model.model_fields.items():
        keys.append(prefix + name)
        for annotation in (field.annotation, *get_args(field.annotation)):
            if isinstance(annotation, type) and issubclass(annotation, BaseModel):
                keys += dotted_fields(annotation, f"{prefix}{name}.")
    return keys


def file_keys(data: Any, prefix: str = "") -> list[str]:
    if not isinstance(data, dict):
        return []
    return [k for key, value in data.items() for k in (f"{prefix}{key}", *file_keys(value, f"{prefix}{key}."))]


# RLlib's own options, through the `rllib:` pass-through. Not its actor counts (num_env_runners, num_learners, ...):
# a huge one there skips our limits and makes planning build that many resource bundles (minutes, then memory).
RLLIB_KEYS = ["rllib.env_runners.rollout_fragment_length", "rllib.training.lr", "rllib.debugging.seed",
              "rllib.resources.num_cpus_for_main_process", "rllib.environment.env_config",
              "rllib.evaluation.evaluation_interval", "rllib.reporting.min_time_s_per_iteration"]
KNOWN_KEYS = sorted({*dotted_fields(), *(k for data in PARSED.values() for k in file_keys(data)), *RLLIB_KEYS})
FIELD_NAMES = sorted({part for key in KNOWN_KEYS for part in key.split(".")})

ODD_TEXT = st.sampled_from([
    "", " ", "\t", "\x00", "\x07", "\x1b[31m", "\r", "a\nb", "\u0085", "\u2028", "\u202e", "\ufeff", "\ufffe", "\uffff",
    "\U0010ffff", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢", "日本語", "🙂", "Ǆ", "x" * 300, "null", "~", "yes", "off", ".nan", "-.inf", "0x1F", "1_000",
    "2001-12-14", "12:30:45", "<<", "&a", "*a", "!!python/object:os.system", "{", "[", "'", '"', "#", ": ", "- ", "%YAML 1.1",
    "---", "...", "CartPole-v1", "rlplatform/Pursuit-v0", "ale_py:ALE/Pong-v5", ".x:y", "os:CartPole-v1", "a:b:c", "PPO", "sac",
    "auto", "laptop", "../profiles/laptop.yaml", "experiments/profiles/laptop.yaml", "/", "..", "a/b", "-", "-h",
])
TEXT = st.one_of(st.text(max_size=20), ODD_TEXT, st.text(st.characters(min_codepoint=0x80), max_size=8))
INTEGER = st.one_of(st.integers(), st.integers(-3, 3), st.sampled_from([10**30, -10**30, 2**31, 2**32, 2**63, 2**64, -2**63, 10**400]))
FLOAT = st.one_of(st.floats(), st.sampled_from([math.nan, math.inf, -math.inf, 5e-324, 1e-300, 1e-5, 1e308, -0.0, 0.5]))
SCALAR = st.one_of(st.none(), st.booleans(), INTEGER, FLOAT, TEXT, st.dates(), st.datetimes(), st.binary(max_size=8),
                   st.sets(st.integers(-2, 2), max_size=3))
KEY = st.one_of(st.sampled_from(FIELD_NAMES), TEXT, st.integers(-2, 2), INTEGER, st.booleans(), st.none(), FLOAT)
NESTED = st.recursive(SCALAR, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(KEY, inner, max_size=3),
                      max_leaves=8)
# Nesting deeper than any sane file; written as YAML text (a Python value this deep would not dump).
DEEP_TOKEN = re.compile(r"zzdeep(\d+)([lm])zz")
DEEP = st.builds("zzdeep{}{}zz".format, st.integers(20, 300), st.sampled_from("lm"))
# Fresh objects each time: the mutations below change values in place.
VALUE = st.one_of(NESTED, DEEP, st.sampled_from([{}, [], [[]], {"a": {}}])).map(copy.deepcopy)


DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)  # libyaml's when there: the same YAML, faster


def deep_text(match: re.Match) -> str:
    depth = int(match.group(1))
    return "[" * depth + "]" * depth if match.group(2) == "l" else "{a: " * depth + "1" + "}" * depth


def to_text(value: Any, flow: bool | None = False, unicode: bool = True) -> str:
    text = yaml.dump(value, Dumper=DUMPER, sort_keys=False, default_flow_style=flow, allow_unicode=unicode, width=10**6)
    return DEEP_TOKEN.sub(deep_text, text)


def flow_text(value: Any) -> str:
    """A value as one flow-style YAML text, as one would write it after `--set KEY=`."""
    return to_text(value, flow=True).removesuffix("\n").removesuffix("\n...")


# --- mutated experiment files ---------------------------------------------------------------------------------

def slots(node: Any) -> list[tuple[Any, Any]]:
    """(container, key) for every value in a tree of dicts and lists."""
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    return [slot for key, value in list(items) for slot in ((node, key), *slots(value))]


@st.composite
def mutated_experiments(draw) -> tuple[str, str]:
    source = draw(st.sampled_from(EXPERIMENTS))
    data: Any = copy.deepcopy(PARSED[source])
    for _ in range(draw(st.integers(1, 3))):
        everything = slots(data)
        in_dicts = [(c, k) for c, k in everything if isinstance(c, dict)]
        dicts = ([data] if isinstance(data, dict) else []) + [c[k] for c, k in everything if isinstance(c[k], dict)]
        op = draw(st.sampled_from(["replace", "replace", "replace", "delete", "add", "rename", "root"]))
        if op == "replace" and everything:
            container, key = everything[draw(st.integers(0, len(everything) - 1))]
            container[key] = draw(VALUE)
        elif op == "delete" and in_dicts:
            container, key = in_dicts[draw(st.integers(0, len(in_dicts) - 1))]
            del container[key]
        elif op == "add" and dicts:
            dicts[draw(st.integers(0, len(dicts) - 1))][draw(KEY)] = draw(VALUE)
        elif op == "rename" and in_dicts:
            container, key = in_dicts[draw(st.integers(0, len(in_dicts) - 1))]
            container[draw(KEY)] = container.pop(key)
        elif op == "root":
            data = draw(VALUE)
    text = to_text(data, flow=draw(st.sampled_from([False, None, True])), unicode=draw(st.booleans()))
    return source.stem, text


# Found by this test (a traceback in rlplatform/config/layouts.py): hypothesis tries it first, every run.
@example(case=("cartpole_ppo", "env_config: {x: {1: a, b: c}}\n"))
# Found by this test (a traceback where gymnasium built the external Box): a bound that is no array of numbers.
@example(case=("cartpole_external_ppo", "env: external\nexternal:\n  observation_space: {type: Box, shape: [4], "
                                        "low: [[], 0, 0, 0], high: 1}\n  action_space: {type: Discrete, n: 2}\n"))
@fuzz(80)
@given(case=mutated_experiments())
def test_mutated_experiment_files(case, tmp_path):
    stem, text = case
    experiment = tmp_path / f"{stem}.yaml"
    experiment.write_text(text, encoding="utf-8")
    check_cli(experiment, [], tmp_path / "runs")


# --- whole files that are no experiment -----------------------------------------------------------------------

def billion_laughs(levels: int, width: int) -> str:
    lines = ["a0: &a0 [lol]"] + [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * width)}]" for i in range(1, levels)]
    return "\n".join(lines) + f"\nenv_config: {{x: *a{levels - 1}}}\n"


def alias_chain(depth: int) -> str:
    return "\n".join(["a0: &a0 [1]"] + [f"a{i}: &a{i} [*a{i - 1}]" for i in range(1, depth)]) + f"\nenv_config: {{x: *a{depth - 1}}}\n"


FIXED_FILES = [
    b"", b"\n\n", b"# only a comment\n", b"---\n", b"...\n", b"~\n", b"[]\n", b"- a\n- b\n", b"42\n", b"hello\n", b"''\n",
    b"\xef\xbb\xbfseed: 1\n", b"\xff\xfe", b"\xfe\xffseed", b"seed: \xc3\x28\n", b"\x00\x01\x02", b"\x80abc",
    b"seed: 1\n---\nseed: 2\n", b"a: 1\n  b: 2\n", b"\tseed: 1\n", b"seed: [1\n", b"{seed: 1\n", b"seed: 1\nseed: 2\n",
    b"? [a, b]\n: 1\n", b"env_config: {[a]: 1}\n", b"<<: *nothing\n", b"<<: [1, 2]\n", b"a: &a 1\n<<: *a\n",
    b"env_config: &x {a: *x}\n", b"env_config: &x [*x]\n", b"model: &m {hidden: *m}\n", b"&r {a: *r}\n", b"&r [*r]\n",
    b"seed: 2001-13-45\n", b"seed: 0000-01-01\n", b"seed: 2001-01-01 25:00:00\n", b"seed: 2001-01-01 01:00:00 +99:00\n",
    b"seed: !!int abc\n", b"seed: !!float abc\n", b"seed: !!timestamp yesterday\n", b"seed: !!binary '@@'\n",
    b"seed: !!python/object/apply:os.system ['echo hi']\n", b"seed: !!set {1, 2}\n", b"seed: !!omap [a: 1]\n",
    b"seed: !custom 1\n", b"%YAML 9.9\n---\nseed: 1\n", b"%TAG ! tag:example.com,2000:\n---\nseed: !x 1\n",
    b"seed: " + b"9" * 5000 + b"\n", b"seed: 0x" + b"f" * 5000 + b"\n", b"seed: -0b" + b"1" * 20000 + b"\n",
    b"seed: 1" + b":59" * 3000 + b"\n", b"stop: {return_mean: " + b"9" * 5000 + b".0}\n",
    b"name: " + b"x" * 20_000 + b"\n", b"x" * 20_000 + b": 1\n", b"env_config: {" + b", ".join(b"k%d: 1" % i for i in range(300)) + b"}\n",
    b"[" * 1000, b"env_config: " + b"{a: " * 5000 + b"1" + b"}" * 5000 + b"\n",
    b"stop: {return_mean: .nan}\n", "🙂: 1\n".encode(), "träining: {lr: 0.1}\n".encode(), "name: cartpole\u2028ppo\n".encode(),
    billion_laughs(9, 9).encode(), billion_laughs(3, 50).encode(), alias_chain(300).encode(),
]


def test_fixed_nasty_files(tmp_path):
    experiment = tmp_path / "nasty.yaml"

    def check(content: bytes) -> None:
        experiment.write_bytes(content)
        check_cli(experiment, [], tmp_path / "runs")

    each_one(check, FIXED_FILES)


@st.composite
def garbage_files(draw) -> bytes:
    source = draw(st.sampled_from(EXPERIMENTS)).read_bytes()
    choice = draw(st.integers(0, 9))
    if choice == 0:
        return draw(st.binary(max_size=300))
    if choice == 1:  # a valid file cut short, or with bytes spliced in
        cut = draw(st.integers(0, len(source)))
        return source[:cut] + draw(st.binary(max_size=8)) + source[cut + draw(st.integers(0, 16)):]
    if choice == 2:  # a valid file with text spliced in at a random place
        cut = draw(st.integers(0, len(source)))
        return source[:cut] + draw(st.one_of(TEXT, st.sampled_from(list(":-[]{}&*!|>'\"#%@`,?\n\t ")))).encode() + source[cut:]
    if choice == 3:  # a valid file in another encoding
        return source.decode().encode(draw(st.sampled_from(["utf-16", "utf-16-le", "utf-32", "utf-8-sig", "latin-1", "cp1252"])))
    if choice == 4:  # nesting deeper than any sane file, block or flow
        depth, kind = draw(st.integers(50, 300)), draw(st.sampled_from("lmb"))
        if kind == "b":
            return ("env_config:\n" + "".join(" " * (i + 1) + "a:\n" for i in range(depth)) + " " * (depth + 1) + "1\n").encode()
        return ("env_config: {x: " + deep_text(DEEP_TOKEN.match(f"zzdeep{depth}{kind}zz")) + "}\n").encode()
    if choice == 5:
        return billion_laughs(draw(st.integers(1, 10)), draw(st.integers(1, 12))).encode()
    if choice == 6:
        return alias_chain(draw(st.integers(1, 300))).encode()
    return to_text(draw(VALUE), flow=draw(st.sampled_from([False, None, True]))).encode()  # any YAML at the top


@fuzz(60)
@given(content=garbage_files())
def test_garbage_experiment_files(content, tmp_path):
    experiment = tmp_path / "garbage.yaml"
    experiment.write_bytes(content)
    check_cli(experiment, [], tmp_path / "runs")


# --- --set KEY=VALUE ------------------------------------------------------------------------------------------

SET_KEY = st.one_of(
    st.sampled_from(KNOWN_KEYS), st.sampled_from(KNOWN_KEYS),  # twice: a known key, more often
    st.lists(st.one_of(st.sampled_from(FIELD_NAMES), st.text(max_size=6)), min_size=1, max_size=4).map(".".join),
    st.text(max_size=12),
)
ODD_VALUES = [
    "2001-13-45", "0000-01-01", "2001-01-01 25:00:00", "!!int abc", "!!float abc", "!!timestamp x", "!!binary '@@'",
    "!!python/object/apply:os.system ['echo hi']", "!!set {1, 2}", "!!omap [a: 1]", "!x 1", "9" * 5000, "-" + "9" * 5000,
    "0x" + "f" * 5000, "1" + ":59" * 3000, "&a [*a]", "&a {b: *a}", "*undefined", "{a: 1, a: 2}", "? [a]\n: 1", "[1",
    "{a: 1", "a: b: c", "- 1\n- 2", "a\n---\nb", "'", '"', "%", "@", "`", "|\n  text", ">\n  folded", "\t1", "1e400", "-1e400",
    ".nan", ".inf", "-.inf", "1e-400", "0o17", "0b101", "1_0", "+1", "-0", "NaN", "nan", "inf", "Infinity",
]
SET_VALUE = st.one_of(NESTED.map(flow_text), DEEP.map(flow_text), TEXT, st.sampled_from(ODD_VALUES))


@st.composite
def set_options(draw) -> list[str]:
    options = []
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.integers(0, 9))
        text = draw(TEXT) if kind == 0 else f"{draw(SET_KEY)}={draw(SET_VALUE)}"  # sometimes no `=` at all
        options += [f"--set={text}"] if kind < 8 else ["--set", text]  # the second form lets argparse see `-...`
    return options


FIXED_SETS = [f"seed={value}" for value in ODD_VALUES] + [
    "seed=" + "[" * 99 + "]" * 99, "env_config.x=" + "[" * 98 + "]" * 98, "training.lr=" + "{a: " * 200 + "1" + "}" * 200,
    "training.a\nb=1", "rllib.a\nb={}", "rllib.training={a\u2028b: 1}", "multi_agent.policies=[{a: 1}]",
    "hardware.cpus_per_env_runner=5e-324", "hardware.driver_cpus=.inf", "scale.env_runners=" + str(10**30),
    "scale.learners=100001", "seed=-1", "seed=4294967296", "=1", "a..b=1", ".=1", "x", "", "name=a/b", "name=..",
    "profile=\"a\\0b.yaml\"", "profile=../../../../etc/passwd.yaml", "env=.x:y", "env=\x00:CartPole-v1",
    "training.grad_clip_by=",  # hypothesis found it: RLlib's setter raised a ValueError before its checks ran
    "scale.algorithm_in=elsewhere", "scale.learners=2", "scale.aggregators_per_learner=1",
]
# Found by hypothesis on the APPO preset (remote runners: the numpy policy's env check sorted mixed-type keys).
FIXED_APPO_SETS = ["env_config.N={N: null, 0: null}", "env_config={1: a, b: 2}"]


def test_fixed_nasty_set_values(tmp_path):
    each_one(lambda option: check_cli(DEFAULT, [f"--set={option}"], tmp_path / "runs"), FIXED_SETS)
    appo = ROOT / "experiments" / "cartpole_appo.yaml"
    each_one(lambda option: check_cli(appo, [f"--set={option}"], tmp_path / "runs"), FIXED_APPO_SETS)


# Found by this test (tracebacks in rlplatform/adapter and config/layouts.py): hypothesis tries them first, every run.
@example(experiment=DEFAULT, options=["--set=algorithm.\x1e0=null"])  # a record separator: splitlines() breaks there
@example(experiment=DEFAULT, options=["--set=rllib.environment.env_config=233"])
@example(experiment=DEFAULT, options=["--set=rllib.env_runners.rollout_fragment_length=-3"])
@example(experiment=DEFAULT, options=["--set=rllib.resources.num_cpus_for_main_process=null"])
@example(experiment=DEFAULT, options=["--set=training.entropy_coeff=[[.inf], [.inf]]"])
@example(experiment=DEFAULT, options=["--set=env_config.x={1: a, b: c}"])
@fuzz(80)
@given(experiment=st.sampled_from(EXPERIMENTS), options=set_options())
def test_random_set_overrides(experiment, options, tmp_path):
    check_cli(experiment, options, tmp_path / "runs")


# --- the real process -----------------------------------------------------------------------------------------

def test_real_process_refuses_nasty_input_in_one_line(tmp_path):
    runs = tmp_path / "runs"
    nasty = {
        "binary.yaml": bytes(range(256)) * 4,
        "nan_return.yaml": b"env: CartPole-v1\nstop: {return_mean: .nan, env_steps: 1000}\n",
        "unicode_key.yaml": "env: CartPole-v1\ntr\u00e4ining\u202e: {lr: 0.1}\n".encode(),
    }
    for name, content in nasty.items():
        experiment = tmp_path / name
        experiment.write_bytes(content)
        line = assert_user_error(run_cli("train", experiment, "--runs-dir", runs, "--print-config", timeout=120))
        assert str(experiment) in line, line
    # Without --print-config too (a file that is no text can never go on to train): no run directory.
    assert_user_error(run_cli("train", tmp_path / "binary.yaml", "--runs-dir", runs, timeout=120), "UTF-8")
    assert not runs.exists()

"""Ray Jobs helpers (no Ray): the job's shell command, run through a real shell to see what arrives, and
finding the run directory in a job's log."""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

import pytest

from rlplatform.infra.jobs import run_dir_from_logs, train_entrypoint

# Ray's job supervisor runs the entrypoint with `shell=True` (/bin/sh); users paste it into bash.
SHELLS = ["sh", "bash"]
NASTY = [
    "name=two words",
    "training.lr=1e-3",
    'note="double quoted"',
    "note='single quoted'",
    "note=it's",
    "note=$(touch PWNED)",
    "note=`touch PWNED`",
    "note=$HOME and ${HOME}",
    "note=a;touch PWNED",
    "note=a && touch PWNED | cat > PWNED",
    "note=*",
    "note=back\\slash",
    "note=line\nbreak",
    "note=tab\there",
    "note=",
    "note=~",
    "model.hidden=[64, 64]",
    "env_config={a: 1, 'b': \"2\"}",
    "-note=leading dash",
]


@pytest.fixture
def fake_python(tmp_path: Path) -> Path:
    """An executable that prints each argument it gets, NUL-terminated (arguments may hold newlines)."""
    folder = tmp_path / "py dir $(x)"  # the interpreter's own path needs quoting too
    folder.mkdir()
    script = folder / "python"
    script.write_text("#!/bin/sh\nprintf '%s\\0' \"$@\"\n")
    script.chmod(0o755)
    return script


@pytest.fixture
def home(tmp_path: Path) -> Path:
    """A HOME that breaks on word splitting or a second expansion."""
    path = tmp_path / "home dir $USER `x`"
    path.mkdir()
    return path


def arrived(shell: str, entrypoint: str, home: Path, cwd: Path) -> list[str]:
    out = subprocess.run([shell, "-c", entrypoint], cwd=cwd, env={"HOME": str(home), "PATH": "/usr/bin:/bin", "USER": "u"},
                         capture_output=True, timeout=30)
    assert out.returncode == 0, out.stderr
    return out.stdout.decode().split("\0")[:-1]


@pytest.mark.parametrize("shell", SHELLS)
def test_every_argument_arrives_as_given(shell, fake_python, home, tmp_path):
    workdir = tmp_path / "work"
    workdir.mkdir()
    entrypoint = train_entrypoint(str(fake_python), "experiments/my exp's.yaml", NASTY, "my profile.yaml",
                                  "10.0.0.1:6379", "runs dir/$(touch PWNED)")
    sets = [arg for override in NASTY for arg in ("--set", override)]
    assert arrived(shell, entrypoint, home, workdir) == [
        "-m", "rlplatform", "train", "experiments/my exp's.yaml", *sets, "--profile", "my profile.yaml",
        "--address", "10.0.0.1:6379", "--runs-dir", "runs dir/$(touch PWNED)",
    ]
    assert not list(workdir.iterdir())  # nothing ran: no PWNED file, no redirection


@pytest.mark.parametrize("shell", SHELLS)
@pytest.mark.parametrize("runs_dir,expected", [
    ("$HOME/runs", "{home}/runs"),
    ("$HOME/a $(echo x)/b", "{home}/a $(echo x)/b"),  # only the leading $HOME is the shell's
    ("$HOME/$HOME/`echo x`", "{home}/$HOME/`echo x`"),
    ("$HOME/", "{home}/"),
    ("runs", "runs"),
    ("/abs/$HOME/runs", "/abs/$HOME/runs"),
    ("$HOMEX/runs", "$HOMEX/runs"),
    ("$HOME", "$HOME"),  # no slash after it: a name like any other
    ("~/runs", "~/runs"),  # a tilde is not expanded
    ("${HOME}/runs", "${HOME}/runs"),
])
def test_a_leading_home_in_the_runs_dir_is_the_heads_home(shell, runs_dir, expected, fake_python, home, tmp_path):
    entrypoint = train_entrypoint(str(fake_python), None, [], None, "auto", runs_dir)
    args = arrived(shell, entrypoint, home, tmp_path)
    assert args == ["-m", "rlplatform", "train", "--address", "auto", "--runs-dir", expected.replace("{home}", str(home))]


def test_the_entrypoint_reads_as_the_cli_parses_it():
    """What `ray job submit` shows and a user might paste: our own CLI parses it back to the same values."""
    from rlplatform.cli import build_parser

    entrypoint = train_entrypoint("python", "experiments/cartpole_ppo.yaml", ["training.lr=1e-3", "name=a b"],
                                  "laptop", "auto", "/tmp/runs")
    argv = shlex.split(entrypoint)
    assert argv[:3] == ["python", "-m", "rlplatform"]
    args = build_parser().parse_args(argv[3:])
    assert args.verb == "train" and args.overrides == ["training.lr=1e-3", "name=a b"]
    assert (str(args.experiment), args.profile, args.address, str(args.runs_dir)) == (
        "experiments/cartpole_ppo.yaml", "laptop", "auto", "/tmp/runs")


def test_no_experiment_and_no_profile_leave_them_out():
    assert shlex.split(train_entrypoint("python", None, [], None, "1.2.3.4:6379", "runs")) == [
        "python", "-m", "rlplatform", "train", "--address", "1.2.3.4:6379", "--runs-dir", "runs"]


# --- run_dir_from_logs ------------------------------------------------------------------------------------

def test_the_run_directory_is_the_last_one_the_log_names():
    logs = (
        "rlplatform PPO on CartPole-v1: 1 env runner(s) ...\n"
        "run directory: /home/ray/runs/cartpole-ppo/2026-01-01_00-00-00\n"
        "it    1  steps     1,000  return    20.00\n"
        "stopped: iterations 2 >= 2 after 10.0 s\n"
        "run directory: /home/ray/runs/cartpole-ppo/2026-01-01_00-00-00   \n"
        "TensorBoard: tensorboard --logdir /home/ray/runs/cartpole-ppo/2026-01-01_00-00-00\n"
    )
    assert run_dir_from_logs(logs) == "/home/ray/runs/cartpole-ppo/2026-01-01_00-00-00"
    assert run_dir_from_logs("run directory: runs/a\nrun directory: runs/b\n") == "runs/b"


def test_a_run_directory_with_spaces_and_windows_line_ends():
    assert run_dir_from_logs("x\r\nrun directory: /runs/my exp/2026 01\r\nmore\r\n") == "/runs/my exp/2026 01"


def test_only_a_line_that_starts_with_it_counts():
    assert run_dir_from_logs("") is None
    assert run_dir_from_logs("job failed before training\nerror: unknown key 'x'\n") is None
    assert run_dir_from_logs("  run directory: /indented\nsee the run directory: /quoted\n") is None
    assert run_dir_from_logs("run directory: /last-line-without-newline") == "/last-line-without-newline"

"""Console lines: user text (paths, commands, --set values) is printed as written, never as rich markup."""

from types import SimpleNamespace

from rlplatform import console
from rlplatform.run import progress


def test_plain_lines_keep_brackets():
    with console.stdout.capture() as captured:
        console.say("job submitted: python -m rlplatform train --set 'multi_agent.policies=[pursuer, evader]'")
        console.say("run directory: runs/[/x]/2026")  # closing tag without an opening one: rich would raise
    assert captured.get().splitlines() == [
        "job submitted: python -m rlplatform train --set 'multi_agent.policies=[pursuer, evader]'",
        "run directory: runs/[/x]/2026",
    ]


def test_the_start_line_escapes_the_env_and_the_cluster():
    scale = SimpleNamespace(learners=0, env_runners=0, envs_per_runner=8, vectorize="sync")
    config = SimpleNamespace(scale=scale, hardware=SimpleNamespace(gpus_per_learner=0), algorithm="PPO", env="my[/odd]:Env-v0",
                             external=None, data=None)
    with console.stdout.capture() as captured:
        progress.print_start("runs/[x]", config, "2 CPUs")
    lines = captured.get().splitlines()
    assert lines[0].startswith("rlplatform PPO on my[/odd]:Env-v0: sampling in the main process"), lines
    assert lines[1] == "run directory: runs/[x]"


def test_missing_numbers_print_as_a_dash():
    assert console.fmt(None, ".1f") == "-" and console.fmt(1234.5, ",.0f") == "1,234"

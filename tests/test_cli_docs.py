"""docs/cli.md against the real parser (`rlplatform.cli.build_parser()`): every verb, flag and default.

The convention the doc keeps (and states at its top):
- every verb and sub-verb has a section whose heading is its name (`## train`, `### bench soak`); the
  section runs to the next heading of any level;
- in that section, a table row (`| flag | default | what |`) per flag: the first cell names the flag's option
  strings in backticks, the second starts with the argparse default (`runs`, `6006`, `1 2 4 8 16 32`) where that
  default is not None, False or empty; a positional argument with such a default has a row too (its metavar);
- the synopsis block at the top has a `python -m rlplatform VERB ...` line for every verb that runs something,
  naming each of its flags.
Flags are looked for in their own verb's section, not anywhere in the file; a documented flag the verb does not
have fails too. Quick: the parser only (no Ray, no training).
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from rlplatform.cli import build_parser

DOC = Path(__file__).resolve().parents[1] / "docs" / "cli.md"
ROOT_HEADING = "Command-line reference"  # the doc's title: the section of `python -m rlplatform`'s own flags
SYNOPSIS_PREFIX = "python -m rlplatform"
OPTION = re.compile(r"(?<![\w-])(--?[A-Za-z][\w-]*)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*$")
CELL_SPLIT = re.compile(r"(?<!\\)\|")


def verb_parsers() -> dict[str, argparse.ArgumentParser]:
    """Every parser of the CLI by its verb path: "" (the program), "train", "bench", "bench soak", ..."""
    found: dict[str, argparse.ArgumentParser] = {}

    def walk(path: str, parser: argparse.ArgumentParser) -> None:
        found[path] = parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(f"{path} {name}".strip(), sub)

    walk("", build_parser())
    return found


def flags(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.option_strings and not isinstance(a, argparse._HelpAction)]


def runs_something(parser: argparse.ArgumentParser) -> bool:
    return not any(isinstance(a, argparse._SubParsersAction) for a in parser._actions)


def sections(text: str) -> dict[str, list[str]]:
    """Heading text (backticks dropped) -> the lines up to the next heading of any level (code blocks skipped)."""
    out: dict[str, list[str]] = {}
    current = None
    in_code = False
    for line in text.splitlines():
        if line.startswith("```"):
            in_code = not in_code
        match = None if in_code else HEADING.match(line)
        if match:
            current = match.group(2).replace("`", "").strip()
            assert current not in out, f"docs/cli.md has two sections headed {current!r}"
            out[current] = []
        elif current is not None:
            out[current].append(line)
    return out


def table_rows(lines: list[str]) -> list[tuple[str, str]]:
    """(first cell, second cell) of every table row that is not a header or separator line."""
    rows = []
    for line in lines:
        if not line.startswith("|"):
            continue
        cells = [c.strip() for c in CELL_SPLIT.split(line.strip().strip("|"))]
        if len(cells) < 2 or set(cells[0]) <= set("-: ") or cells[1] == "default":
            continue
        rows.append((cells[0], cells[1]))
    return rows


def options_in(cell: str) -> set[str]:
    """Option strings named in backticks in a table cell or synopsis text."""
    return {opt for span in re.findall(r"`([^`]*)`", cell) for opt in OPTION.findall(span)}


def rendered(default) -> str:
    if isinstance(default, (list, tuple)):
        return " ".join(rendered(v) for v in default)
    if isinstance(default, float):
        return format(default, "g")
    return str(default)


def checked_default(action: argparse.Action) -> bool:
    d = action.default
    return not (d is None or d is False or d == argparse.SUPPRESS or (isinstance(d, (list, tuple)) and not d))


def starts_with_value(cell: str, value: str) -> bool:
    """The default cell, backticks dropped, begins with the value as a whole word (`runs`, `6006 (...)`)."""
    text = cell.replace("`", "").replace("\\|", "|").strip()
    return text == value or (text.startswith(value) and not re.match(r"[\w./-]", text[len(value)]))


def synopsis(text: str) -> dict[str, str]:
    """Verb path -> its synopsis lines joined, from the code block(s) of `python -m rlplatform VERB ...` lines."""
    verbs = verb_parsers()
    out: dict[str, str] = {}
    current = None
    in_code = False
    for line in text.splitlines():
        if line.startswith("```"):
            in_code, current = not in_code, None
            continue
        if not in_code:
            continue
        if line.startswith(SYNOPSIS_PREFIX + " "):
            words = line[len(SYNOPSIS_PREFIX):].split()
            path = ""
            for word in words:  # the longest run of words that names a verb
                if f"{path} {word}".strip() not in verbs:
                    break
                path = f"{path} {word}".strip()
            current = path
            out[current] = out.get(current, "") + " " + line[len(SYNOPSIS_PREFIX) + 1 + len(path):]
        elif current is not None and line.startswith(" "):
            out[current] += " " + line
        else:
            current = None
    return out


DOC_TEXT = DOC.read_text()
VERBS = verb_parsers()
SECTIONS = sections(DOC_TEXT)
SYNOPSIS = synopsis(DOC_TEXT)


def section_of(path: str) -> list[str]:
    heading = path or ROOT_HEADING
    assert heading in SECTIONS, f"docs/cli.md has no section headed `{heading}` (e.g. `## {heading}` or `### {heading}`)"
    return SECTIONS[heading]


@pytest.mark.parametrize("path", sorted(VERBS), ids=lambda p: p or "rlplatform")
def test_every_flag_of_the_verb_is_in_its_section_with_the_default_argparse_has(path):
    parser = VERBS[path]
    rows = table_rows(section_of(path))
    documented = {opt: default for first, default in rows for opt in options_in(first)}
    problems = []
    for action in flags(parser):
        named = [o for o in action.option_strings if o in documented]
        if not named:
            problems.append(f"{' / '.join(action.option_strings)} is not in a table row of the section")
        elif checked_default(action) and not starts_with_value(documented[named[0]], rendered(action.default)):
            problems.append(f"{named[0]}: argparse's default is {rendered(action.default)!r}, "
                            f"the doc's {documented[named[0]]!r}")
    for action in parser._actions:  # positional arguments with a default of their own
        if action.option_strings or isinstance(action, argparse._SubParsersAction) or not checked_default(action):
            continue
        name = action.metavar or action.dest.upper()
        cells = [default for first, default in rows if name in first.replace("`", "")]
        if not cells:
            problems.append(f"{name} (default {rendered(action.default)!r}) has no table row")
        elif not starts_with_value(cells[0], rendered(action.default)):
            problems.append(f"{name}: argparse's default is {rendered(action.default)!r}, the doc's {cells[0]!r}")
    known = {o for a in parser._actions for o in a.option_strings}
    problems += [f"{opt} is documented but `{path or 'rlplatform'}` has no such flag"
                 for opt in sorted(set(documented) - known)]
    assert not problems, f"docs/cli.md, section `{path or ROOT_HEADING}`:\n" + "\n".join(problems)


@pytest.mark.parametrize("path", sorted(p for p in VERBS if p and runs_something(VERBS[p])))
def test_the_synopsis_names_every_flag_of_the_verb(path):
    assert path in SYNOPSIS, f"docs/cli.md's synopsis has no `{SYNOPSIS_PREFIX} {path} ...` line"
    text = SYNOPSIS[path]
    named = set(OPTION.findall(text))
    parser = VERBS[path]
    missing = [" / ".join(a.option_strings) for a in flags(parser) if not named & set(a.option_strings)]
    known = {o for a in parser._actions for o in a.option_strings}
    unknown = sorted(named - known)
    assert not missing and not unknown, (f"docs/cli.md's synopsis of `{path}`: missing {missing}, "
                                         f"not flags of the verb {unknown}")


def test_the_checks_see_the_doc_and_every_verb():
    """The walk reaches the nested verbs, and the doc parses into sections and synopsis lines (else the tests
    above could pass on nothing)."""
    assert {"train", "tune", "evaluate", "bench learner", "bench scale", "envs check", "cluster submit"} <= set(VERBS)
    assert len(table_rows(section_of("train"))) >= 8 and "--resume" in SYNOPSIS["train"]
    assert starts_with_value("`runs`", "runs") and starts_with_value("6006 (if taken)", "6006")
    assert not starts_with_value("`runs2`", "runs") and not starts_with_value("`2.5`", "2")

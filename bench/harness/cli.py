"""The command line every question file shares: `python bench/<file>.py [<question>] [--option value ...]`.

A question is a function whose keyword arguments are its options and whose Google-style `Args:` are their help;
it returns an `Answer`. `main` prints the answer under `report.header` (the machine, the commit, the load) and, with
`--json PATH`, saves it with the raw readings; `--from_json PATH` prints a saved answer again and runs nothing.
"""

from __future__ import annotations

import argparse
import inspect
import json
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import report


@dataclass(frozen=True)
class Answer:
    """What a question found."""

    title: str
    """The first line of its header."""
    text: str
    """Its tables and checks, as printed (bench/run_report.py copies them into RESULTS.md)."""
    raw: Any = None
    """The readings behind them (JSON-able), saved by `--json`."""
    ok: bool = True
    """False: a run failed or a check did not pass (the exit code is 1)."""


Question = Callable[..., Answer]
TYPES = {"int": int, "float": float, "str": str, "Path": Path}


def main(*questions: Question, argv: list[str] | None = None, choices: dict[str, Sequence[Any]] | None = None) -> int:
    """Parses the command line of `questions` (one: no question name), runs the one asked and prints its answer.

    Args:
        questions: the file's questions; with more than one the first argument names it (the function's name).
        argv: the arguments (default: the process's).
        choices: the values allowed for an option, by its name, in every question that has it.

    Returns:
        The exit code: 0, or 1 when the answer is not ok.
    """
    doc = sys.modules[questions[0].__module__].__doc__ or ""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    if len(questions) == 1:
        _add_options(parser, questions[0], choices or {})
    else:
        named = parser.add_subparsers(dest="question", required=True)
        for question in questions:
            first = (question.__doc__ or "").split("\n")[0]
            _add_options(named.add_parser(question.__name__, help=first, description=first), question, choices or {})
    args = vars(parser.parse_args(argv))
    asked = args.pop("question", questions[0].__name__)
    question = next(q for q in questions if q.__name__ == asked)
    save, saved = args.pop("json"), args.pop("from_json")
    if saved is not None:
        record = json.loads(saved.read_text())
        print(f"{record['header']}\n\n{record['text']}")
        return 0
    facts = report.machine_facts()
    answer = question(**args)
    header = report.header(facts, answer.title)
    print(f"\n{header}\n\n{answer.text}", flush=True)
    if save is not None:
        payload = {"question": question.__name__, "args": args, "header": header, "text": answer.text}
        report.save_json(save, {**payload, "ok": answer.ok, "raw": answer.raw}, facts)
    return 0 if answer.ok else 1


def _add_options(parser: argparse.ArgumentParser, question: Question, choices: dict[str, Sequence[Any]]) -> None:
    """`--name` per keyword argument, typed by its default (or its annotation when the default is None): a tuple
    takes any number of values, a False default is a switch."""
    helps = _arg_help(question.__doc__ or "")
    for name, parameter in inspect.signature(question).parameters.items():
        default, annotation = parameter.default, str(parameter.annotation)
        text = helps.get(name, "").replace("%", "%%")
        options: dict[str, Any] = {
            "default": default,
            "help": text if default is None else f"{text} (default: {default})",
        }
        if isinstance(default, bool):
            options.update(action="store_true", help=text)
        else:
            inner = re.search(r"(?:list|tuple)\[(\w+)", annotation)
            kind = inner.group(1) if inner else annotation.split(" ")[0].split("[")[0]
            options["type"] = TYPES.get(kind, str)
            if isinstance(default, (list, tuple)):
                options["nargs"] = "*"
        if name in choices:
            options["choices"] = choices[name]
        parser.add_argument(f"--{name}", **options)
    parser.add_argument("--json", type=Path, default=None, help="save the answer and its raw readings here")
    parser.add_argument("--from_json", type=Path, default=None, help="print an answer saved with --json; run nothing")


def _arg_help(doc: str) -> dict[str, str]:
    """The `Args:` section of a Google-style docstring: {name: its description on one line}."""
    helps: dict[str, str] = {}
    section = doc.split("Args:", 1)[1] if "Args:" in doc else ""
    section = re.split(r"\n\s*\n|\n\s*(?:Returns|Raises):", section)[0]
    name, indent = None, 0
    for line in section.splitlines():
        match, depth = re.match(r"\s*(\w+): (.*)", line), len(line) - len(line.lstrip())
        if match and (name is None or depth <= indent):
            name, indent = match.group(1), depth
            helps[name] = match.group(2)
        elif name is not None and line.strip():
            helps[name] += " " + line.strip()
    return helps

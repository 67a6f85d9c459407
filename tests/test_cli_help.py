"""Every command's --help reads as written: argparse %-formats help strings but not descriptions
or epilogs, so an escape (`%%`) or a format field left in the wrong one shows up verbatim."""

from __future__ import annotations

import argparse
import re

import pytest

from kvledger.cli import COMMANDS, build_parser


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


@pytest.mark.parametrize("command", COMMANDS)
def test_help_shows_no_format_escapes(command):
    text = _subparsers()[command].format_help()
    assert "%%" not in text and not re.search(r"%\((\w+)\)s", text), text


def test_simulate_help_names_the_high_variance_mix():
    assert "90% 16-64 / 10% 256-512" in _subparsers()["simulate"].format_help()

"""`kvledger <command>`: one module per command in kvledger/commands, imported only when needed.

Contract for a command module: `add_parser(subparsers)` and `run(args) -> int`; keep heavy
imports (torch, transformers) inside `run`, since `kvledger --help` imports every module.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

from kvledger.errors import EngineDeadError, KVLedgerError

COMMANDS = ["plan", "generate", "simulate", "serve", "router", "doctor"]


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors, so bad flags read like every other kvledger error."""

    def error(self, message: str) -> None:  # type: ignore[override]
        _fail(f"{message} (see '{self.prog} --help')")
        raise SystemExit(2)


def _fail(message: str) -> int:
    print(f"kvledger: error: {' '.join(str(message).split())}", file=sys.stderr)
    return 2


def build_parser(commands: Sequence[str] = COMMANDS) -> argparse.ArgumentParser:
    parser = _Parser(
        prog="kvledger",
        description="An LLM inference engine with an exact, paged ledger of KV-cache memory.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in commands:
        importlib.import_module(f"kvledger.commands.{name}").add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # Import only the chosen command's module when the command is named up front.
    parser = build_parser([argv[0]] if argv and argv[0] in COMMANDS else COMMANDS)
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help (0) or a usage error (2), already printed
        return e.code if isinstance(e.code, int) else 0 if e.code is None else 2
    try:
        return importlib.import_module(f"kvledger.commands.{args.command}").run(args)
    except (KVLedgerError, EngineDeadError) as e:  # an engine core that could not start: one line
        return _fail(str(e))
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `kvledger plan --json | head`: stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1

"""The ``specsplit`` command line.

Each subcommand lives in its own module, imported only when that subcommand
runs (or its help is asked for): ``specsplit generate`` loads neither torch
nor ray.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import logging
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class Command:
    name: str
    help: str
    module: str  # has build_parser(parser) and run(args) -> exit code (None for 0)
    log_prefix: str | None = None  # log at --log-level with this prefix (else the module sets up its own, if any)
    quiet: bool = False  # log warnings and errors only


COMMANDS = (
    Command("serve-draft", "run the draft service", "draft_service.server"),
    Command("serve-target", "run the target service", "target_service.server"),
    Command("serve", "run the orchestrator (public Generate API); --ray: on Ray Serve", "orchestrator.server",
            "orchestrator"),
    Command("up", "on Ray: place draft and target by resources, serve the orchestrator", "ray_deploy.placement",
            "specsplit-up"),
    Command("batch", "generate for a JSONL file of prompts on Ray workers (resumable)", "ray_deploy.batch_job", quiet=True),
    Command("generate", "stream a completion from a running orchestrator", "specsplit.generate"),
    Command("demo", "start services on loopback and compare with target-only decoding", "bench.demo", quiet=True),
    Command("bench", "benchmark speculative vs target-only decoding, write JSON", "bench.speculative", quiet=True),
    Command("distill", "train a layer-skip exit adapter for a target (KL distillation)", "draft_service.distill"),
)
_BY_NAME = {command.name: command for command in COMMANDS}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The parser; with ``only``, just that subcommand's flags are built (its module alone is imported)."""
    parser = argparse.ArgumentParser(prog="specsplit", description="Speculative decoding split across devices.")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        p = sub.add_parser(command.name, help=command.help, description=command.help)
        if only is None or only == command.name:
            importlib.import_module(command.module).build_parser(p)
        p.set_defaults(command_spec=command)
    return parser


def _chosen(argv: list[str]) -> str | None:
    """The subcommand named on the command line (its first word that is one), else None."""
    return next((word for word in argv if word in _BY_NAME), None)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(_chosen(argv) or "").parse_args(argv)
    command: Command = args.command_spec
    if command.log_prefix is not None:
        logging.basicConfig(
            level=args.log_level.upper(), format=f"%(asctime)s {command.log_prefix} %(levelname)s %(message)s"
        )
    elif command.quiet:
        logging.basicConfig(level=logging.WARNING)
    from lmkit import errors

    try:
        code = importlib.import_module(command.module).run(args)
    except (ValueError, FileNotFoundError, errors.SpecsplitError) as exc:
        print(f"specsplit {command.name}: error: {exc}", file=sys.stderr)
        code = 2
    except KeyboardInterrupt:
        code = 130
    # Leave promptly: with torch, transformers or Ray loaded, the interpreter's last garbage collection
    # of their object graph takes seconds. Frozen objects are skipped; logs are flushed by logging's
    # atexit hook and the std streams by the interpreter, so nothing waits on that collection.
    gc.freeze()
    sys.exit(code or 0)


if __name__ == "__main__":
    main()

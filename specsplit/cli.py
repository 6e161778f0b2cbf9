"""The ``specsplit`` command line.

Each subcommand lives in its own module, imported only when that subcommand
runs (or its help is asked for): ``specsplit generate`` loads neither torch
nor ray.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from dataclasses import dataclass

from specsplit.lmkit import entry


@dataclass(frozen=True)
class Command:
    name: str
    help: str
    module: str  # has build_parser(parser) and run(args) -> exit code (None for 0)
    log_prefix: str | None = None  # log at --log-level/--log-format as this component (else the module sets up its own)
    quiet: bool = False  # log warnings and errors only


COMMANDS = (
    Command("serve-draft", "run the draft service", "specsplit.draft_service.server"),
    Command("serve-target", "run the target service", "specsplit.target_service.server"),
    Command("serve", "run the orchestrator (public Generate API); --ray: on Ray Serve",
            "specsplit.ray_deploy.serve_command", "orchestrator"),
    Command("up", "on Ray: place draft and target by resources, serve the orchestrator", "specsplit.ray_deploy.placement",
            "specsplit-up"),
    Command("batch", "generate for a JSONL file of prompts on Ray workers (resumable)", "specsplit.ray_deploy.batch_job", quiet=True),
    Command("generate", "stream a completion from a running orchestrator", "specsplit.generate"),
    Command("demo", "start services on loopback and compare with target-only decoding", "specsplit.bench.demo", quiet=True),
    Command("bench", "benchmark speculative vs target-only decoding, write JSON", "specsplit.bench.speculative", quiet=True),
    Command("distill", "train a layer-skip exit adapter for a target (KL distillation)", "specsplit.draft_service.distill"),
)
_BY_NAME = {command.name: command for command in COMMANDS}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The parser; with ``only``, just that subcommand's flags are built (its module alone is imported)."""
    parser = argparse.ArgumentParser(prog="specsplit", description="Speculative decoding split across devices.")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        p = sub.add_parser(command.name, help=command.help, description=command.help)
        if only is None or only == command.name:
            _module(command).build_parser(p)
        p.set_defaults(command_spec=command)
    return parser


# What only the full specsplit distribution has (the light specsplit-client runs `specsplit generate` alone).
_MODEL_STACK = ("torch", "ray", "transformers", *(f"specsplit.{folder}" for folder in (
    "orchestrator", "draft_service", "target_service", "ray_deploy", "bench")), "specsplit.lmkit.")


def _module(command: Command):
    """The subcommand's module; a clear exit where the model stack is not installed."""
    try:
        return importlib.import_module(command.module)
    except ModuleNotFoundError as exc:
        name = exc.name or ""
        if not any(name == m or name.startswith(m if m.endswith(".") else m + ".") for m in _MODEL_STACK):
            raise
        sys.exit(f"specsplit {command.name}: needs the full specsplit package ({name} is not installed); "
                 "the light specsplit-client runs `specsplit generate` only")


def _chosen(argv: list[str]) -> str | None:
    """The subcommand named on the command line (its first word that is one), else None."""
    return next((word for word in argv if word in _BY_NAME), None)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(_chosen(argv) or "").parse_args(argv)
    command: Command = args.command_spec
    entry.run_and_exit(command.name, _module(command).run, args, command.log_prefix, command.quiet)


if __name__ == "__main__":
    main()

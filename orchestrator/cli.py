"""The ``specsplit`` command line."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from lmkit import errors


def _serve_draft(args) -> int:
    from draft_service import server

    server.run(args)
    return 0


def _serve_target(args) -> int:
    from target_service import server

    return server.run(args)


def _serve(args) -> int:
    from orchestrator import server

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s orchestrator %(levelname)s %(message)s")
    asyncio.run(server.serve(args))
    return 0


def _generate(args) -> int:
    from orchestrator import client

    return asyncio.run(client.generate(args))


def _demo(args) -> int:
    from orchestrator import demo

    logging.basicConfig(level=logging.WARNING)
    return demo.run(args)


def _bench(args) -> int:
    from bench import speculative

    logging.basicConfig(level=logging.WARNING)
    return speculative.run(args)


def _up(args) -> int:
    from orchestrator import placement

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s specsplit-up %(levelname)s %(message)s")
    return placement.run(args)


def _batch(args) -> int:
    from orchestrator import batch

    logging.basicConfig(level=logging.WARNING)
    return batch.run(args)


def build_parser() -> argparse.ArgumentParser:
    from bench import speculative
    from draft_service import distill
    from draft_service import server as draft_server
    from orchestrator import batch, client, demo, placement
    from orchestrator import server as orch_server
    from target_service import server as target_server

    parser = argparse.ArgumentParser(prog="specsplit", description="Speculative decoding split across devices.")
    sub = parser.add_subparsers(dest="command", required=True)
    commands = [
        ("serve-draft", "run the draft service", draft_server.build_parser, _serve_draft),
        ("serve-target", "run the target service", target_server.build_parser, _serve_target),
        ("serve", "run the orchestrator (public Generate API); --ray: on Ray Serve", orch_server.build_parser, _serve),
        ("up", "on Ray: place draft and target by resources, serve the orchestrator", placement.build_parser, _up),
        ("batch", "generate for a JSONL file of prompts on Ray workers (resumable)", batch.build_parser, _batch),
        ("generate", "stream a completion from a running orchestrator", client.build_parser, _generate),
        ("demo", "start services on loopback and compare with target-only decoding", demo.build_parser, _demo),
        ("bench", "benchmark speculative vs target-only decoding, write JSON", speculative.build_parser, _bench),
        ("distill", "train a layer-skip exit adapter for a target (KL distillation)", distill.build_parser, distill.run),
    ]
    for name, help_text, build, handler in commands:
        p = sub.add_parser(name, help=help_text, description=help_text)
        build(p)
        p.set_defaults(handler=handler)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        code = args.handler(args)
    except (ValueError, FileNotFoundError, errors.SpecsplitError) as exc:
        print(f"specsplit {args.command}: error: {exc}", file=sys.stderr)
        code = 2
    except KeyboardInterrupt:
        code = 130
    sys.exit(code)


if __name__ == "__main__":
    main()

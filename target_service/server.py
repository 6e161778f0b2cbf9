"""``specsplit serve-target``: the target model behind gRPC."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from lmkit import models
from lmkit.grpc_server import ComputeThread, add_common_flags, run_service, start_in_process
from lmkit.proto.specsplit.v1 import specsplit_pb2 as pb
from lmkit.proto.specsplit.v1 import specsplit_pb2_grpc as pb_grpc
from lmkit.sessions import SessionLimits
from target_service.engine import TargetEngine
from target_service.servicer import TargetServicer

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["TargetService"].full_name
DEFAULT_PORT = 50052


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(prog="specsplit serve-target", description=__doc__)
    parser.add_argument("--model", default=models.DEFAULT_MODEL, help="folder, .gguf file, cached hub id or 'smollm2-135m'")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    parser.add_argument("--dtype", default="float32", help="float32, bfloat16 or float16")
    parser.add_argument("--trust-remote-code", action="store_true", help="allow model code from the checkpoint")
    parser.add_argument("--max-block", type=int, default=32, help="largest draft block accepted per verify")
    parser.add_argument("--max-sessions", type=int, default=64, help="live sessions at most")
    add_common_flags(parser, DEFAULT_PORT)
    return parser


def load_engine(args) -> TargetEngine:
    spec = models.ModelSpec(args.model, args.device, args.dtype, args.trust_remote_code)
    limits = SessionLimits(max_block=args.max_block, max_sessions=args.max_sessions)
    model = models.load_model(spec)
    fingerprint = models.vocab_fingerprint(models.load_tokenizer(args.model))
    return TargetEngine(model, model_id=args.model, vocab_fingerprint=fingerprint, limits=limits)


async def serve(args) -> None:
    compute = ComputeThread("target-compute")
    servicer = TargetServicer(compute, tp_degree=1, device=f"{args.device}/{args.dtype}")

    def load():
        engine = load_engine(args)
        return lambda: servicer.attach(engine)

    await run_service(args, SERVICE_NAME, lambda s: pb_grpc.add_TargetServiceServicer_to_server(servicer, s), load)
    compute.shutdown()


async def start_server(engine: TargetEngine, address: str = "127.0.0.1:0", tp_degree: int = 1):
    """An in-process server over a loaded engine (tests, embedding); returns (server, port)."""
    servicer = TargetServicer(ComputeThread("target-compute"), tp_degree=tp_degree, device=str(engine.model.device))
    servicer.attach(engine)
    return await start_in_process(servicer, pb_grpc.add_TargetServiceServicer_to_server, SERVICE_NAME, address)


def run(args) -> None:
    """Validate flags, then serve until SIGTERM/SIGINT."""
    SessionLimits(max_block=args.max_block, max_sessions=args.max_sessions)  # fail fast on bad flags
    if args.model:
        models.ModelSpec(args.model, args.device, args.dtype, args.trust_remote_code)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s target %(levelname)s %(message)s")
    models.configure_torch_threads(args.threads)
    models.pin_cpus(args.cpus)
    asyncio.run(serve(args))


def main(argv: list[str] | None = None) -> None:
    from orchestrator.cli import main as cli_main

    cli_main(["serve-target", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    main()

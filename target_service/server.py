"""``specsplit serve-target``: the target model behind gRPC."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from dataclasses import replace

import torch

from specsplit.lmkit import entry, event_loop, forward, logs, models
from specsplit.lmkit.caller_check import CallerPolicy
from specsplit.lmkit.grpc_server import (
    ComputeThread,
    add_common_flags,
    add_servicer,
    run_service,
    session_limits,
    start_in_process,
)
from specsplit.lmkit.features import parse_layers
from specsplit.lmkit.kvcache import kv_bytes_per_token
from specsplit.lmkit.sessions import DEFAULT_PREFILL_CHUNK, check_prefill_chunk, prefill_chunk_flag
from specsplit.target_service import ranks, tp
from specsplit.target_service.engine import TargetEngine
from specsplit.target_service.servicer import TargetServicer
from specsplit.v1 import specsplit_pb2 as pb
from specsplit.v1 import specsplit_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["TargetService"].full_name
DEFAULT_PORT = 50052


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(prog="specsplit serve-target", description=__doc__)
    models.add_flags(parser, models.DEFAULT_MODEL,
                     "folder, .gguf file, cached hub id, 'smollm2-135m' or 'gemma3-270m'")
    parser.add_argument("--max-block", type=int, default=32, help="largest draft block accepted per verify")
    parser.add_argument("--kv-budget-bytes", type=int, default=0,
                        help="KV-cache bytes per device every live session may reserve together (each reserves its "
                             "prompt + most new tokens + one block at its open; under --compile cuda-graphs it also sizes the KV pool); "
                             "0: no budget, --max-sessions alone")
    parser.add_argument("--prefill-chunk", type=prefill_chunk_flag, default=DEFAULT_PREFILL_CHUNK,
                        help="a prompt longer than this many tokens is computed this many a step, beside other "
                             "sessions' verification rows, so their rounds go on while it prefills (at least one "
                             "block; the packed forward only: not with --tp, --batch-invariant or cuda-graphs); "
                             "auto: each step's chunk costs about one step of the rows beside it (measured), and a "
                             "prompt with no other session open is one forward; 0: a prompt's prefill is one forward "
                             "that every other session waits for")
    parser.add_argument("--max-batch", type=int, default=32,
                        help="blocks of concurrent sessions verified in one forward at most (1 = no batching)")
    parser.add_argument("--batch-invariant", action="store_true",
                        help="verify every session alone (never in a shared forward): its greedy tokens do not "
                             "depend on other sessions in bfloat16 either; costs the batching speed-up")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (torchrun; gloo on CPU, NCCL on GPU)")
    parser.add_argument("--tp-timeout-s", type=float, default=60.0, help="a collective stuck this long fails the group")
    forward.add_flags(parser, "target", graph_context=4096)
    parser.add_argument("--graph-feature-layers", default="auto",
                        help="with --compile cuda-graphs: the hidden states every replay keeps for feature drafters "
                             "(EAGLE, Medusa), comma-separated (0 = the embeddings, the layer count = the final "
                             "norm's output); auto: EAGLE-3's three layers and the final output; none: no features")
    add_common_flags(parser, DEFAULT_PORT)
    return parser


def compile_mode(args) -> str:
    """--compile resolved for --device (``lmkit.forward.mode_of``; ``off`` with --stock-forward, which
    ``fast_forward`` carries); refused (ValueError) where nothing would be compiled."""
    mode = forward.mode_of(args)
    if mode == "cuda-graphs" and args.tp > 1:
        raise ValueError("--compile cuda-graphs runs an unsharded target; use --tp 1 or --compile off")
    return "off" if mode == forward.STOCK else mode


def kv_budget_tokens(model, budget_bytes: int, tp_degree: int) -> int:
    """--kv-budget-bytes in positions of this model (0: no budget)."""
    if budget_bytes < 0:
        raise ValueError(f"--kv-budget-bytes must be >= 0 (0: no budget), got {budget_bytes}")
    if not budget_bytes:
        return 0
    per_token = kv_bytes_per_token(model, tp_degree)
    tokens = budget_bytes // per_token
    if tokens < 1:
        raise ValueError(f"--kv-budget-bytes {budget_bytes} holds no position of this model ({per_token} bytes each)")
    log.info("KV budget: %d positions (%d bytes each)", tokens, per_token)
    return tokens


def load_engine(args, leader_hook=None) -> tuple[TargetEngine, tp.Leader | None]:
    """Load the model (sharded over the process group when --tp > 1) and build the engine."""
    spec = models.ModelSpec(args.model, args.device, args.dtype, args.trust_remote_code)
    model = models.load_model(spec, tensor_parallel=args.tp > 1)
    limits = replace(session_limits(args), kv_budget_tokens=kv_budget_tokens(model, args.kv_budget_bytes, args.tp))
    fingerprint = models.vocab_fingerprint(models.load_tokenizer(args.model))
    leader = tp.Leader(model, on_broken=leader_hook) if args.tp > 1 else None
    mode = compile_mode(args)
    forward.use_compile_cache(args, mode)
    if mode == "inductor":
        log.info("compiling the decoder step (%s; cache %s): health stays NOT_SERVING until done", mode,
                 args.compile_cache_dir)
    new_cache, context = leader.new_cache if leader else None, 0
    if mode == "cuda-graphs":
        log.info("capturing the decoder step as CUDA graphs: health stays NOT_SERVING until done")
        new_cache, context = forward.slots(model, limits.max_sessions, args.graph_context, limits.max_block + 1,
                                           args.max_batch, kv_tokens=limits.kv_budget_tokens,
                                           feature_layers=parse_layers(args.graph_feature_layers,
                                                                       int(model.config.num_hidden_layers)))
    engine = TargetEngine(
        model,
        model_id=args.model,
        vocab_fingerprint=fingerprint,
        limits=limits,
        new_cache=new_cache,
        max_context=context,
        prefill_chunk=args.prefill_chunk,
        sampling_defaults=models.sampling_defaults(args.model),
        tp_degree=args.tp,
        fast_forward=not args.stock_forward,
        batch_invariant=args.batch_invariant,
        compile_mode=mode,
    )
    log.info("target step: %s", engine.forward_kind)
    rank = int(os.environ.get("RANK", "0"))
    log.info("rank %d holds %.1f MB of weights (tp=%d)", rank, tp.weight_bytes(model) / 1e6, args.tp)
    return engine, leader


async def serve(args) -> int:
    """Serve until SIGTERM/SIGINT; returns the exit code (1 when a tensor-parallel rank was lost)."""
    compute = ComputeThread("target-compute")
    servicer = TargetServicer(compute, tp_degree=args.tp, device=f"{args.device}/{models.resolve_dtype(args.device, args.dtype)}", max_batch=args.max_batch)
    servicer.session_ttl_s = args.session_ttl_s
    leaders: list[tp.Leader] = []

    def load():
        engine, leader = load_engine(args, leader_hook=lambda: os.kill(os.getpid(), signal.SIGTERM))
        leaders.extend([leader] if leader else [])
        return lambda: servicer.attach(engine)

    await run_service(
        args, SERVICE_NAME, lambda s: add_servicer(pb_grpc.add_TargetServiceServicer_to_server, servicer, s), load, servicer
    )
    broken = any(leader.broken for leader in leaders)
    if leaders and not broken:
        try:
            await compute.run(leaders[0].shutdown)  # followers leave their loop and exit 0
        except RuntimeError as exc:  # a follower is already gone
            log.error("could not stop the followers cleanly: %s", exc)
            broken = True
    compute.shutdown()
    return 1 if broken else 0


async def start_server(engine: TargetEngine, address: str = "127.0.0.1:0", tp_degree: int = 1, max_batch: int = 32,
                       policy: CallerPolicy | None = None):
    """An in-process server over a loaded engine (tests, embedding); returns (server, port)."""
    servicer = TargetServicer(
        ComputeThread("target-compute"), tp_degree=tp_degree, device=str(engine.model.device), max_batch=max_batch
    )
    servicer.attach(engine)
    return await start_in_process(
        servicer, pb_grpc.add_TargetServiceServicer_to_server, SERVICE_NAME, address, policy=policy
    )


def run(args) -> int:
    """Validate flags, then serve until SIGTERM/SIGINT (as --tp supervised ranks when --tp > 1)."""
    session_limits(args)  # fail fast on bad flags
    if args.kv_budget_bytes < 0:
        raise ValueError(f"--kv-budget-bytes must be >= 0 (0: no budget), got {args.kv_budget_bytes}")
    if args.max_batch < 1:
        raise ValueError(f"--max-batch must be >= 1, got {args.max_batch}")
    check_prefill_chunk(args.prefill_chunk, auto=True)
    compile_mode(args)  # fail fast, before the model loads
    spec = models.ModelSpec(args.model, args.device, args.dtype, args.trust_remote_code)
    logs.configure(args.log_level, "target", args.log_format)
    if args.tp > 1 and "RANK" not in os.environ:
        return launch_ranks(args, spec)
    models.configure_torch_threads(args.threads)
    models.pin_cpus(args.cpus, args.threads)
    if args.tp == 1:
        return event_loop.run(serve(args))
    if spec.device.startswith("cuda"):
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    rank, world = tp.init_process_group(spec.device, args.tp_timeout_s)
    if world != args.tp:
        raise ValueError(f"--tp {args.tp} but torchrun started {world} ranks")
    if rank == 0:
        code = event_loop.run(serve(args))
    else:
        engine, _ = load_engine(args)
        tp.follow(engine.model)
        code = 0
    if code == 0 and not tp.leave_group():  # a rank went away between the last broadcast and the exit
        code = 1
    return code


def launch_ranks(args, spec: models.ModelSpec) -> int:
    """Start --tp ranks of this same command and supervise them (target_service.ranks)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(models.resolve(args.model, spec.dtype_name), local_files_only=True)
    tp.check_divisible(config, args.tp, args.model)
    return ranks.launch(args.tp, _service_argv(), spec.device.startswith("cuda"), args.grace_s)


def _service_argv() -> list[str]:
    """This command's own flags, however it was started (specsplit serve-target or python -m)."""
    argv = sys.argv[1:]
    return argv[argv.index("serve-target") + 1 :] if "serve-target" in argv else argv


def main(argv: list[str] | None = None) -> None:
    """``python -m specsplit.target_service.server``: ``specsplit serve-target`` itself."""
    entry.run_and_exit("serve-target", run, build_parser().parse_args(argv))


if __name__ == "__main__":
    main()

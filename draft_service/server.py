"""``specsplit serve-draft``: the drafters behind gRPC (n-gram always; model, self- and EAGLE drafters with --model)."""

from __future__ import annotations

import argparse
import logging
from dataclasses import replace

from specsplit.draft_service import eagle_head, medusa, self_draft
from specsplit.draft_service.engine import DEFAULT_SUCCESSOR_TABLE_TOKENS, DraftEngine
from specsplit.draft_service.ngram import NgramConfig
from specsplit.draft_service.self_draft import QuantizeMode
from specsplit.draft_service.servicer import DraftServicer
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
from specsplit.lmkit.kinds import DrafterKind
from specsplit.lmkit.sessions import DEFAULT_PREFILL_CHUNK, SessionLimits, check_prefill_chunk
from specsplit.v1 import specsplit_pb2 as pb
from specsplit.v1 import specsplit_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["DraftService"].full_name
DEFAULT_PORT = 50051


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(prog="specsplit serve-draft", description=__doc__)
    models.add_flags(parser, "", "draft model (folder, .gguf, cached hub id); empty = n-gram only")
    parser.add_argument("--max-block", type=int, default=32, help="largest k accepted per propose")
    parser.add_argument("--kv-budget-bytes", type=int, default=0,
                        help="KV-cache bytes every live session may reserve together (each reserves its prompt + most "
                             "new tokens + one block at its open, at what its drafter keeps a position: a model's "
                             "keys and values, nothing for n-gram, recycling or Medusa); 0: no budget, "
                             "--max-sessions alone. A session the budget cannot hold is refused (RESOURCE_EXHAUSTED) "
                             "and the orchestrator runs it target-only")
    parser.add_argument("--prefill-chunk", type=int, default=DEFAULT_PREFILL_CHUNK,
                        help="context tokens a new session's read computes at most at a time on the draft model: a "
                             "long prompt is read in chunks between other sessions' proposals; 0: in one forward")
    parser.add_argument("--ngram-min", type=int, default=2, help="n-gram drafter: shortest suffix to match")
    parser.add_argument("--ngram-max", type=int, default=4, help="n-gram drafter: longest suffix to match")
    parser.add_argument(
        "--layerskip-layers", type=int, default=0,
        help="enable the LAYERSKIP self-drafter: --model's first L layers + norm + head (0 = off)",
    )
    parser.add_argument(
        "--layerskip-adapter", default="",
        help="exit adapter folder written by `specsplit distill` (enables LAYERSKIP with its layer count)",
    )
    parser.add_argument(
        "--quantize", default="", choices=["", *(m.value for m in QuantizeMode)],
        help="enable the QUANTIZED self-drafter: --model's transformer layers in int8, LM head in fp32",
    )
    parser.add_argument(
        "--eagle-head", default="",
        help="enable the EAGLE drafter: a head folder in the EAGLE-3 layout trained for --model (the target), "
             f"or a bundled head's name ({', '.join(sorted(eagle_head.BUNDLED))})",
    )
    parser.add_argument(
        "--medusa-head", default="",
        help="enable the MEDUSA drafter: a folder of Medusa heads (the Medusa-1 layout: config.json and "
             "medusa_lm_head.safetensors) trained for --model (the target), or a bundled heads' target name "
             f"({', '.join(sorted(medusa.BUNDLED))})",
    )
    parser.add_argument(
        "--medusa-vocab", type=int, default=medusa.DEFAULT_DRAFT_VOCAB,
        help="MEDUSA drafter: draft over the N tokens the target writes most often (the heads folder's "
             f"{medusa.DRAFT_VOCAB}, as `specsplit distill --medusa` counts them): each head's LM head keeps "
             "those rows only; the target still verifies against its whole vocabulary. 0: the whole vocabulary "
             "(also where the folder ranks none)",
    )
    parser.add_argument(
        "--recycling-table-tokens", type=int, default=DEFAULT_SUCCESSOR_TABLE_TOKENS,
        help="RECYCLING drafter: tokens each caller's shared table of the target's successors holds at most "
             "(about 300 bytes each); 0: no shared table, each session drafts from its own reports alone",
    )
    forward.add_flags(parser, "draft", graph_context=1024)
    add_common_flags(parser, DEFAULT_PORT)
    return parser


def check_self_draft_flags(args) -> None:
    """Fail fast (ValueError) on self-drafting flags that cannot work, before loading anything."""
    wants = args.layerskip_layers or args.layerskip_adapter or args.quantize or args.eagle_head or args.medusa_head
    if wants and not args.model:
        raise ValueError(
            "--layerskip-layers, --layerskip-adapter, --quantize, --eagle-head and --medusa-head derive from --model; "
            "pass --model TARGET"
        )
    if args.medusa_head:
        medusa.read_config(args.medusa_head)
        medusa.read_draft_vocab(args.medusa_head, args.medusa_vocab)
    if args.eagle_head:
        eagle_head.read_config(eagle_head.resolve_head(args.eagle_head))
    if args.recycling_table_tokens < 0:
        raise ValueError(f"--recycling-table-tokens must be >= 0 (0: no shared table), got {args.recycling_table_tokens}")
    if args.layerskip_layers < 0:
        raise ValueError(f"--layerskip-layers must be >= 1 (0 = off), got {args.layerskip_layers}")
    if args.layerskip_adapter:
        _, meta = self_draft.load_adapter(args.layerskip_adapter)
        if args.layerskip_layers and args.layerskip_layers != meta.layers:
            raise ValueError(
                f"--layerskip-layers {args.layerskip_layers} disagrees with the adapter, trained for {meta.layers} "
                "layers; drop --layerskip-layers or pass the adapter's count"
            )


def derive_drafts(args, model, fingerprint: str) -> dict[DrafterKind, object]:
    """The self-drafting views of ``model`` the flags ask for."""
    derived: dict[DrafterKind, object] = {}
    layers, adapter = args.layerskip_layers, None
    if args.layerskip_adapter:
        adapter, meta = self_draft.load_adapter(args.layerskip_adapter)
        if meta.vocab_fingerprint != fingerprint or meta.hidden_size != int(model.config.hidden_size):
            raise ValueError(
                f"the exit adapter {args.layerskip_adapter} was trained for {meta.target}, not for {args.model}; "
                "pass the target it was distilled from as --model"
            )
        layers = meta.layers
    if layers:
        derived[DrafterKind.LAYERSKIP] = self_draft.layerskip_view(model, layers, adapter)
    if args.quantize:
        derived[DrafterKind.QUANTIZED] = self_draft.quantized_view(model, QuantizeMode(args.quantize))
    if args.eagle_head:
        derived[DrafterKind.EAGLE] = eagle_head.load_head(args.eagle_head, model)
    if args.medusa_head:
        derived[DrafterKind.MEDUSA] = medusa.load_heads(args.medusa_head, model, args.model, args.medusa_vocab)
    return derived


def load_engine(args, limits: SessionLimits) -> DraftEngine:
    if not args.model:
        return DraftEngine(None, limits=limits, successor_table_tokens=args.recycling_table_tokens,
                           prefill_chunk=args.prefill_chunk)
    spec = models.ModelSpec(args.model, args.device, args.dtype, args.trust_remote_code)
    model = models.load_model(spec)
    fingerprint = models.vocab_fingerprint(models.load_tokenizer(args.model))
    derived = derive_drafts(args, model, fingerprint)
    mode = forward.mode_of(args)
    forward.use_compile_cache(args, mode)
    if mode in ("inductor", "cuda-graphs"):
        log.info("setting up the draft's step (--compile %s): health stays NOT_SERVING until done", mode)
    engine = DraftEngine(model, model_id=args.model, vocab_fingerprint=fingerprint, limits=limits, derived=derived,
                         successor_table_tokens=args.recycling_table_tokens, prefill_chunk=args.prefill_chunk,
                         forward_mode=mode, graph_context=args.graph_context)
    for kind, what in engine.forward_kinds.items():
        log.info("%s drafter step: %s", kind.name, what)
    return engine


def draft_limits(args) -> SessionLimits:
    """The draft's session limits from its flags (ValueError for a bad value)."""
    return replace(session_limits(args), kv_budget_bytes=args.kv_budget_bytes)


async def serve(args) -> None:
    limits = draft_limits(args)
    ngram = NgramConfig(min_n=args.ngram_min, max_n=args.ngram_max)
    compute = ComputeThread("draft-compute")
    servicer = DraftServicer(compute, ngram, device=f"{args.device}/{models.resolve_dtype(args.device, args.dtype)}")

    def load():
        engine = load_engine(args, limits)
        return lambda: servicer.attach(engine)

    servicer.session_ttl_s = args.session_ttl_s
    await run_service(
        args, SERVICE_NAME, lambda s: add_servicer(pb_grpc.add_DraftServiceServicer_to_server, servicer, s), load,
        servicer,
    )
    compute.shutdown()


async def start_server(engine: DraftEngine, address: str = "127.0.0.1:0", ngram: NgramConfig | None = None,
                       policy: CallerPolicy | None = None):
    """An in-process server over a loaded engine (tests, embedding); returns (server, port)."""
    servicer = DraftServicer(ComputeThread("draft-compute"), ngram or NgramConfig())
    servicer.attach(engine)
    return await start_in_process(
        servicer, pb_grpc.add_DraftServiceServicer_to_server, SERVICE_NAME, address, policy=policy
    )


def run(args) -> None:
    """Validate flags, then serve until SIGTERM/SIGINT."""
    draft_limits(args)  # fail fast on bad flags
    check_prefill_chunk(args.prefill_chunk)
    if args.model:
        models.ModelSpec(args.model, args.device, args.dtype, args.trust_remote_code)
    forward.mode_of(args)
    check_self_draft_flags(args)
    logs.configure(args.log_level, "draft", args.log_format)
    models.configure_torch_threads(args.threads)
    models.pin_cpus(args.cpus, args.threads)
    event_loop.run(serve(args))


def main(argv: list[str] | None = None) -> None:
    """``python -m specsplit.draft_service.server``: ``specsplit serve-draft`` itself."""
    entry.run_and_exit("serve-draft", run, build_parser().parse_args(argv))


if __name__ == "__main__":
    main()

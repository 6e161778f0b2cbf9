"""How a service runs a model's steps: one choice, made here, for the target, the tensor-parallel target and
every drafter that runs a model (the model drafter and the self-drafts).

    kind = install(model, mode)        sets ``model`` up to run its steps as ``mode`` says; returns what runs them
    new_cache, context = slots(model, sessions, context, width, batch, graphs, chain)
                                       the static step's KV slots (``--compile cuda-graphs``): each session's cache;
                                       ``chain``: a drafter's k-token chains in one replay each (``chain_step``)

``mode`` is ``--compile`` resolved for the device (``decoder_step.resolve_compile``), or ``stock``:

    stock         transformers' forward over a ``DynamicCache`` (``--stock-forward``)
    off           the packed-rows forward (``lmkit.packed_rows``): the decoder step, eager, with oneDNN-packed
                  linears on the CPU, where the model's layout allows; transformers' forward over packed rows
                  where only the attention allows; the stock forward where neither (mixed layer kinds)
    inductor      the same, the decoder step compiled by ``torch.compile`` (plain linears)
    cuda-graphs   the static decoder step over KV blocks from a pool allocated at start, captured per (batch,
                  width, span) bucket (``lmkit.graph_step``): a session's cache is a slot (``slots``), chains and
                  token trees, the hidden states of the layers the step keeps

A ``SessionCache`` built over an installed model runs the packed forward (``kvcache``); over the stock model, the
stock one. The packed forward and the decoder step are per model object: a self-draft view installs its own.
The fast forward runs on an unsharded CPU model; on CUDA the fast path is ``cuda-graphs``, elsewhere the stock
forward runs and the returned text says why.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Sequence

from specsplit.lmkit import decoder_step, packed_rows
from specsplit.lmkit.packed_linear import pack_linears

log = logging.getLogger(__name__)

STOCK = "stock"
MODES = (STOCK, "off", "inductor", "cuda-graphs")  # what ``install`` takes (``--compile`` resolved)


def install(model, mode: str, sharded: bool = False, alone: bool = False) -> str:
    """Set ``model`` up to run its steps as ``mode`` says (see the module's text); returns what runs them, for the
    log. ``sharded``: a tensor-parallel shard: on the CPU the eager decoder step over this rank's part, its
    collectives explicit; elsewhere transformers' stock forward, whose collectives run inside it.
    ``alone``: its steps run one session at a time (a drafter), where packed rows without the decoder step gain
    nothing (``bench --suite step --step-parts draft``), so a model the step cannot run keeps the stock forward."""
    if mode not in MODES:
        raise ValueError(f"forward mode must be one of {', '.join(MODES)}; got {mode!r}")
    if mode == STOCK:
        return "transformers' stock forward"
    if alone and (reason := decoder_step.unsupported(model, static=mode == "cuda-graphs")):
        return f"transformers' stock forward (the decoder step cannot run it: {reason})"
    if mode == "cuda-graphs":
        return "the static decoder step, captured as CUDA graphs (sessions batched, chains)"
    device = next(model.parameters()).device.type
    if not sharded and device == "cpu":
        return packed_rows.install_fast_forward(model, mode, pack=pack_linears)
    if sharded and device == "cpu" and mode == "off":
        # the eager decoder step on this rank's shard, its collectives explicit (gloo); plain linears: oneDNN
        # packing takes whole weights
        reason = decoder_step.unsupported(model)
        if reason is None:
            return packed_rows.install_fast_forward(model, mode) + " on this rank's shard, one all-reduce per " \
                                                                  "row-parallel projection"
        return f"transformers' stock forward (the decoder step cannot run this shard: {reason})"
    where = "a sharded model" if sharded else f"a {device} model"
    if mode == "off":
        return f"transformers' stock forward (the fast forward runs on an unsharded CPU model; on {where}: " \
               "--compile cuda-graphs where the model is unsharded on CUDA)"
    return f"transformers' stock forward (--compile {mode} applies to the decoder step, which runs on an unsharded " \
           f"CPU model, not on {where})"


def slots(model, sessions: int, context: int, width: int, batch: int, graphs: bool = True, chain: int = 0,
          kv_tokens: int = 0, block_size: int = 16, feature_layers: Sequence[int] = ()):
    """``--compile cuda-graphs``: the static step for ``sessions`` sessions of up to ``context`` positions each (as
    far as the model reaches), their keys and values in blocks of ``block_size`` positions taken as they grow, for
    blocks of up to ``width`` tokens, ``batch`` sessions a replay, captured as CUDA graphs (``graphs``; off, it runs
    eagerly: the CPU's tests). The pool holds ``kv_tokens`` positions (the KV budget every session's reservation
    fits, plus a block a session for rounding) or, 0, every session at its full context. ``chain``: also a
    drafter's chains of up to this many tokens, each in one replay (``chain_step``). ``feature_layers``: the hidden
    states every replay keeps for feature drafters. Returns (a new session's cache, the context a session may
    reach)."""
    from specsplit.lmkit import chain_step, graph_step

    context = min(context, int(getattr(model.config, "max_position_embeddings", 0) or context))
    started = time.perf_counter()
    batch = min(batch, sessions)
    blocks = -(-kv_tokens // block_size) + sessions if kv_tokens else None
    step = graph_step.GraphStep(model, slots=sessions, capacity=context + width, max_width=width, graphs=graphs,
                                max_batch=batch, block_size=block_size, blocks=blocks, feature_layers=feature_layers)
    if chain:
        step.chains = chain_step.ChainStep(step, chain, graphs=graphs)
    free = graph_step.Slots(sessions)
    kv_bytes = sum(t.numel() * t.element_size() for t in (*step.keys, *step.values))
    chains = f" and chains of 1..{chain} tokens ({len(step.chains.graphs)} graphs)" if chain else ""
    log.info("%s the step for widths %s x batches %s x spans %s blocks (%d graphs)%s in %.1f s; %d sessions of up "
             "to %d positions in %d KV blocks of %d (%.2f GB)", "captured" if graphs else "built",
             ",".join(map(str, step.widths)), ",".join(map(str, step.batches)), ",".join(map(str, step.spans)),
             len(step.graphs), chains, time.perf_counter() - started, sessions, context, step.blocks.count,
             block_size, kv_bytes / 1e9)
    if step.feature_layers:
        log.info("every replay keeps the hidden states of layers %s for feature drafters", list(step.feature_layers))
    return (lambda: graph_step.GraphSessionCache(model, step, free)), context


def add_flags(parser, service: str, graph_context: int) -> None:
    """The flags that choose how ``service`` (``target``, ``draft``) runs its model's steps: --compile,
    --stock-forward, --graph-context, --compile-cache-dir."""
    parser.add_argument(
        "--stock-forward", action="store_true",
        help="run transformers' own forward (DynamicCache, MKL linears, padded batches) instead of the fast "
        "one (oneDNN linears on fp32 CPU, KV buffers, packed rows, token trees); for comparisons",
    )
    parser.add_argument(
        "--compile", default="auto", choices=decoder_step.COMPILE_MODES,
        help=f"compile the {service}'s decoder step: off (eager), inductor (torch.compile, at start-up, health "
             "NOT_SERVING until done), cuda-graphs (a static step captured once per block width and batch over KV "
             "blocks allocated at start-up: CUDA only, chains and trees, the target's --graph-feature-layers for EAGLE/Medusa), auto (what "
             "measured faster on the device: off on the CPU and, for now, on CUDA)",
    )
    parser.add_argument(
        "--graph-context", type=int, default=graph_context,
        help="with --compile cuda-graphs: positions a session may hold (prompt + output; capped at the model's "
             "context); its keys and values take blocks of 16 positions as it grows, from a pool allocated at "
             "start-up: --kv-budget-bytes of them on the target where set, else every session at this context",
    )
    parser.add_argument(
        "--compile-cache-dir", default=str(Path.home() / ".cache" / "specsplit" / "inductor"),
        help="where compiled code is kept between starts (TORCHINDUCTOR_CACHE_DIR): a restart reuses it",
    )


def use_compile_cache(args, mode: str) -> None:
    """Under ``inductor``, keep compiled code in --compile-cache-dir, so that a restart reuses it."""
    if mode == "inductor":
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = args.compile_cache_dir


def mode_of(args) -> str:
    """The flags of ``add_flags`` resolved for --device: one of ``MODES``; a ValueError naming the flags where they
    ask for different things or nothing would run."""
    mode = decoder_step.resolve_compile(args.compile, args.device.split(":")[0])
    if mode != "off" and args.stock_forward:
        raise ValueError(f"--compile {args.compile} compiles the fast forward; drop --stock-forward or use --compile off")
    if mode == "cuda-graphs" and args.graph_context < 2:
        raise ValueError(f"--graph-context must be >= 2 positions, got {args.graph_context}")
    return STOCK if args.stock_forward else mode

"""``specsplit bench --suite step``: the target's packed forward by width and batch, through each way to run it;
and the draft's model step, stock against fast (``draft``).

In this process, one thread, no services: for the near-zero model (one layer, hidden 16, the default
vocabulary) and for ``--model`` (SmolLM2 by default), each row a session with a 64-token context
verifying a block of ``width`` tokens, ``batch`` rows packed into one forward:

- ``transformers``: transformers' module forward over packed rows, oneDNN-packed linears (the target's
  step before the decoder step);
- ``step``: the decoder step, eager, the same packed linears (``--compile off``, and ``auto`` on the CPU);
- ``inductor``: the decoder step compiled by ``torch.compile`` (plain linears; ``--compile inductor``).

Modes are measured in turn within each repeat (interleaved), the fastest repeat kept. Also: the compile
time, and the first forward after it (a new session's prefill); a greedy block's decision, the argmax
of its rows, through torch's max and through ``row_argmax``; (``cache``) the near-zero model's step and
its LM head with the greedy argmax warm, against the same after the CPU caches were flushed or the process
slept, as a service's step runs after the other processes had the CPU; and (``engine``) the target
engine's whole batched step (plan, packed forward, decision, commit) for 32 sessions by context length.
The logits of every mode are compared with ``transformers``' at each cell: ``step`` must equal them bit for bit, ``inductor`` to rounding (its fused
kernels sum in another order), with the same argmax. JSON and a PNG.
"""

from __future__ import annotations

import functools
import os
import tempfile
import time
from pathlib import Path

import torch

from specsplit.bench import runs
from specsplit.lmkit import models, packed_rows
from specsplit.lmkit.kv_buffer import KVBuffer
from specsplit.lmkit.packed_linear import PackedLinear, pack_linears, packs

MODES = ("transformers", "step", "inductor")
PARTS = ("forward", "decision", "cache", "engine", "linears", "bound", "draft", "static",
         "families")  # --step-parts, in running order
CONTEXT = 64


def add_flags(parser) -> None:
    parser.add_argument("--step-widths", default="1,2,3,5,9", help="--suite step: verify widths (tokens per row)")
    parser.add_argument("--step-batches", default="1,8,32", help="--suite step: rows packed into one forward")
    parser.add_argument("--step-repeats", type=int, default=3, help="--suite step: interleaved repeats per cell")
    parser.add_argument("--step-parts", default=",".join(PARTS),
                        help="--suite step, comma-separated: forward (the packed forward by width and batch), "
                             "decision (a greedy block's argmax rows: torch's max against row_argmax), cache (the "
                             "near-zero model's step and LM head warm, after a cache flush, after a sleep), engine "
                             "(the target engine's batched step of 32 sessions by context length), linears (one "
                             "projection packed and plain, by weight shape and row count), bound (--model's eager "
                             "step by width against the memory bound: weights read / one thread's read rate), draft "
                             "(the model drafter's proposal of 1 and of k tokens with --model, its layer-skip and its "
                             "int8 self-drafts, on transformers' stock forward and on the fast one), static (--model's static "
                             "step, what --compile cuda-graphs captures, uncaptured: a verify at 512, 2,048 and 8,192 "
                             "held positions reading the span of blocks held against reading every block), "
                             "families (each family's tiny test model, bench/families.py, and Gemma 3 270M where "
                             "its packages are installed: a decode step and a verify of 5 tokens after a 64-token "
                             "context, transformers' stock forward against the fast one, the same greedy tokens)")
    parser.add_argument("--step-draft-k", type=int, default=4, help="--suite step: the draft block measured beside 1")


def load(ref: str, mode: str):
    """``ref`` loaded and set up as ``mode`` runs it; returns (model, what runs its forward, compile seconds)."""
    model = models.load_model(models.ModelSpec(ref))
    began = time.perf_counter()
    if mode == "transformers":
        pack_linears(model)
        packed_rows.install(model)
        return model, "transformers' forward", 0.0
    kind = packed_rows.install_fast_forward(model, "inductor" if mode == "inductor" else "off", pack=pack_linears)
    return model, kind, time.perf_counter() - began if mode == "inductor" else 0.0


def _rows(model, batch: int, width: int, kvs: list[KVBuffer]) -> list[packed_rows.RowStep]:
    block = [(7 * i + 3) % 1000 + 100 for i in range(width)]
    return [packed_rows.RowStep(kv, CONTEXT, block, list(range(width))) for kv in kvs[:batch]]


def _prefill(model, batches: int) -> list[KVBuffer]:
    layers = int(model.config.num_hidden_layers)
    kvs = [KVBuffer(layers) for _ in range(batches)]
    context = [(11 * i + 5) % 1000 + 100 for i in range(CONTEXT)]
    for kv in kvs:
        packed_rows.forward_rows(model, [packed_rows.RowStep(kv, 0, context, [CONTEXT - 1])])
    return kvs


def _time(model, steps, n: int) -> float:
    packed_rows.forward_rows(model, steps)
    began = time.perf_counter()
    for _ in range(n):
        packed_rows.forward_rows(model, steps)
    return (time.perf_counter() - began) / n


def measure_model(ref: str, widths: list[int], batches: list[int], repeats: int, n_for) -> dict:
    loaded, kvs, first = {}, {}, {}
    for mode in MODES:
        model, kind, compile_s = load(ref, mode)
        began = time.perf_counter()
        kvs[mode] = _prefill(model, max(batches))
        first[mode] = {"what": kind, "compile_s": round(compile_s, 2),
                       "first_prefill_ms": round((time.perf_counter() - began) / max(batches) * 1e3, 3)}
        loaded[mode] = model
    cells, mismatch = {}, []
    for batch in batches:
        for width in widths:
            reference = packed_rows.forward_rows(loaded["transformers"], _rows(loaded["transformers"], batch, width,
                                                                              kvs["transformers"]))
            for mode in MODES[1:]:
                got = packed_rows.forward_rows(loaded[mode], _rows(loaded[mode], batch, width, kvs[mode]))
                exact = all(torch.equal(a, b) for a, b in zip(got, reference))
                same_argmax = all(torch.equal(a.argmax(-1), b.argmax(-1)) for a, b in zip(got, reference))
                if (mode == "step" and not exact) or not same_argmax:
                    mismatch.append({"mode": mode, "batch": batch, "width": width, "exact": exact,
                                     "same_argmax": same_argmax})
            times = {mode: [] for mode in MODES}
            for _ in range(repeats):
                for mode in MODES:
                    steps = _rows(loaded[mode], batch, width, kvs[mode])
                    times[mode].append(_time(loaded[mode], steps, n_for(batch, width)))
            cells[(batch, width)] = {mode: min(t) for mode, t in times.items()}
    rows = []
    for (batch, width), best in cells.items():
        for mode, seconds in best.items():
            one = cells[(batch, widths[0])][mode]
            rows.append({"batch": batch, "width": width, "mode": mode, "ms": round(seconds * 1e3, 3),
                         "t_over_t1": round(seconds / one, 3), "positions_per_s": round(batch * width / seconds, 1),
                         "vs_transformers": round(cells[(batch, width)]["transformers"] / seconds, 3)})
    return {"model": ref, "modes": first, "cells": rows, "mismatches": mismatch}


def measure_decision(widths: list[int], vocab: int = 49152, repeats: int = 5) -> list[dict]:
    """A greedy block's decision, the argmax of its [width, vocab] logits rows: torch's max, then row_argmax
    (what the verifiers call), interleaved; microseconds a block."""
    from specsplit.lmkit.sampling import row_argmax

    rows = []
    for width in widths:
        logits = torch.randn(width, vocab, generator=torch.Generator().manual_seed(width))
        assert torch.equal(row_argmax(logits)[1], logits.max(dim=-1).indices)
        best = {"max": float("inf"), "row_argmax": float("inf")}
        for _ in range(repeats):
            for name, fn in (("max", functools.partial(torch.max, logits, dim=-1)),
                             ("row_argmax", functools.partial(row_argmax, logits))):
                fn()
                began = time.perf_counter()
                for _ in range(200):
                    fn()
                best[name] = min(best[name], (time.perf_counter() - began) / 200)
        rows.append({"rows": width, "vocab": vocab, "max_us": round(best["max"] * 1e6, 1),
                     "row_argmax_us": round(best["row_argmax"] * 1e6, 1),
                     "ratio": round(best["max"] / best["row_argmax"], 2)})
    return rows


# (out, in) of the weights measured by ``measure_linears``: the near-zero model's layers and LM head, the test
# models' (hidden 64), sizes around the packing threshold, SmolLM2's layers and LM head.
LINEAR_SHAPES = ((16, 16), (32, 16), (16, 32), (64, 64), (128, 64), (128, 128), (256, 128), (256, 256),
                 (192, 576), (576, 576), (1536, 576), (576, 1536), (49152, 16), (49152, 576))
LINEAR_ROWS = (1, 5, 32, 160)  # one token; one session's block of 5; 32 sessions at k 0; 32 at k 4


def measure_linears(repeats: int = 5) -> list[dict]:
    """One projection of [1, rows, in] through a oneDNN-packed weight and through torch's plain matmul
    (``F.linear``), interleaved, by weight shape and row count; microseconds a call, the best of ``repeats``.
    What ``packed_linear.PACK_MIN_VALUES`` is set from; ``packed`` says which way ``pack_linears`` runs it
    (``packed_linear.packs``)."""
    out = []
    for out_features, in_features in LINEAR_SHAPES:
        linear = torch.nn.Linear(in_features, out_features, bias=False)
        packed = PackedLinear(linear)
        for rows in LINEAR_ROWS:
            x = torch.randn(1, rows, in_features, generator=torch.Generator().manual_seed(rows))
            calls = max(3, min(2000, int(2e6 / (out_features * in_features * rows) ** 0.75)))
            best = {"packed": float("inf"), "plain": float("inf")}
            with torch.no_grad():
                for _ in range(repeats):
                    for name, fn in (("packed", packed), ("plain", linear)):
                        fn(x)
                        began = time.perf_counter()
                        for _ in range(calls):
                            fn(x)
                        best[name] = min(best[name], (time.perf_counter() - began) / calls)
            out.append({"out": out_features, "in": in_features, "rows": rows,
                        "packed_us": round(best["packed"] * 1e6, 1),
                        "plain_us": round(best["plain"] * 1e6, 1),
                        "plain_over_packed": round(best["plain"] / best["packed"], 2),
                        "packed": packs(linear)})
    return out


CACHE_SHAPES = ((1, 1), (32, 1), (32, 5))  # (rows, tokens a row): one session at k = 0; 32 at k = 0 and at k = 4
CACHE_STATES = ("flushed", "warm", "spun", "slept")  # in this order call by call (``measure_cache``)
PAUSE_S = 0.001  # a service's gap between two steps, about: the rest of a round


def _last_level_cache_bytes(caches: Path = Path("/sys/devices/system/cpu/cpu0/cache")) -> int:
    """The largest CPU cache's size as Linux reports it (64 MiB when it does not)."""
    sizes = []
    for index in caches.glob("index*"):
        try:
            text = (index / "size").read_text().strip()
        except OSError:
            continue
        unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        sizes.append(int(text.rstrip("KMG")) * unit)
    return max(sizes, default=64 << 20)


def read_bandwidth(mib: int = 1024, repeats: int = 5) -> float:
    """Bytes a second one thread reads from memory here: the best of ``repeats`` sums of a ``mib`` MiB buffer,
    many times the last-level cache, so each sum streams it from memory as a step streams its weights."""
    buffer = torch.ones(mib << 18)  # fp32: mib MiB
    best = float("inf")
    for _ in range(repeats):
        began = time.perf_counter()
        buffer.sum()
        best = min(best, time.perf_counter() - began)
    return buffer.numel() * buffer.element_size() / best


def weights_read(model) -> int:
    """Bytes a one-token step reads of ``model``'s weights: every parameter and buffer once (the packed
    copies of the linears included), except an input embedding the LM head does not share: of that, one row."""
    embedding = model.get_input_embeddings().weight
    head = getattr(model.get_output_embeddings(), "weight", None)
    tensors = {id(t): t for t in (*model.parameters(), *model.buffers()) if t.is_floating_point()}
    read = sum(t.numel() * t.element_size() for t in tensors.values())
    if head is not embedding:
        read -= (embedding.shape[0] - 1) * embedding[0].numel() * embedding.element_size()
    return read


def measure_bound(ref: str, widths: list[int], repeats: int = 3, n: int = 5) -> dict:
    """``ref``'s eager step (one row of ``widths`` tokens, the decoder step as ``--compile auto`` runs it on the
    CPU) against the memory bound of its first: the weights it reads over what one thread reads a second; and
    its projections alone (every linear once, in the step's order, on random inputs of the same width)."""
    model, kind, _ = load(ref, "step")
    kvs = _prefill(model, 1)
    bandwidth = read_bandwidth()
    read = weights_read(model)
    bound_ms = read / bandwidth * 1e3
    projections = [m for m in model.modules() if isinstance(m, (PackedLinear, torch.nn.Linear))]  # in step order

    @torch.no_grad()
    def linears_alone(x: dict[int, torch.Tensor]) -> None:
        for projection in projections:
            projection(x[projection.in_features])

    cells = []
    for width in widths:
        inputs = {m.in_features: torch.randn(1, width, m.in_features) for m in projections}
        best = min(_time(model, _rows(model, 1, width, kvs), n) for _ in range(repeats))
        alone = float("inf")
        for _ in range(repeats):
            began = time.perf_counter()
            linears_alone(inputs)
            alone = min(alone, time.perf_counter() - began)
        cells.append({"width": width, "ms": round(best * 1e3, 3), "over_bound": round(best * 1e3 / bound_ms, 3),
                      "linears_ms": round(alone * 1e3, 3), "linears_over_bound": round(alone * 1e3 / bound_ms, 3)})
    return {"model": ref, "what": kind, "weights_read_mb": round(read / 2**20, 1),
            "read_gb_s": round(bandwidth / 1e9, 2), "bound_ms": round(bound_ms, 3), "cells": cells}


def measure_cache(ref: str, calls: int = 100) -> dict:
    """The step of ``ref`` (the near-zero model) and its LM head + greedy argmax at ``CACHE_SHAPES``, each call
    timed alone: ``flushed`` (a buffer twice the last-level cache written first: weights and the code's working
    set come back from memory), ``warm`` (the third call in a row), ``spun`` (after ``PAUSE_S`` of a Python loop
    that touches no memory) and ``slept`` (after ``PAUSE_S`` asleep, as a service waits for its next step).
    What spun and slept add over warm is what a step pays for the time since the last one: the caches' content
    ages (other processes, other tenants of a shared cache), whether or not the core idled. Medians,
    milliseconds; the states interleaved call by call."""
    from specsplit.lmkit.sampling import row_argmax

    model, kind, _ = load(ref, "step")
    flush = torch.ones(2 * _last_level_cache_bytes() // 4)
    kvs = _prefill(model, max(rows for rows, _ in CACHE_SHAPES))
    head = model.get_output_embeddings()
    hidden = int(model.config.hidden_size)

    def forward(rows, width):
        steps = _rows(model, rows, width, kvs)
        return lambda: packed_rows.forward_rows(model, steps)

    def decide(rows, width):
        states = torch.randn(rows * width, hidden, generator=torch.Generator().manual_seed(rows * width))
        return lambda: row_argmax(head(states))

    def before(state: str, fn) -> None:
        if state == "flushed":
            flush.add_(1.0)
        elif state == "warm":
            for _ in range(2):
                fn()
        elif state == "spun":
            until = time.perf_counter() + PAUSE_S
            while time.perf_counter() < until:
                pass
        else:
            time.sleep(PAUSE_S)

    cells = []
    for part, make in (("step", forward), ("lm_head_argmax", decide)):
        for rows, width in CACHE_SHAPES:
            fn, times = make(rows, width), {state: [] for state in CACHE_STATES}
            with torch.inference_mode():
                fn()
                for _ in range(calls):
                    for state in CACHE_STATES:
                        before(state, fn)
                        began = time.perf_counter()
                        fn()
                        times[state].append(time.perf_counter() - began)
            median = {state: sorted(t)[len(t) // 2] * 1e3 for state, t in times.items()}
            cells.append({"part": part, "rows": rows, "width": width,
                          **{f"{state}_ms": round(ms, 3) for state, ms in median.items()},
                          **{f"{state}_over_warm": round(median[state] / median["warm"], 2)
                             for state in CACHE_STATES if state != "warm"}})
    head_bytes = int(model.config.vocab_size) * hidden * torch.finfo(model.dtype).bits // 8
    return {"model": "random Llama, 1 layer, hidden 16, vocabulary 49152 (near-zero compute)", "what": kind,
            "lm_head_bytes": head_bytes, "flush_bytes": flush.numel() * flush.element_size(), "pause_s": PAUSE_S,
            "calls": calls, "cells": cells}


ENGINE_CONTEXTS = (64, 600, 3000)  # tokens a session holds: a chat turn, a long answer, a long document


def measure_engine(ref: str, sessions: int = 32, k: int = 4, steps: int = 20, repeats: int = 5) -> list[dict]:
    """The target engine's whole batched step for ``ref`` (the near-zero model) in this process: ``sessions``
    sessions, each verifying a chain of ``k`` (planning from the session's cache, one packed forward, the greedy
    decisions, the commits), by the sessions' context length; ms a step, the best of ``repeats`` runs of
    ``steps`` steps. What grows with the context beyond attention is per-step bookkeeping the step should not pay."""
    from specsplit.lmkit.kinds import VerificationMode
    from specsplit.lmkit.sampling import SamplingParams
    from specsplit.lmkit.sessions import SessionLimits
    from specsplit.target_service.engine import TargetEngine, VerifyItem

    engine = TargetEngine(models.load_model(models.ModelSpec(ref)), model_id="near-zero", vocab_fingerprint="",
                          limits=SessionLimits(max_sessions=sessions))
    rows = []
    for context in ENGINE_CONTEXTS:
        opened = [engine.open(f"c{context}-{i}", [(7 * j + 11 * i) % 1000 + 100 for j in range(context)],
                              SamplingParams(), VerificationMode.GREEDY) for i in range(sessions)]
        for session in opened:
            engine.verify(session, len(session.tokens), [], None)  # the prefill, alone
        block = [(5 * j) % 1000 + 100 for j in range(k)]
        best = float("inf")
        for _ in range(repeats):
            began = time.perf_counter()
            for _ in range(steps):
                engine.verify_batch([VerifyItem(s, len(s.tokens), block, None) for s in opened])
            best = min(best, (time.perf_counter() - began) / steps)
        for session in opened:
            engine.close(session.session_id)
        rows.append({"context": context, "sessions": sessions, "k": k, "ms_per_step": round(best * 1e3, 3),
                     "us_per_session": round(best / sessions * 1e6, 1)})
    return rows


DRAFT_FORWARDS = ("stock", "off")  # lmkit.forward's modes the draft part compares: stock, and the fast forward


def _drafting_models(ref: str, mode: str) -> dict:
    """--model and its self-drafts (half its layers; int8), set up as serve-draft sets them up for ``mode``."""
    from specsplit.draft_service import self_draft
    from specsplit.lmkit import forward

    model = models.load_model(models.ModelSpec(ref))
    drafting = {"model": model,
                "layer-skip": self_draft.layerskip_view(model, max(self_draft.layer_count(model) // 2, 1)),
                "int8": self_draft.quantized_view(model, self_draft.QuantizeMode.INT8)}
    return {name: (m, forward.install(m, mode)) for name, m in drafting.items()}  # every view: packed rows at least


def measure_draft(ref: str, k: int, repeats: int = 3, n: int = 5) -> dict:
    """The model drafter's proposal of 1 and of ``k`` greedy tokens after a 64-token context (its cache warm: each
    proposal re-feeds the context's last token and drafts), per drafting model and forward, interleaved, the
    fastest repeat kept; the proposals of the two forwards must be the same tokens."""
    from specsplit.draft_service.model_drafter import ModelDrafter
    from specsplit.lmkit.sampling import SamplingParams

    context = [(11 * i + 5) % 1000 + 100 for i in range(CONTEXT)]
    loaded = {mode: _drafting_models(ref, mode) for mode in DRAFT_FORWARDS}
    drafters = {(mode, name): ModelDrafter(m, context, SamplingParams(), False)
                for mode, models_ in loaded.items() for name, (m, _) in models_.items()}
    for drafter in drafters.values():
        drafter.prepare()
    mismatch = []
    for name in loaded["stock"]:
        proposed = {mode: drafters[(mode, name)].propose(k).tokens for mode in DRAFT_FORWARDS}
        if len(set(map(tuple, proposed.values()))) > 1:
            mismatch.append({"drafter": name, **proposed})
    times: dict[tuple, list[float]] = {}
    for _ in range(repeats):
        for tokens in (1, k):
            for key, drafter in drafters.items():
                drafter.propose(tokens)
                began = time.perf_counter()
                for _ in range(n):
                    drafter.propose(tokens)
                times.setdefault((*key, tokens), []).append((time.perf_counter() - began) / n)
    cells = []
    for name in loaded["stock"]:
        for tokens in (1, k):
            stock, fast = (min(times[(mode, name, tokens)]) for mode in DRAFT_FORWARDS)
            cells.append({"drafter": name, "tokens": tokens, "stock_ms": round(stock * 1e3, 3),
                          "fast_ms": round(fast * 1e3, 3), "speedup": round(stock / fast, 3)})
    return {"model": ref, "k": k, "what": {name: loaded["off"][name][1] for name in loaded["off"]},
            "cells": cells, "mismatches": mismatch}


def measure_families(repeats: int, n: int = 5) -> dict:
    """Each family's tiny model (``bench/families.py``) and Gemma 3 270M (real weights, where its packages are
    installed): a decode step (1 token fed) and a verify of 5 (the context's last token and a block of 4) after a
    64-token context, through a session cache over transformers' stock forward and over the fast one
    (``forward.install(model, "off")``), interleaved, the fastest repeat kept; the argmax of every row must agree."""
    import copy

    from specsplit.bench.families import FAMILIES, save_family
    from specsplit.lmkit import forward
    from specsplit.lmkit.kvcache import SessionCache

    context = [(11 * i + 5) % 1000 + 100 for i in range(CONTEXT)]
    block = [(7 * i + 3) % 1000 + 100 for i in range(4)]
    cells, mismatch = [], []
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = models.load_tokenizer(models.DEFAULT_MODEL)
        refs = {family: str(save_family(Path(tmp) / family, family, tokenizer)) for family in FAMILIES}
        if models.gemma_installed():
            refs["gemma3-270m (real)"] = models.GEMMA3_270M
        for family, ref in refs.items():
            stock = models.load_model(models.ModelSpec(ref))
            fast = copy.deepcopy(stock)
            what = forward.install(fast, "off")
            caches = {"stock": SessionCache(stock), "fast": SessionCache(fast)}
            rows = {name: cache.logits(context, block) for name, cache in caches.items()}
            if not torch.equal(rows["stock"].argmax(-1), rows["fast"].argmax(-1)):
                mismatch.append({"family": family, **{name: r.argmax(-1).tolist() for name, r in rows.items()}})
            times: dict[tuple, list[float]] = {}
            for _ in range(repeats):
                for fed in ((), block):
                    for name, cache in caches.items():
                        cache.logits(context, fed)
                        began = time.perf_counter()
                        for _ in range(n):
                            cache.logits(context, fed)
                        times.setdefault((name, len(fed) + 1), []).append((time.perf_counter() - began) / n)
            for width in (1, len(block) + 1):
                stock_s, fast_s = min(times[("stock", width)]), min(times[("fast", width)])
                cells.append({"family": family, "width": width, "stock_ms": round(stock_s * 1e3, 3),
                              "fast_ms": round(fast_s * 1e3, 3), "speedup": round(stock_s / fast_s, 3), "what": what})
            del stock, fast, caches
    return {"context": CONTEXT, "cells": cells, "mismatches": mismatch}


STATIC_CONTEXTS = (512, 2048, 8192)


def measure_static(ref: str, repeats: int) -> dict:
    """--model's static step (``lmkit.graph_step``, uncaptured here) at each of ``STATIC_CONTEXTS`` held positions:
    ``gpu_stages.static_contexts``, the GPU check's stage, on this CPU."""
    from dataclasses import replace

    from specsplit.bench import gpu_stages

    model = models.load_model(models.ModelSpec(ref))
    sizes = replace(gpu_stages.TINY_SIZES, widths=(1, 4, 16), contexts=STATIC_CONTEXTS, warmup=1, reps=repeats)
    return {"model": ref, **gpu_stages.static_contexts(model, sizes, int(model.config.vocab_size))}


def run(args) -> int:
    from specsplit.bench.overhead import tiny_model

    torch.set_num_threads(1)
    parts = {p.strip() for p in args.step_parts.split(",") if p.strip()}
    if not parts or parts - set(PARTS):
        raise ValueError(f"--step-parts: any of {', '.join(PARTS)}, got {args.step_parts!r}")
    widths = [int(w) for w in args.step_widths.split(",")]
    batches = [int(b) for b in args.step_batches.split(",")]
    if min(widths) < 1 or min(batches) < 1 or args.step_repeats < 1:
        raise ValueError("--step-widths, --step-batches and --step-repeats take positive integers")
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(tempfile.gettempdir()) / "specsplit-bench-inductor"))
    started = time.time()
    results, cache, engine = [], None, []
    with tempfile.TemporaryDirectory() as tmp:  # the near-zero model, written once for every part that runs it
        tiny = str(tiny_model(Path(tmp) / "near-zero")) if parts & {"forward", "cache", "engine"} else ""
        if "forward" in parts:
            near_zero = measure_model(tiny, widths, batches, args.step_repeats, lambda b, w: 200 if b == 1 else 50)
            near_zero["model"] = "random Llama, 1 layer, hidden 16, vocabulary 49152 (near-zero compute)"
            real = measure_model(args.model, widths, batches, args.step_repeats,
                                 lambda b, w: 3 if b * w <= 16 else 1)
            results = [near_zero, real]
        decision = measure_decision(widths) if "decision" in parts else []
        cache = measure_cache(tiny) if "cache" in parts else None
        engine = measure_engine(tiny) if "engine" in parts else []
        linears = measure_linears() if "linears" in parts else []
        bound = measure_bound(args.model, widths) if "bound" in parts else None
        draft = measure_draft(args.model, args.step_draft_k, args.step_repeats) if "draft" in parts else None
        static = measure_static(args.model, max(args.step_repeats, 3)) if "static" in parts else None
        families = measure_families(args.step_repeats) if "families" in parts else None
    out = {
        "benchmark": "step", "threads": 1, "context": CONTEXT, "widths": widths, "batches": batches,
        "repeats": args.step_repeats, "results": results, "decision": decision, "cache": cache, "engine": engine,
        "linears": linears, "bound": bound, "draft": draft, "static": static, "families": families, "machine": runs.machine(),
        "duration_s": round(time.time() - started, 1),
    }
    path = runs.write(out, args.json)
    png = plot(out, path.with_suffix(".png")) if results else None
    for result in out["results"]:
        print(result["model"])
        for mode, first in result["modes"].items():
            print(f"  {mode}: {first['what']}; compile {first['compile_s']} s, first prefill {first['first_prefill_ms']} ms")
        for row in result["cells"]:
            print(f"  batch {row['batch']:>2} width {row['width']}: {row['mode']:>12} {row['ms']:9.3f} ms "
                  f"(x{row['vs_transformers']:.2f} vs transformers, t/t1 {row['t_over_t1']:.2f})")
        print(f"  mismatches: {result['mismatches'] or 'none'}")
    for row in out["decision"]:
        print(f"greedy decision, {row['rows']} x {row['vocab']}: max {row['max_us']} us, row_argmax "
              f"{row['row_argmax_us']} us (x{row['ratio']})")
    for row in (cache or {}).get("cells", ()):
        print(f"near-zero {row['part']}, {row['rows']} x {row['width']}: warm {row['warm_ms']} ms; "
              + ", ".join(f"{state} {row[state + '_ms']} ms (x{row[state + '_over_warm']})"
                          for state in CACHE_STATES if state != "warm"))
    for row in out["engine"]:
        print(f"near-zero engine step, {row['sessions']} sessions x k {row['k']}, context {row['context']}: "
              f"{row['ms_per_step']} ms ({row['us_per_session']} us a session)")
    for row in out["linears"]:
        print(f"linear {row['out']} x {row['in']}, {row['rows']:>3} rows: packed {row['packed_us']} us, plain "
              f"{row['plain_us']} us (x{row['plain_over_packed']}); {'packed' if row['packed'] else 'plain'} by default")
    if bound:
        print(f"{bound['model']} ({bound['what']}): reads {bound['weights_read_mb']} MiB of weights a step; one thread "
              f"reads {bound['read_gb_s']} GB/s: bound {bound['bound_ms']} ms")
        for row in bound["cells"]:
            print(f"  width {row['width']}: {row['ms']} ms, x{row['over_bound']} the bound; its linears alone "
                  f"{row['linears_ms']} ms, x{row['linears_over_bound']}")
    if draft:
        _print_against_stock(f"the model drafter on {draft['model']}", draft,
                             lambda row: f"{row['drafter']:>10}, {row['tokens']} token(s)",
                             lambda row: draft["what"][row["drafter"]])
    if static:
        print(f"the static step of {static['model']} (uncaptured; spans {static['spans_blocks']} blocks of "
              f"{static['block_size']}):")
        for row in static["contexts"]:
            print(f"  {row['context']} positions held, span {row['span_blocks']}: verify ms {row['verify_ms']}; "
                  f"reading every block {row['verify_ms_full_span']} (t(1) x{row['full_span_over_held']})")
    if families:
        _print_against_stock(f"each family, a session cache after {families['context']} tokens", families,
                             lambda row: f"{row['family']:>18}, width {row['width']}", lambda row: row["what"])
    print(f"-> {path}" + (f", {png}" if png else ""))
    failed = any(r["mismatches"] for r in out["results"]) or \
        any((part or {}).get("mismatches") for part in (draft, families))
    return 1 if failed else 0


def _print_against_stock(title: str, part: dict, label, what) -> None:
    """A part's cells, each a ``label``led row timed on transformers' stock forward and on the fast one."""
    print(f"{title}, stock forward against the fast one:")
    for row in part["cells"]:
        print(f"  {label(row)}: stock {row['stock_ms']} ms, fast {row['fast_ms']} ms (x{row['speedup']}; {what(row)})")
    print(f"  mismatches: {part['mismatches'] or 'none'}")


def plot(out: dict, path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    results = out["results"]
    fig, axes = plt.subplots(len(results), len(out["batches"]), figsize=(4.2 * len(out["batches"]), 3.6 * len(results)),
                             squeeze=False)
    for row_axes, result in zip(axes, results):
        for ax, batch in zip(row_axes, out["batches"]):
            for mode in MODES:
                cells = [c for c in result["cells"] if c["batch"] == batch and c["mode"] == mode]
                ax.plot([c["width"] for c in cells], [c["ms"] for c in cells], marker="o", label=mode)
            ax.set(xlabel="verify width (tokens per row)", ylabel="ms per forward",
                   title=f"{result['model'][:40]}\nbatch {batch}")
            ax.title.set_fontsize(8)
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

"""Mutation checks: one-line faults in the fast paths, each of which the unit and services tiers must catch.

    python tests/mutants.py [--only NAME ...] [--json FILE]      (``make mutants``; not part of ``make test``)

Each mutant replaces one line of the source (its ``before`` text, found exactly once) with a faulty one and runs
the tests it names, unit and services tier (the fast ones: not ``slow``), stopping at the first failure: the
mutant is *killed* when a test fails, *survived* when they all pass. The tests first run unmutated and must
pass. The file is restored whatever happens (an interrupt included). Exit status 0 only when every mutant was
killed.

The list grows with every fast path: a new forward, cache or scheduler path adds the faults that would break
it silently (keys and values at the wrong place, a padded row in a real slot, a stale rejected token, ...),
with the tests that are meant to see them.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Mutant:
    name: str
    path: str  # relative to the repository root
    before: str  # the text replaced, found exactly once in ``path``
    after: str
    tests: tuple[str, ...]  # pytest node ids or files, unit and services tier


GRAPH_TESTS = ("tests/unit/lmkit/test_graph_step.py", "tests/unit/target_service/test_graph_engine.py")
PACKED_TESTS = (
    "tests/unit/lmkit/test_packed_rows.py",
    "tests/unit/target_service/test_batched_forward.py",
    "tests/services/test_greedy_e2e.py",
)

DRAFT_TESTS = ("tests/unit/draft_service/test_draft_forward.py", "tests/services/test_drafters_e2e.py")
CHAIN_TESTS = ("tests/unit/lmkit/test_chain_step.py", "tests/unit/draft_service/test_draft_forward.py")

MUTANTS = (
    Mutant(
        "paged step: a token's keys and values written at its position, not in its block",
        "lmkit/graph_step.py",
        "write_index = (written * size + inputs.positions % size).reshape(-1)",
        "write_index = (inputs.positions + 0 * written).reshape(-1)",
        GRAPH_TESTS,
    ),
    Mutant(
        "paged step: a step reads the shortest span whatever its rows hold",
        "lmkit/graph_step.py",
        "return next(span for span in self.spans if span >= need)",
        "return self.spans[0]",
        GRAPH_TESTS,
    ),
    Mutant(
        "static step: a tree node's rotary position its place in the block, not its depth",
        "lmkit/graph_step.py",
        "[start + position for position in positions], mask",
        "[start + place for place in range(count)], mask",
        GRAPH_TESTS,
    ),
    Mutant(
        "static step: a tree's accepted path left where its nodes were",
        "lmkit/graph_step.py",
        "        self._graph.keep_path(self.slot, length, path)\n",
        "        pass\n",
        GRAPH_TESTS,
    ),
    Mutant(
        "static step: a feature layer's hidden state taken after the layer, not entering it",
        "lmkit/graph_step.py",
        "            hidden = step.attention_outputs(hidden, attended.transpose(1, 2), *layer.outputs)\n",
        "            hidden = step.attention_outputs(hidden, attended.transpose(1, 2), *layer.outputs)\n"
        "            if layer.index in kept:\n                kept[layer.index] = hidden\n",
        GRAPH_TESTS,
    ),
    Mutant(
        "decoder step: Qwen3's q and k norms skipped",
        "lmkit/decoder_step.py",
        "    if qk_norms is not None:\n",
        "    if qk_norms is not None and False:\n",
        ("tests/unit/lmkit/test_families.py",),
    ),
    Mutant(
        "decoder step: Phi-3's fused gate and up taken in the wrong order",
        "lmkit/decoder_step.py",
        "        gate, up = gate_up(x)\n",
        "        up, gate = gate_up(x)\n",
        ("tests/unit/lmkit/test_families.py",),
    ),
    Mutant(
        "decoder step: Gemma 3's sliding layers turned at the full layers' rotary base",
        "lmkit/decoder_step.py",
        'kinds[i] if len(self.rotaries) > 1 else "full_attention"',
        '"full_attention" if len(self.rotaries) > 1 else "full_attention"',
        ("tests/unit/lmkit/test_families.py",),
    ),
    Mutant(
        "decoder step: Gemma 3's embeddings left unscaled",
        "lmkit/decoder_step.py",
        "            self.embedding = lambda ids: lookup(ids) * scale\n",
        "            self.embedding = lambda ids: lookup(ids)\n",
        ("tests/unit/lmkit/test_families.py",),
    ),
    Mutant(
        "decoder step: Gemma 3's attention output added to the residual unnormed",
        "lmkit/decoder_step.py",
        "    hidden = residual + (attention if norms[0] is None else norms[0](attention))\n",
        "    hidden = residual + attention\n",
        ("tests/unit/lmkit/test_families.py",),
    ),
    Mutant(
        "decoder step: Gemma's norm scaled by its weight, not 1 + weight",
        "lmkit/decoder_step.py",
        "    return (out * (1.0 + weight.float())).type_as(x)\n",
        "    return (out * weight.float()).type_as(x)\n",
        ("tests/unit/lmkit/test_families.py",),
    ),
    Mutant(
        "sliding KV: a row's mask not cut to the positions a sliding layer still holds",
        "lmkit/decoder_step.py",
        "        if front:  # a sliding layer's buffer holds positions front.. only\n",
        "        if False:\n",
        ("tests/unit/lmkit/test_families.py",),
    ),
    Mutant(
        "sliding KV: a tree's path moved to positions counted from 0, not from the layer's front",
        "lmkit/kv_buffer.py",
        "                at = start - self.fronts[layer]\n",
        "                at = start\n",
        ("tests/unit/lmkit/test_families.py",),
    ),
    Mutant(
        "sliding KV: a step planned past what the sliding layers hold",
        "lmkit/kvcache.py",
        "        if keep < self.copy_floor:",
        "        if False:",
        ("tests/unit/lmkit/test_families.py",),
    ),
    Mutant(
        "tensor parallel: a tree's accepted path moved on rank 0's shard alone",
        "target_service/tp.py",
        "            self._leader.announce(OP_KEEP_PATH, self.slot, length, path)\n",
        "            pass\n",
        ("tests/services/test_tensor_parallel.py",),
    ),
    Mutant(
        "decoder step: Mixtral's routed experts skipped (the feed-forward returns nothing)",
        "lmkit/decoder_step.py",
        "            feed_forward = mlp\n",
        "            feed_forward = torch.zeros_like\n",
        ("tests/unit/lmkit/test_families.py",),
    ),
    Mutant(
        "sharded decoder step: a row-parallel projection's partial sums not all-reduced",
        "lmkit/decoder_step.py",
        "            return lambda x: _all_reduce(F.linear(x, weight))",
        "            return lambda x: F.linear(x, weight)",
        ("tests/services/test_tp_step.py",),
    ),
    Mutant(
        "sharded decoder step: the embedding's split vocabulary looked up from row 0 on every rank",
        "lmkit/decoder_step.py",
        "    first = dist.get_rank() * table.shape[0]",
        "    first = 0 * table.shape[0]",
        ("tests/services/test_tp_step.py",),
    ),
    Mutant(
        "packed rows: a sliding window left out of a row's mask",
        "lmkit/packed_rows.py",
        "mask if size is None else mask & window_mask(step.start, fed, size)",
        "mask",
        ("tests/unit/lmkit/test_families.py",),
    ),
    Mutant(
        "static step: Mistral's sliding window measured from a tree node's place in the block, not its depth",
        "lmkit/graph_step.py",
        "> inputs.rope[:, None, :, None] - window)",
        "> inputs.positions[:, None, :, None] - window)",
        ("tests/unit/lmkit/test_families.py",),
    ),
    Mutant(
        "draft chain: a coupled tree's second choice taken from the logits, not from log q + G",
        "lmkit/chain_step.py",
        '                runner = scores[0].index_fill(0, token.view(1), float("-inf"))\n',
        '                runner = logits.double().index_fill(0, token.view(1), float("-inf"))\n',
        CHAIN_TESTS,
    ),
    Mutant(
        "draft chain: a greedy tree's second choice may be the drafted token itself",
        "lmkit/chain_step.py",
        "                branch = probs.index_fill(0, token.view(1), -1.0).argmax()\n",
        "                branch = probs.argmax()\n",
        CHAIN_TESTS,
    ),
    Mutant(
        "draft chain: a penalized request's logits left unadjusted",
        "lmkit/chain_step.py",
        "            logits = penalties.adjust(chain.step.logits[0, 0].float(), self.penalties, position)  # [vocab]\n",
        "            logits = chain.step.logits[0, 0].float()\n",
        CHAIN_TESTS,
    ),
    Mutant(
        "draft chain: a drafted token not counted for the next position's penalties",
        "lmkit/chain_step.py",
        "            self.penalties[\"generated\"].index_add_(0, token.view(1), self._one)  # counted in for the next position\n",
        "",
        CHAIN_TESTS,
    ),
    Mutant(
        "draft chain: a penalized chain's adjustments left for the next request",
        "lmkit/chain_step.py",
        "        if penalized is not None or self._penalized:",
        "        if penalized is not None:",
        CHAIN_TESTS,
    ),
    Mutant(
        "draft chain: each step fed at the chain's first position",
        "lmkit/chain_step.py",
        "            chain.step.positions.add_(1)\n",
        "",
        CHAIN_TESTS,
    ),
    Mutant(
        "draft chain: the last drafted token taken as cached",
        "lmkit/graph_step.py",
        "self.end_step([context[-1], *chained.tokens[:-1]])",
        "self.end_step([context[-1], *chained.tokens])",
        CHAIN_TESTS,
    ),
    Mutant(
        "draft chain: a context two tokens past the cache chained from its last token alone",
        "lmkit/graph_step.py",
        "            self.apply(keep, feed[:-1], 1)\n",
        "            pass\n",
        CHAIN_TESTS,
    ),
    Mutant(
        "draft chain: q not rounded as it travels before the inverse CDF draws from it",
        "lmkit/chain_step.py",
        "    q = torch.where(settings.quantize, probs_codec.quantize_unchecked(q), q)\n",
        "",
        CHAIN_TESTS,
    ),
    Mutant(
        "draft chain: the top-p cut keeps the token whose mass before it reaches top_p",
        "lmkit/sampling.py",
        "(mass < top_p)",
        "(mass <= top_p)",
        (*CHAIN_TESTS, "tests/unit/lmkit/test_sampling.py"),
    ),
    Mutant(
        "draft chain: each position's noise keyed one position early",
        "lmkit/chain_step.py",
        "range(start + 1, start + 1 + k)",
        "range(start, start + k)",
        CHAIN_TESTS,
    ),
    Mutant(
        "captured step: keys and values written one position off",
        "lmkit/graph_step.py",
        "write_index = (written * size + inputs.positions % size).reshape(-1)",
        "write_index = (written * size + (inputs.positions + 1) % size).reshape(-1)",
        GRAPH_TESTS,
    ),
    Mutant(
        "captured step: a padded row lands in a real slot",
        "lmkit/graph_step.py",
        "slots = torch.full((batch,), self.scratch, dtype=torch.long)",
        "slots = torch.full((batch,), 0, dtype=torch.long)",
        GRAPH_TESTS,
    ),
    Mutant(
        "captured step: two replay groups share one output",
        "lmkit/graph_step.py",
        "            if len(groups) > 1:\n",
        "            if False:\n",
        GRAPH_TESTS,
    ),
    Mutant(
        "captured step: a released slot keeps its last session's values",
        "lmkit/graph_step.py",
        "            self._graph.clear(self.slot)\n",
        "",
        GRAPH_TESTS,
    ),
    Mutant(
        "decoder step: keys and values written one position off",
        "lmkit/decoder_step.py",
        "row.kv.write(layer.index, row.start, k[:, :, fed], v[:, :, fed])",
        "row.kv.write(layer.index, row.start + 1, k[:, :, fed], v[:, :, fed])",
        PACKED_TESTS,
    ),
    Mutant(
        "packed rows: rotary positions restart at 0 every block",
        "lmkit/packed_rows.py",
        "positions.extend(range(step.start, step.start + width) if step.positions is None else step.positions)",
        "positions.extend(range(0, width) if step.positions is None else step.positions)",
        PACKED_TESTS,
    ),
    Mutant(
        "session cache: a rejected token kept after rollback",
        "lmkit/kvcache.py",
        "        extra = len(self._tokens) - length\n",
        "        extra = 0\n",
        ("tests/unit/draft_service/test_model_drafter.py", "tests/unit/target_service/test_batched_forward.py",
         "tests/services/test_greedy_e2e.py"),
    ),
    Mutant(
        "captured step: a rollback forgets nothing",
        "lmkit/graph_step.py",
        "    def crop(self, length: int) -> None:\n        self._forget_from(length)\n",
        "    def crop(self, length: int) -> None:\n        pass\n",
        GRAPH_TESTS,
    ),
    Mutant(
        "draft: the model drafter ignores the engine's caches",
        "draft_service/model_drafter.py",
        "        self._cache = new_cache(model)\n",
        "        self._cache = SessionCache(model)\n",
        DRAFT_TESTS,
    ),
    Mutant(
        "draft: a closed session keeps its slot",
        "draft_service/model_drafter.py",
        "    def close(self) -> None:\n        self._cache.release()\n",
        "    def close(self) -> None:\n        pass\n",
        DRAFT_TESTS,
    ),
    Mutant(
        "packed rows: a view's copied layers keep their own attention",
        "lmkit/packed_rows.py",
        "            config._attn_implementation = ATTENTION\n",
        "            pass\n",
        DRAFT_TESTS,
    ),
    Mutant(
        "chunked prefill: a chunk's keys and values dropped",
        "target_service/engine.py",
        "        self.prefill_chunks += sum(chunked)\n",
        "        self.prefill_chunks += sum(chunked)\n"
        "        [t[:, :, s.keep : s.keep + len(s.feed)].zero_() for s, c in zip(steps, chunked) if c"
        " for t in (*s.cache.kv.keys, *s.cache.kv.values)]\n",
        ("tests/services/test_chunked_prefill.py",),
    ),
)


def pytest(tests: tuple[str, ...], timeout_s: float) -> tuple[int, float, str]:
    """(exit status, seconds, the last lines of output) of pytest over ``tests``, stopping at the first failure."""
    command = [sys.executable, "-m", "pytest", "-q", "-x", "-m", "not slow", "-p", "no:cacheprovider", *tests]
    start = time.monotonic()
    try:
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return 124, time.monotonic() - start, "timed out"
    lines = (done.stdout + done.stderr).strip().splitlines()
    return done.returncode, time.monotonic() - start, "\n".join(lines[-3:])


def run(mutant: Mutant, timeout_s: float) -> dict:
    path = ROOT / mutant.path
    source = path.read_text()
    if source.count(mutant.before) != 1:
        return {"name": mutant.name, "outcome": "stale", "why": f"its text is in {mutant.path} "
                f"{source.count(mutant.before)} times, not once: update the list"}
    restore = signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # restored by the finally below
    try:
        path.write_text(source.replace(mutant.before, mutant.after))
        status, seconds, tail = pytest(mutant.tests, timeout_s)
    finally:
        path.write_text(source)
        signal.signal(signal.SIGTERM, restore)
    # 1: a test failed. Anything else (an import error, a timeout, no test collected) is not a kill by a test.
    outcome = {0: "survived", 1: "killed"}.get(status, "error")
    return {"name": mutant.name, "outcome": outcome, "status": status, "seconds": round(seconds, 1), "tail": tail}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", default=None, help="run the mutants whose name holds one of these")
    parser.add_argument("--json", type=Path, default=None, help="write the outcomes here")
    parser.add_argument("--timeout-s", type=float, default=900.0, help="per run of the tests")
    args = parser.parse_args(argv)
    chosen = [m for m in MUTANTS if args.only is None or any(word in m.name for word in args.only)]
    if not chosen:
        parser.error(f"no mutant's name holds any of {args.only}; names: {[m.name for m in MUTANTS]}")
    tests = tuple(dict.fromkeys(test for mutant in chosen for test in mutant.tests))
    status, seconds, tail = pytest(tests, args.timeout_s)
    if status != 0:
        print(f"the tests fail unmutated (status {status}, {seconds:.0f} s); fix them first:\n{tail}")
        return 2
    print(f"unmutated: the tests pass ({seconds:.0f} s)")
    results = []
    for mutant in chosen:
        result = run(mutant, args.timeout_s)
        results.append(result)
        print(f"{result['outcome']:>8}  {mutant.name}  ({result.get('seconds', 0)} s)", flush=True)
        if result["outcome"] != "killed":
            print("          " + result.get("tail", result.get("why", "")).replace("\n", "\n          "))
    killed = sum(r["outcome"] == "killed" for r in results)
    print(f"{killed} of {len(results)} mutants killed")
    if args.json:
        args.json.write_text(json.dumps({"killed": killed, "mutants": results}, indent=2) + "\n")
    return 0 if killed == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())

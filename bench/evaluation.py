"""Run a prompt set target-only and speculatively on the same services; collect figures.

Shared by ``specsplit demo`` (prints) and ``specsplit bench`` (writes JSON).
Target-only decoding runs through the same target service with k = 0, so the
speedup compares like with like: same model, threads, prompts and budget.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

from specsplit.bench.prompts import DemoPrompt, chat_ids
from specsplit.lmkit.kinds import DrafterKind
from specsplit.lmkit.sampling import SamplingParams
from specsplit.orchestrator.api.generation import GenerationRequest, Orchestrator


@dataclass
class RunResult:
    prompt: DemoPrompt
    text: str
    token_ids: list[int]
    wall_s: float
    rounds: int
    drafted: int
    accepted: int
    draft_compute_s: float
    target_compute_s: float
    finish: str
    accepted_per_round: list[int] = field(default_factory=list)
    drafted_per_round: list[int] = field(default_factory=list)
    overlap_hits: int = 0
    feature_bytes: int = 0  # hidden features the target sent (feature drafters)
    draft_requests: int = 0  # proposals sent to the draft (``LoopStats.draft_requests``)
    tree_rounds: int = 0  # rounds that verified a token tree (``GenerationStats.tree_rounds``)
    tree_nodes: int = 0  # the drafted tokens of those rounds


@dataclass
class Comparison:
    prompt: DemoPrompt
    baseline: RunResult  # k = 0
    speculative: RunResult

    @property
    def identical(self) -> bool:
        return self.baseline.token_ids == self.speculative.token_ids


async def run_one(
    orch: Orchestrator, prompt: DemoPrompt, k: int, drafter: DrafterKind, max_new_tokens: int,
    sampling: SamplingParams, draft_probs: bool = False, adaptive_k: bool = False, overlap: bool = False,
    chain: tuple[DrafterKind, ...] = (), tree_branches: int = 1,
) -> RunResult:
    request = GenerationRequest(
        prompt.text, True, max_new_tokens, sampling, (), k, drafter, draft_probs, adaptive_k, chain, overlap,
        tree_branches=tree_branches,
    )
    text, ids, event = await generate_to_end(orch, request, chat_ids(orch.tokenizer, prompt))
    s = event.stats
    return RunResult(
        prompt, text, ids, s.wall_s, s.rounds, s.drafted_tokens, s.accepted_tokens,
        s.draft_compute_s, s.target_compute_s, event.finish.name,
        list(event.loop.accepted_per_round), list(event.loop.drafted_per_round), s.overlap_hits,
        s.feature_bytes, event.loop.draft_requests, s.tree_rounds, s.tree_nodes,
    )


async def generate_to_end(orch: Orchestrator, request: GenerationRequest, prompt_ids: list[int]):
    """Run one generation to its end: its text, its token ids and the finishing event (stats, loop)."""
    text, ids = [], []
    # Closed here, its sessions with it: not by a finalizer during the next run or after the channels are gone.
    async with contextlib.aclosing(orch.generate(request, prompt_ids)) as events:
        async for event in events:
            text.append(event.text)
            ids.extend(event.token_ids)
            if event.finish is not None:
                return "".join(text), ids, event
    raise RuntimeError("generation ended without a finish event")


async def compare(
    orch: Orchestrator, prompts: tuple[DemoPrompt, ...], k: int, drafter: DrafterKind, max_new_tokens: int,
    sampling: SamplingParams | None = None, warmup: bool = True, adaptive_k: bool = False, overlap: bool = False,
) -> list[Comparison]:
    sampling = sampling or SamplingParams()
    if warmup:  # first calls pay one-off allocation costs and seed the cost model
        await run_one(orch, prompts[0], k, drafter, 16, sampling, adaptive_k=adaptive_k, overlap=overlap)
        await run_one(orch, prompts[0], 0, drafter, 8, sampling)
    out = []
    for prompt in prompts:
        baseline = await run_one(orch, prompt, 0, drafter, max_new_tokens, sampling)
        speculative = await run_one(
            orch, prompt, k, drafter, max_new_tokens, sampling, adaptive_k=adaptive_k, overlap=overlap
        )
        out.append(Comparison(prompt, baseline, speculative))
    return out


@dataclass
class Summary:
    """Aggregate figures over a group of comparisons."""

    prompts: int = 0
    new_tokens: int = 0
    baseline_s: float = 0.0
    speculative_s: float = 0.0
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    draft_compute_s: float = 0.0
    target_compute_s: float = 0.0
    baseline_target_compute_s: float = 0.0
    baseline_rounds: int = 0
    identical: int = 0
    feature_bytes: int = 0
    tree_rounds: int = 0
    tree_nodes: int = 0
    names: list[str] = field(default_factory=list)

    def add(self, c: Comparison) -> None:
        self.prompts += 1
        self.names.append(c.prompt.name)
        self.new_tokens += len(c.speculative.token_ids)
        self.baseline_s += c.baseline.wall_s
        self.speculative_s += c.speculative.wall_s
        self.rounds += c.speculative.rounds
        self.drafted += c.speculative.drafted
        self.accepted += c.speculative.accepted
        self.draft_compute_s += c.speculative.draft_compute_s
        self.target_compute_s += c.speculative.target_compute_s
        self.baseline_target_compute_s += c.baseline.target_compute_s
        self.baseline_rounds += c.baseline.rounds
        self.identical += int(c.identical)
        self.feature_bytes += c.speculative.feature_bytes
        self.tree_rounds += c.speculative.tree_rounds
        self.tree_nodes += c.speculative.tree_nodes

    @property
    def baseline_tokens(self) -> int:
        return self.baseline_rounds  # one token per target-only round

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        return self.new_tokens / self.rounds if self.rounds else 0.0

    @property
    def tokens_per_s_speculative(self) -> float:
        return self.new_tokens / self.speculative_s if self.speculative_s else 0.0

    @property
    def tokens_per_s_target_only(self) -> float:
        return self.baseline_tokens / self.baseline_s if self.baseline_s else 0.0

    @property
    def speedup(self) -> float:
        base = self.tokens_per_s_target_only
        return self.tokens_per_s_speculative / base if base else 0.0

    @property
    def draft_cost_ratio(self) -> float:
        """c: time of one draft token over time of one target decode step."""
        target_step = self.baseline_target_compute_s / self.baseline_rounds if self.baseline_rounds else 0.0
        draft_token = self.draft_compute_s / self.drafted if self.drafted else 0.0
        return draft_token / target_step if target_step else 0.0


def theoretical_speedup(alpha: float, k: int, c: float) -> float:
    """Leviathan et al. 2023, eq. 1 and thm 3.8: E[tokens per round] / (k c + 1)."""
    if k == 0:
        return 1.0
    expected = k + 1 if alpha >= 1.0 else (1 - alpha ** (k + 1)) / (1 - alpha)
    return expected / (k * c + 1)


def best_fixed_k(alpha: float, c: float, ks) -> tuple[int, float]:
    """The K of ``ks`` (not empty) with the highest ``theoretical_speedup`` for ``alpha`` and ``c``, and that
    speedup; the smallest such K on a tie."""
    return max(((k, theoretical_speedup(alpha, k, c)) for k in ks), key=lambda pair: pair[1])


def summarise(comparisons: list[Comparison]) -> dict[str, Summary]:
    """Per kind and "all"."""
    groups: dict[str, Summary] = {"all": Summary()}
    for c in comparisons:
        groups["all"].add(c)
        groups.setdefault(c.prompt.kind, Summary()).add(c)
    return groups

"""Several samples of one prompt (``GenerateRequest.n``, OpenAI's ``n``): each its own generation, the prompt
prefilled once on the target.

Every sample is a generation of its own (its own draft and target sessions, speculative loop, stop
conditions and stats) with its own seed (``draws.sample_seed``), so a seeded request reproduces each
sample and the samples differ; greedy samples are all the target's greedy output. Sample 0 opens its
target and draft sessions as any generation does; the others wait for those opens, then open theirs
with ``TargetOpen.fork_from`` / ``DraftOpen.fork_from`` naming them, and the services copy the prompt's
keys and values instead of computing them again (the draft where its drafter is a model drafter; an
n-gram drafter has nothing to compute).
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import replace
from typing import AsyncIterator, Sequence

from specsplit.lmkit.draws import sample_seed
from specsplit.orchestrator.api.generation import GenerationEvent, GenerationRequest, Orchestrator, PromptFork


def sample_request(request: GenerationRequest, index: int) -> GenerationRequest:
    """Sample ``index``'s request: the same but for its seed."""
    return replace(request, sampling=replace(request.sampling, seed=sample_seed(request.sampling.seed, index)))


async def generate_samples(
    orch: Orchestrator, request: GenerationRequest, prompt_ids: list[int], n: int, arrived: float | None = None
) -> AsyncIterator[tuple[int, GenerationEvent]]:
    """``n`` generations of the prompt at once: (sample index, event) as each sample commits, until every
    sample has finished. The first sample to fail fails them all (its error is raised); closing this
    generator ends every sample's generation."""
    if n == 1:
        async with contextlib.aclosing(orch.generate(request, prompt_ids, arrived)) as events:
            async for event in events:
                yield 0, event
        return
    source = asyncio.get_running_loop().create_future()

    async def sample(index: int):
        fork = PromptFork(source, leader=index == 0)
        try:
            generation = orch.generate(sample_request(request, index), prompt_ids, arrived, fork)
            async with contextlib.aclosing(generation) as events:
                async for event in events:
                    yield index, event
        finally:
            fork.opened("", "")  # a leader that never opened: the others open alone

    async with contextlib.aclosing(interleaved([sample(i) for i in range(n)], [[i] for i in range(n)])) as events:
        async for indexed in events:
            yield indexed


async def interleaved(
    streams: Sequence[AsyncIterator[tuple[int, GenerationEvent]]], owned: Sequence[Sequence[int]]
) -> AsyncIterator[tuple[int, GenerationEvent]]:
    """Several streams of (index, event) run at once, their events passed on as they arrive, until every index has
    had its finishing event; stream i yields the indices of ``owned[i]``. The first stream to fail fails them all
    (its error is raised); closing this generator ends every stream whose indices have not all finished."""
    arrivals: asyncio.Queue = asyncio.Queue()  # (index, event, error); unbounded: a put never blocks a cancel

    async def pump(stream) -> None:
        try:
            async with contextlib.aclosing(stream):
                async for index, event in stream:
                    arrivals.put_nowait((index, event, None))
        except Exception as exc:  # noqa: BLE001 - handed to the caller, who fails the request with it
            arrivals.put_nowait((None, None, exc))

    tasks = [asyncio.create_task(pump(stream)) for stream in streams]
    finished: set[int] = set()
    total = sum(len(indices) for indices in owned)
    try:
        while len(finished) < total:
            index, event, error = await arrivals.get()
            if error is not None:
                raise error
            if event.finish is not None:
                finished.add(index)
            yield index, event
    finally:
        # A stream whose indices all finished is closing its sessions: let it. The others stop here, once: a second
        # cancel (the caller's scope cancelled again while this waits) would cut their sessions' closes short.
        for indices, task in zip(owned, tasks):
            if not finished.issuperset(indices):
                task.cancel()
        await asyncio.shield(asyncio.gather(*tasks, return_exceptions=True))

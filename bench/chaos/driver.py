"""Drives a chaos run: references first, then clients and the fault schedule together, then the checks."""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field
from typing import Callable

import grpc

from specsplit.bench.chaos import schedule
from specsplit.bench.chaos.checker import Record, Window
from specsplit.bench.chaos.stack import Stack
from specsplit.bench.netem import LinkProcess, Shape
from specsplit.lmkit.processes import rss_mb
from specsplit.v1 import specsplit_pb2 as pb
from specsplit.v1 import specsplit_pb2_grpc as pb_grpc

# Grounded prompts (prompt lookup drafts them) and open ones (it rarely does), as a user's traffic mixes them.
PROMPTS = (
    "Copy this list, one item per line: apples, pears, plums, cherries, figs.",
    "Rewrite `def add(a, b): return a+b` with type hints and a docstring.",
    "From 'Order 1142 shipped to Oslo on 3 May by sea', extract the order number and the city.",
    "Summarise: The river rose overnight and the bridge was closed until the water fell.",
    "Tell me a short story about a lighthouse keeper.",
    "Explain why the sky is blue in two sentences.",
    "Write a haiku about autumn rain.",
    "List five prime numbers and say why each is prime.",
    "Translate to French: The cat sleeps on the warm windowsill.",
    "What is the capital of Norway? Answer in one sentence.",
    "def fibonacci(n):",
    "a b a b a b a b",
)
_CHANNEL = [("grpc.max_reconnect_backoff_ms", 1000), ("grpc.initial_reconnect_backoff_ms", 100)]


@dataclass(frozen=True)
class Entry:
    """One request of the catalogue clients draw from; its fault-free reference is computed first."""

    prompt: str
    max_new_tokens: int
    temperature: float = 0.0  # 0: greedy
    seed: int = 0
    k: int | None = None  # None: the server's default (adaptive)

    def request(self, k: int | None = None) -> pb.GenerateRequest:
        sampling = pb.SamplingParams(temperature=self.temperature)
        if self.temperature > 0:
            sampling.seed = self.seed
            sampling.top_p = 0.95
        msg = pb.GenerateRequest(prompt=self.prompt, chat=True, max_new_tokens=self.max_new_tokens,
                                 sampling=sampling, return_token_ids=True)
        if self.temperature > 0:  # coupled: the seed's tokens whatever k, batching, reopens or re-attaches
            msg.mode = pb.VERIFICATION_MODE_COUPLED
        k = self.k if k is None else k
        if k is not None:
            msg.k = k
        return msg


def catalogue(max_new_tokens: int, sampled: bool) -> list[Entry]:
    greedy = [Entry(p, max_new_tokens, k=k) for p, k in zip(PROMPTS, [None, 4, None, 8, None, 0] * 2)]
    if not sampled:
        return greedy
    return greedy + [Entry(p, max_new_tokens, 0.8, seed) for seed, p in enumerate(PROMPTS[::2], start=11)]


async def _stream(stub, request, timeout_s: float, on_token: Callable[[int], None]) -> tuple[str, str]:
    """Run one Generate, feeding streamed ids to ``on_token``; returns (status name, details)."""
    try:
        async for reply in stub.Generate(request, timeout=timeout_s):
            for token in reply.token_ids:
                on_token(token)
        return "OK", ""
    except grpc.aio.AioRpcError as exc:
        return exc.code().name, exc.details() or ""


async def references(address: str, entries: list[Entry], timeout_s: float) -> dict[int, list[int]]:
    """Each entry alone on the fault-free stack, target-only (k = 0): what every later run must reproduce."""
    out: dict[int, list[int]] = {}
    async with grpc.aio.insecure_channel(address, options=_CHANNEL) as channel:
        stub = pb_grpc.GeneratorStub(channel)
        for i, entry in enumerate(entries):
            tokens: list[int] = []
            code, details = await _stream(stub, entry.request(k=0), timeout_s, tokens.append)
            if code != "OK":
                raise RuntimeError(f"reference run of entry {i} failed before any fault: {code} {details}")
            out[i] = tokens
    return out


@dataclass
class Load:
    """Clients drawing from the catalogue until told to stop, plus the fault runner's one-off requests."""

    address: str
    entries: list[Entry]
    deadline_s: float
    t0: float
    rng: random.Random
    records: list[Record] = field(default_factory=list)
    cancel_next: set[int] = field(default_factory=set)  # clients told to cancel their current stream
    _ids: int = 0

    def now(self) -> float:
        return time.monotonic() - self.t0

    def _new_id(self) -> int:
        self._ids += 1
        return self._ids

    async def client(self, index: int, stop_at: float) -> None:
        async with grpc.aio.insecure_channel(self.address, options=_CHANNEL) as channel:
            stub = pb_grpc.GeneratorStub(channel)
            while time.monotonic() < stop_at:
                entry_index = self.rng.randrange(len(self.entries))
                code = await self._one(stub, index, entry_index)
                if code in ("UNAVAILABLE", "RESOURCE_EXHAUSTED"):
                    await asyncio.sleep(0.2)  # a well-behaved client backs off

    async def _one(self, stub, client: int, entry_index: int) -> str:
        entry = self.entries[entry_index]
        record = Record(self._new_id(), client, "generate", entry_index, self.now(), 0.0, self.deadline_s, "")
        call = stub.Generate(entry.request(), timeout=self.deadline_s)
        try:
            async with asyncio.timeout(self.deadline_s + 5.0):  # the watchdog: a stream past its deadline hangs
                async for reply in call:
                    record.tokens.extend(reply.token_ids)
                    if client in self.cancel_next and record.tokens:
                        self.cancel_next.discard(client)
                        record.kind = "cancel"
                        call.cancel()
                        break
            record.code = "CANCELLED" if record.kind == "cancel" else "OK"
        except grpc.aio.AioRpcError as exc:
            record.code, record.details = exc.code().name, exc.details() or ""
        except TimeoutError:
            call.cancel()
            record.code = "HANG"
        record.ended_s = self.now()
        self.records.append(record)
        return record.code

    async def special(self, kind: str, max_context: int) -> None:
        """A request built to fail: ``malformed`` bytes, a ``bad_request`` field, an ``oversize`` prompt."""
        record = Record(self._new_id(), -1, kind, -1, self.now(), 0.0, 30.0, "")
        async with grpc.aio.insecure_channel(self.address, options=_CHANNEL) as channel:
            try:
                if kind == "malformed":
                    call = channel.unary_stream("/specsplit.v1.Generator/Generate",
                                                request_serializer=lambda raw: raw,
                                                response_deserializer=pb.GenerateResponse.FromString)
                    async for _ in call(b"\xff\xff\x07not a GenerateRequest", timeout=30.0):
                        pass
                else:
                    if kind == "bad_request":
                        msg = pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(temperature=-1.0))
                    else:
                        msg = pb.GenerateRequest(prompt="word " * (max_context + 64), chat=False)
                    async for _ in pb_grpc.GeneratorStub(channel).Generate(msg, timeout=30.0):
                        pass
                record.code = "OK"
            except grpc.aio.AioRpcError as exc:
                record.code, record.details = exc.code().name, exc.details() or ""
        record.ended_s = self.now()
        self.records.append(record)


class LinkControl:
    """The draft links' faults, applied to the emulated links (bench/netem) the orchestrator reaches each draft
    replica through, all of them at once."""

    def __init__(self, links: list[LinkProcess]) -> None:
        self._links = links

    async def stall(self, seconds: float) -> None:
        """The links forward nothing for ``seconds`` (connections stay open, bytes are held), then resume."""
        for link in self._links:
            link.stall()
        try:
            await asyncio.sleep(seconds)
        finally:
            for link in self._links:
                link.resume()

    async def delay(self, delay_ms: float, seconds: float) -> None:
        """Every byte read in the next ``seconds`` is held ``delay_ms`` each way; then the links are plain again."""
        await asyncio.gather(*(asyncio.to_thread(link.set_shape, Shape.from_ms(delay_ms)) for link in self._links))
        try:
            await asyncio.sleep(seconds)
        finally:
            await asyncio.gather(*(asyncio.to_thread(link.set_shape, Shape()) for link in self._links))


def _one_of(replicas: list, rng: random.Random):
    """The replica a fault lands on (one of a pool, drawn; the only one, without a draw)."""
    return replicas[0] if len(replicas) == 1 else rng.choice(replicas)


async def run_faults(stack: Stack, faults: list[schedule.Fault], load: Load, link: LinkControl,
                     clients: int, max_context: int, rng: random.Random) -> list[Window]:
    """Apply each fault at its time; returns the windows during which something was down or degraded."""
    windows: list[Window] = []
    for fault in faults:
        await asyncio.sleep(max(0.0, fault.at_s - load.now()))
        start = load.now()
        if fault.kind in ("draft_kill", "target_kill"):
            service = _one_of(stack.drafts if fault.kind == "draft_kill" else stack.targets, rng)
            service.kill()
            await asyncio.to_thread(stack.restart, service, fault.hold_s)
        elif fault.kind == "partition":
            await asyncio.to_thread(stack.partition, _one_of([*stack.targets, *stack.drafts], rng), fault.hold_s)
        elif fault.kind == "orchestrator_drain":
            await asyncio.to_thread(stack.orchestrator.drain, stack.grace_s)
            await asyncio.to_thread(stack.restart, stack.orchestrator, fault.hold_s)
        elif fault.kind == "draft_stall":
            await link.stall(fault.hold_s)
        elif fault.kind == "draft_delay":
            await link.delay(fault.delay_ms, fault.hold_s)
        elif fault.kind == "client_cancel":
            load.cancel_next.add(rng.randrange(clients))
            continue
        else:
            await load.special(fault.kind, max_context)
            continue
        windows.append(Window(start, load.now()))
    return windows


async def sample_rss(stack: Stack, stop_at: float, series: dict[str, list[float]]) -> None:
    while time.monotonic() < stop_at:
        for name, pid in stack.pids().items():
            value = rss_mb(pid)  # None: ended
            if value:
                series.setdefault(name, []).append(round(value, 1))
        await asyncio.sleep(1.0)


async def _stats(address: str, stub_cls) -> pb.StatsResponse:
    async with grpc.aio.insecure_channel(address) as channel:
        return await stub_cls(channel).Stats(pb.StatsRequest(), timeout=10)


async def active_sessions(address: str, stub_cls) -> int:
    return (await _stats(address, stub_cls)).active_sessions


async def sessions_opened(stack: Stack) -> dict[str, int]:
    """Sessions each replica's running instance has opened (``Stats.sessions_opened``): how the pools spread."""
    services = [(t, pb_grpc.TargetServiceStub) for t in stack.targets] + [(d, pb_grpc.DraftServiceStub)
                                                                         for d in stack.drafts]
    return {f"{s.name}-{len(s.instances) - 1}": (await _stats(s.address, stub)).sessions_opened
            for s, stub in services}


async def leaked_sessions(stack: Stack, settle_s: float = 15.0) -> dict[str, int]:
    """Sessions still open on the target and draft replicas once every client is done (given ``settle_s`` to
    close), per service."""
    deadline = time.monotonic() + settle_s
    while True:
        counts = {
            "target": sum([await active_sessions(t.address, pb_grpc.TargetServiceStub) for t in stack.targets]),
            "draft": sum([await active_sessions(d.address, pb_grpc.DraftServiceStub) for d in stack.drafts]),
        }
        if not any(counts.values()) or time.monotonic() > deadline:
            return counts
        await asyncio.sleep(0.5)

"""``specsplit bench --suite abuse``: /health latency and each process's memory while the public front is probed.

Target, draft and an orchestrator (gRPC and HTTP API, bearer tokens, its HTTP limits at their defaults but for
``--abuse-stalled-send-s``, ``--max-concurrent-per-caller 4``) run as separate processes on loopback. Two callers
hold tokens: ``legit``, whose ``--abuse-clients`` clients generate over HTTP the whole run, and ``probe``, which
the probes use where a token gets them further. A quiet phase, then each probe in turn, ``--abuse-s`` seconds
each:

- ``large_prompts``: chat requests of three sizes in turn: a prompt just under the orchestrator's prompt byte
  limit (the context length times the longest token: tokenized, then refused for the context), one as large
  as the body limit allows (refused by its bytes before tokenizing), and a body over the limit (refused by
  its Content-Length);
- ``chunked_bodies``: chunked uploads that never end, sent on past the body limit;
- ``slowloris``: ``--abuse-connections`` connections that trickle header bytes, reopened when closed;
- ``unauthenticated_flood``: back-to-back requests without a token, on kept-alive connections;
- ``stalled_readers``: streaming generations whose clients never read (receive buffers pinned small).

A separate process GETs the orchestrator's ``/health`` (a new connection each time, as a kubelet does) every
``--abuse-health-every-s`` and reads each service's RSS from ``/proc``; each phase reports p50/p99/max of the
probe latencies, failed probes, peak RSS per process, the legitimate clients' completed and failed requests,
and what the probes got back (status codes, connections the server closed).

Everything shares this machine's cores (the probes and the sampler too): on 2 cores a probe's own CPU is
part of what /health waits behind.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import socket
import statistics
import tempfile
import threading
import time
from collections import Counter
from contextlib import ExitStack
from pathlib import Path

from specsplit.bench import runs
from specsplit.lmkit import models, processes
from specsplit.orchestrator.api.config import HttpLimits
from specsplit.orchestrator.api.limits import longest_token_bytes, prompt_byte_limit
from specsplit.orchestrator.decode.peers import target_client
from specsplit.target_service.ranks import free_port

PROBES = ("large_prompts", "chunked_bodies", "slowloris", "unauthenticated_flood", "stalled_readers")
HEALTH_P99_GOAL_MS = 100.0
LEGIT, PROBE = "legit-token-0123456789", "probe-token-0123456789"


def add_flags(parser) -> None:
    parser.add_argument("--abuse-s", type=float, default=20.0, help="--suite abuse: seconds per phase")
    parser.add_argument("--abuse-probes", default=",".join(PROBES),
                        help=f"--suite abuse: the probes run, in order, after a quiet phase ({', '.join(PROBES)})")
    parser.add_argument("--abuse-clients", type=int, default=2,
                        help="--suite abuse: legitimate clients generating the whole run")
    parser.add_argument("--abuse-connections", type=int, default=64,
                        help="--suite abuse: connections a slowloris or stalled-reader probe holds open")
    parser.add_argument("--abuse-health-every-s", type=float, default=0.05,
                        help="--suite abuse: how often /health is asked")
    parser.add_argument("--abuse-stalled-send-s", type=float, default=5.0,
                        help="--suite abuse: the orchestrator's --http-stalled-send-s")


def probes_of(text: str) -> list[str]:
    names = [p.strip() for p in text.split(",") if p.strip()]
    unknown = [p for p in names if p not in PROBES]
    if unknown:
        raise ValueError(f"--abuse-probes: unknown {unknown}; choose from {', '.join(PROBES)}")
    return names


# -- the sampler (its own process, so probe threads here do not delay it) --------------------------------------


def _sample(port: int, pids: dict[str, int], every_s: float, stop, out) -> None:
    """Until ``stop`` is set: (monotonic time, /health ms or None, {process: RSS MB}) every ``every_s``."""
    samples = []
    next_at = time.monotonic()
    first = True
    request = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
    while not stop.is_set():
        started = time.monotonic()
        ms = None
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
                sock.sendall(request)
                answer = b""
                while chunk := sock.recv(4096):
                    answer += chunk
            if answer.startswith(b"HTTP/1.1 200"):
                ms = (time.monotonic() - started) * 1e3
        except OSError:
            pass
        samples.append((started, ms, {name: processes.rss_mb(pid) for name, pid in pids.items()}))
        if first:
            out.send("sampling")
            first = False
        next_at += every_s
        time.sleep(max(0.0, next_at - time.monotonic()))
    out.send(samples)
    out.close()


class Sampler:
    def __init__(self, port: int, pids: dict[str, int], every_s: float) -> None:
        context = multiprocessing.get_context("spawn")
        self._stop = context.Event()
        self._receive, send = context.Pipe(duplex=False)
        self._process = context.Process(target=_sample, args=(port, pids, every_s, self._stop, send), daemon=True)
        self._process.start()
        self._receive.poll(60)  # its first sample (the interpreter starts from scratch): phases start measured
        self._receive.recv()

    def finish(self) -> list[tuple[float, float | None, dict]]:
        self._stop.set()
        samples = self._receive.recv()
        self._process.join(10)
        return samples


# -- the probes: each runs until its phase ends, counting what came back ----------------------------------------


def _connect(port: int, rcvbuf: int | None = None) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.settimeout(10)
    sock.connect(("127.0.0.1", port))
    return sock


def _status(answer: bytes) -> str:
    head = answer.split(b"\r\n", 1)[0].split()
    return head[1].decode() if len(head) > 1 else "closed"


def _post(port: int, body: bytes, token: str | None, send_body: bool = True) -> bytes:
    """POST ``body`` on a new connection and read the answer; without ``send_body`` only the headers go out
    (a body over the limit is refused by its Content-Length, and the server closes on the rest unread)."""
    auth = b"Authorization: Bearer %s\r\n" % token.encode() if token else b""
    with _connect(port) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"%sContent-Length: %d\r\nConnection: close\r\n\r\n%s"
                     % (auth, len(body), body if send_body else b""))
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return answer


class Front:
    """What the probes need to know of the orchestrator's HTTP API."""

    def __init__(self, port: int, model: str, body_limit: int, prompt_limit: int, connections: int) -> None:
        self.port, self.model, self.body_limit, self.connections = port, model, body_limit, connections
        self.prompt_limit = prompt_limit  # UTF-8 bytes of a prompt the orchestrator tokenizes at most

    def chat(self, content: str, **fields) -> bytes:
        return json.dumps({"model": self.model, "messages": [{"role": "user", "content": content}], **fields}).encode()


def large_prompts(front: Front, stop: threading.Event, counts: Counter) -> None:
    words = "speculative decoding splits the work between a draft and a target model "
    empty = len(front.chat("", max_tokens=4))
    bodies = {
        "tokenized": front.chat(words * ((min(front.prompt_limit, front.body_limit - empty) - 64) // len(words)),
                                max_tokens=4),
        "at the body limit": front.chat(words * ((front.body_limit - empty - 64) // len(words)), max_tokens=4),
        "over the body limit": front.chat(words * (front.body_limit // len(words) + 16), max_tokens=4),
    }
    while not stop.is_set():
        for size, body in bodies.items():
            try:
                answer = _post(front.port, body, PROBE, send_body=len(body) <= front.body_limit)
                counts[f"{size} {_status(answer)}"] += 1
            except OSError as exc:
                counts[f"{size} error {type(exc).__name__}"] += 1


def chunked_bodies(front: Front, stop: threading.Event, counts: Counter) -> None:
    chunk = b"[" * 4096
    while not stop.is_set():
        try:
            with _connect(front.port) as sock:
                sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer "
                             + PROBE.encode() + b"\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
                with_room = front.body_limit // len(chunk) + 2
                for _ in range(with_room):
                    sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                answer = b""
                while piece := sock.recv(65536):
                    answer += piece
                counts[_status(answer)] += 1
        except OSError as exc:  # the server may close while the upload is still going on
            counts[f"cut {type(exc).__name__}"] += 1


def slowloris(front: Front, stop: threading.Event, counts: Counter) -> None:
    open_: list[socket.socket] = []
    try:
        while not stop.is_set():
            while len(open_) < front.connections:
                try:
                    sock = _connect(front.port)
                    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
                    sock.setblocking(False)
                    open_.append(sock)
                    counts["opened"] += 1
                except OSError:
                    counts["refused"] += 1
                    break
            for sock in list(open_):
                try:
                    sock.send(b"X")
                    if sock.recv(1, socket.MSG_PEEK) == b"":
                        raise ConnectionResetError
                except BlockingIOError:
                    continue
                except OSError:
                    counts["closed by the server"] += 1
                    open_.remove(sock)
                    sock.close()
            stop.wait(0.1)
    finally:
        for sock in open_:
            sock.close()


def unauthenticated_flood(front: Front, stop: threading.Event, counts: Counter) -> None:
    import httpx2 as httpx  # the HTTP client the openai package itself uses

    body = front.chat("hello", max_tokens=4)
    with httpx.Client(base_url=f"http://127.0.0.1:{front.port}", timeout=10) as client:
        while not stop.is_set():
            try:
                counts[str(client.post("/v1/chat/completions", content=body,
                                       headers={"content-type": "application/json"}).status_code)] += 1
            except httpx.HTTPError as exc:
                counts[f"error {type(exc).__name__}"] += 1


def stalled_readers(front: Front, stop: threading.Event, counts: Counter) -> None:
    body = front.chat("Tell me a long story.", max_tokens=400, stream=True, logprobs=True, top_logprobs=20,
                      temperature=1.0, seed=1)
    open_: list[socket.socket] = []
    try:
        while not stop.is_set():
            if len(open_) < front.connections:
                try:
                    sock = _connect(front.port, rcvbuf=4096)
                    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
                                 b"application/json\r\nAuthorization: Bearer %s\r\nContent-Length: %d\r\n\r\n%s"
                                 % (PROBE.encode(), len(body), body))
                    open_.append(sock)
                    counts["streams opened"] += 1
                except OSError:
                    counts["refused"] += 1
            stop.wait(0.25)
    finally:
        for sock in open_:
            sock.close()


PROBE_RUNS = {"large_prompts": (large_prompts, 2), "chunked_bodies": (chunked_bodies, 2),
              "slowloris": (slowloris, 1), "unauthenticated_flood": (unauthenticated_flood, 4),
              "stalled_readers": (stalled_readers, 1)}


# -- the legitimate clients -----------------------------------------------------------------------------------


class Legit:
    """``clients`` threads generating short chat completions with the ``legit`` token until stopped; each
    request's (end time, seconds, status) kept so phases can be told apart."""

    def __init__(self, front: Front, clients: int) -> None:
        self.front, self.done = front, []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(clients)]
        for thread in self._threads:
            thread.start()

    def _client(self, index: int) -> None:
        import httpx2 as httpx

        body = self.front.chat(f"Count from {index} to {index + 9}.", max_tokens=16, temperature=0)
        with httpx.Client(base_url=f"http://127.0.0.1:{self.front.port}", timeout=120) as client:
            while not self._stop.is_set():
                started = time.monotonic()
                try:
                    response = client.post("/v1/chat/completions", content=body, headers={
                        "content-type": "application/json", "authorization": f"Bearer {LEGIT}"})
                    status = response.status_code
                except httpx.HTTPError as exc:
                    status = type(exc).__name__
                self.done.append((time.monotonic(), time.monotonic() - started, status))

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(130)


# -- a run ----------------------------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summarize(name: str, window: tuple[float, float], samples, legit_done, counts: Counter) -> dict:
    start, end = window
    inside = [s for s in samples if start <= s[0] < end]
    answered = [s[1] for s in inside if s[1] is not None]
    rss: dict[str, float] = {}
    for _, _, per_process in inside:
        for process, mb in per_process.items():
            if mb is not None:
                rss[process] = max(rss.get(process, 0.0), mb)
    requests = [d for d in legit_done if start <= d[0] < end]
    ok = [d for d in requests if d[2] == 200]
    return {
        "phase": name,
        "seconds": round(end - start, 1),
        "health_ms": {"p50": round(percentile(answered, 0.5), 1) if answered else None,
                      "p99": round(percentile(answered, 0.99), 1) if answered else None,
                      "max": round(max(answered), 1) if answered else None,
                      "asked": len(inside), "failed": len(inside) - len(answered)},
        "rss_peak_mb": {process: round(mb, 1) for process, mb in sorted(rss.items())},
        "legit": {"completed": len(ok), "failed": len(requests) - len(ok),
                  "failures": sorted({str(d[2]) for d in requests if d[2] != 200}),
                  "p50_s": round(statistics.median(d[1] for d in ok), 3) if ok else None},
        "probe": dict(sorted(counts.items())),
    }


def run_phase(front: Front, name: str, seconds: float) -> tuple[tuple[float, float], Counter]:
    counts: Counter = Counter()
    stop = threading.Event()
    workers = []
    if name != "quiet":
        probe, threads = PROBE_RUNS[name]
        workers = [threading.Thread(target=probe, args=(front, stop, counts), daemon=True) for _ in range(threads)]
    started = time.monotonic()
    for worker in workers:
        worker.start()
    stop.wait(seconds)
    stop.set()
    for worker in workers:
        worker.join(30)
    return (started, time.monotonic()), counts


def measure(front: Front, pids: dict[str, int], phases: list[str], args) -> list[dict]:
    sampler = Sampler(front.port, pids, args.abuse_health_every_s)
    legit = Legit(front, args.abuse_clients)
    windows = []
    try:
        for name in phases:
            window, counts = run_phase(front, name, args.abuse_s)
            windows.append((name, window, counts))
            print(f"  {name}: {dict(counts)}", flush=True)
            time.sleep(min(1.0, args.abuse_s / 4))  # let the phase's leftovers drain before the next one counts
    finally:
        legit.stop()
        samples = sampler.finish()
    return [summarize(name, window, samples, legit.done, counts) for name, window, counts in windows]


def served_model(port: int) -> str:
    import httpx2 as httpx

    response = httpx.get(f"http://127.0.0.1:{port}/v1/models", headers={"authorization": f"Bearer {LEGIT}"},
                         timeout=30)
    response.raise_for_status()
    return response.json()["data"][0]["id"]


async def prompt_limit(target_address: str, tokenizer: str) -> int:
    """The orchestrator's prompt byte limit at its defaults: the target's context times the longest token."""
    target = target_client(target_address)
    try:
        max_context = (await target.fetch_info(60)).max_context
    finally:
        await target.close()
    return prompt_byte_limit(0, max_context, longest_token_bytes(models.load_tokenizer(tokenizer)))


def plot(report: dict, path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    phases = report["phases"]
    names = [p["phase"].replace("_", "\n") for p in phases]
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8))
    width = 0.4
    xs = range(len(phases))
    left.bar([x - width / 2 for x in xs], [p["health_ms"]["p50"] or 0 for p in phases], width, label="p50")
    left.bar([x + width / 2 for x in xs], [p["health_ms"]["p99"] or 0 for p in phases], width, label="p99")
    left.axhline(HEALTH_P99_GOAL_MS, linestyle="--", linewidth=1, color="grey")
    left.set_xticks(list(xs), names, fontsize=7)
    left.set(ylabel="ms", title="/health while each probe runs")
    left.legend(fontsize=7)
    processes_ = sorted({name for p in phases for name in p["rss_peak_mb"]})
    step = 0.8 / max(1, len(processes_))
    for i, process in enumerate(processes_):
        right.bar([x - 0.4 + step * (i + 0.5) for x in xs], [p["rss_peak_mb"].get(process, 0) for p in phases], step,
                  label=process)
    right.set_xticks(list(xs), names, fontsize=7)
    right.set(ylabel="peak RSS, MB", title="Memory of each process")
    right.legend(fontsize=7)
    fig.tight_layout()
    out = path.with_suffix(".png")
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def run(args) -> int:
    started = time.time()
    phases = ["quiet", *probes_of(args.abuse_probes)]
    if args.abuse_s <= 0 or args.abuse_clients < 1 or args.abuse_connections < 1:
        raise ValueError("--abuse-s must be > 0, --abuse-clients and --abuse-connections >= 1")
    target_args, draft_args = runs.service_args(args)
    with ExitStack() as stack:
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="specsplit-abuse-")))
        tokens = workdir / "tokens"
        tokens.write_text(f"legit {LEGIT}\nprobe {PROBE}\n")
        os.chmod(tokens, 0o600)

        def start(module: str, name: str, argv: list[str]):
            service = processes.start_service(module, name, argv, workdir)
            stack.callback(service.stop)
            return service

        target = start("specsplit.target_service.server", "target", target_args)
        draft = start("specsplit.draft_service.server", "draft", draft_args)
        http_port = free_port()
        orch = start("specsplit.orchestrator.api.server", "orchestrator", [
            "--target", target.address, "--draft", draft.address, "--tokenizer", args.model,
            "--http-port", str(http_port), "--auth-token-file", str(tokens), "--max-concurrent-per-caller", "4",
            "--http-stalled-send-s", str(args.abuse_stalled_send_s),
        ])
        front = Front(http_port, served_model(http_port), HttpLimits().max_body_bytes,
                      asyncio.run(prompt_limit(target.address, args.model)), args.abuse_connections)
        pids = {"target": target.process.pid, "draft": draft.process.pid, "orchestrator": orch.process.pid}
        print(f"abuse: {len(phases)} phases of {args.abuse_s:g} s against {front.model}", flush=True)
        result = measure(front, pids, phases, args)
    answered = [p["health_ms"]["p99"] for p in result if p["health_ms"]["p99"] is not None]
    report = {
        "benchmark": "abuse",
        "model": args.model,
        "draft_model": args.draft_model,
        "setup": (f"target, draft and orchestrator processes on loopback; {args.abuse_clients} legitimate HTTP "
                  f"clients throughout; /health asked every {args.abuse_health_every_s:g} s from its own process on "
                  f"a new connection; {args.abuse_s:g} s per phase; --http-stalled-send-s "
                  f"{args.abuse_stalled_send_s:g}, --max-concurrent-per-caller 4, other HTTP limits at their "
                  f"defaults; all on this machine's cores, the probes' included"),
        "machine": runs.machine(),
        "phases": result,
        "goals": {"health_p99_ms": HEALTH_P99_GOAL_MS,
                  "health_p99_met": bool(answered) and len(answered) == len(result)
                  and max(answered) <= HEALTH_P99_GOAL_MS,
                  "legit_failures": sum(p["legit"]["failed"] for p in result)},
        "duration_s": round(time.time() - started, 1),
    }
    path = runs.write(report, args.json)
    picture = plot(report, path)
    for p in result:
        h = p["health_ms"]
        print(f"{p['phase']}: /health p50 {h['p50']} ms, p99 {h['p99']} ms, max {h['max']} ms ({h['failed']} of "
              f"{h['asked']} failed); RSS {p['rss_peak_mb']}; legit {p['legit']['completed']} ok, "
              f"{p['legit']['failed']} failed")
    print(f"-> {path}" + (f", {picture}" if picture else ""))
    return 0

"""`specsplit serve --http-port` as a process over an in-process SmolLM2 target and n-gram draft, shared by the
tests that point real OpenAI clients at it."""

from __future__ import annotations

from contextlib import contextmanager

from specsplit.lmkit.processes import start_service
from specsplit.target_service.ranks import free_port
from tests.conftest import Services, make_engines


@contextmanager
def smollm2_http(background_loop, workdir, served_name: str, *flags: str):
    """Yields the API's base URL (``http://127.0.0.1:PORT/v1``); ``flags``: more of the server's own."""
    target, draft = make_engines("smollm2-135m", None)
    services = Services(background_loop, target, draft)
    port = free_port()
    server = start_service(
        "specsplit.orchestrator.api.server",
        "orchestrator",
        [
            "--target", services.target_address,
            "--draft", services.draft_address,
            "--tokenizer", "smollm2-135m",
            "--drafter", "ngram",
            "--http-port", str(port),
            "--served-model-name", served_name,
            *flags,
        ],
        workdir,
        300,
    )  # fmt: skip
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        assert server.stop(60) == 0, server.log_tail()
        services.stop()

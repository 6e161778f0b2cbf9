"""The real SmolLM2 target with a bundled head-drafter (EAGLE, Medusa) behind real gRPC, for the slow tests."""

from __future__ import annotations

import contextlib
from typing import Callable

from specsplit.bench.prompts import DEMO_PROMPTS
from specsplit.draft_service.engine import DraftEngine
from specsplit.lmkit import models
from specsplit.lmkit.kinds import DrafterKind
from specsplit.lmkit.sessions import SessionLimits
from tests.conftest import Services, make_engines, reference_greedy

PROMPTS = [p for p in DEMO_PROMPTS if p.name in ("summarise", "story", "explain")]


@contextlib.contextmanager
def smollm2_with_head(background_loop, kind: DrafterKind, load: Callable):
    """(services, prompts' chat ids, the target's own 32-token greedy continuations); ``load(ref, model)`` loads the
    bundled head for the target model (in one process draft and target share it)."""
    target, _ = make_engines("smollm2-135m", None)
    model = target.model
    tokenizer = models.load_tokenizer("smollm2-135m")
    draft = DraftEngine(model, model_id="smollm2-135m", vocab_fingerprint=models.vocab_fingerprint(tokenizer),
                        limits=SessionLimits(), derived={kind: load("smollm2-135m", model)})
    services = Services(background_loop, target, draft)
    try:
        prompts_ids = [
            list(tokenizer.apply_chat_template([{"role": "user", "content": p.text}], add_generation_prompt=True)["input_ids"])
            for p in PROMPTS
        ]
        yield services, prompts_ids, [reference_greedy(model, ids, 32) for ids in prompts_ids]
    finally:
        services.stop()

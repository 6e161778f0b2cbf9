"""The reference for structured outputs: a model's greedy continuation under a grammar's mask, by a plain
transformers loop (no cache, no speculation, xgrammar's own matcher and bitmask)."""

from __future__ import annotations

import torch


def masked_greedy(model, compiled, prompt_ids: list[int], max_new: int) -> list[int]:
    """Up to ``max_new`` tokens of ``model``'s greedy continuation of ``prompt_ids`` under ``compiled`` (an
    xgrammar CompiledGrammar), ending where the grammar does."""
    import xgrammar

    matcher = xgrammar.GrammarMatcher(compiled)
    bitmask = xgrammar.allocate_token_bitmask(1, model.config.vocab_size)
    ids, out = list(prompt_ids), []
    with torch.inference_mode():
        while len(out) < max_new and not matcher.is_terminated():
            logits = model(torch.tensor([ids])).logits[0, -1:].float()  # [1, vocab]
            matcher.fill_next_token_bitmask(bitmask)
            xgrammar.apply_token_bitmask_inplace(logits, bitmask)
            token = int(logits.argmax(-1))
            assert matcher.accept_token(token)
            ids.append(token)
            out.append(token)
    return out

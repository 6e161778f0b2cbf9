"""Log-probabilities of committed tokens, read off the verify pass the target runs anyway.

Row i of a verification's logits is the target's distribution for the token
at block position i, so the accepted draft tokens and the correction (or
bonus) token all get their log-probability from the same forward pass: no
extra model call. Values are the log-softmax of the raw logits (the model's
own distribution, before temperature, top-k and top-p), like vLLM's default
``raw_logprobs``, so they do not change with sampling settings.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from specsplit.lmkit.wire import MAX_TOP_LOGPROBS


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), most likely first
    rank: int = 0  # 1 = the most likely token at its position; 0: not computed


def committed_logprobs(
    logits: torch.Tensor,  # [>= n, vocab]: row i scores the token at block position i
    tokens: Sequence[int],  # [n] the committed tokens, in order
    top_n: int,  # also report the top_n most likely tokens at each position (0..MAX_TOP_LOGPROBS)
    ranks: bool = False,  # also each token's rank at its position (prompt scoring)
) -> list[TokenLogprob]:
    n = len(tokens)
    if not 0 <= top_n <= MAX_TOP_LOGPROBS:
        raise ValueError(f"top_n must be in [0, {MAX_TOP_LOGPROBS}], got {top_n}")
    if logits.dim() != 2 or logits.shape[0] < n:
        raise ValueError(f"logits must be [>= {n}, vocab], got {tuple(logits.shape)}")
    if n == 0:
        return []
    logprobs = torch.log_softmax(logits[:n].to(torch.float32), dim=-1)  # [n, vocab]
    index = torch.tensor(list(tokens), dtype=torch.long, device=logprobs.device).unsqueeze(1)
    chosen = logprobs.gather(1, index)  # [n, 1]
    rank = [0] * n
    if ranks:  # 1 + the tokens more likely, and the equally likely of lower id (the stable sort's order)
        ids = torch.arange(logprobs.shape[1], device=logprobs.device)
        ahead = (logprobs > chosen) | ((logprobs == chosen) & (ids < index))
        rank = (ahead.sum(dim=-1) + 1).tolist()
    chosen = chosen.squeeze(1).tolist()
    if top_n == 0:
        return [TokenLogprob(int(t), lp, rank=r) for t, lp, r in zip(tokens, chosen, rank)]
    # A stable descending sort ranks equal values by lower token id, as logits processing does (topk does not).
    top_values, top_ids = (t[:, :top_n] for t in torch.sort(logprobs, dim=-1, descending=True, stable=True))
    return [
        TokenLogprob(int(t), lp, tuple(zip(ids, values)), r)
        for t, lp, ids, values, r in zip(tokens, chosen, top_ids.tolist(), top_values.tolist(), rank)
    ]

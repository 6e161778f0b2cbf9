"""Training an EAGLE-3 head for a target: training-time test over the target's own features.

EAGLE-3 (Li et al. 2025, "EAGLE-3: Scaling up Inference Acceleration of Large Language Models via
Training-Time Test") trains the head on its own chained outputs: at step s, row r reads the
step-(s-1) output of row r-1 in place of the target's features, as when drafting the (s+1)-th token
of a block, and attends to the true rows up to its branch point r-s plus its own chained rows
(``ttt_mask``). Step s is weighted 0.8^s. The loss is the cross-entropy of the head's distribution
against the target's (recomputed from its final hidden state), both restricted to the draft
vocabulary and renormalised (as EAGLE-3 does).

The draft vocabulary is the target's most frequent greedy choices on the training data (FR-Spec,
Zhao et al. 2025; EAGLE-3's d2t/t2d). The head starts from the target's LM head rows for it and its
final norm.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specsplit.draft_service.eagle_data import Segments
from specsplit.draft_service.eagle_head import EagleHead, HeadConfig

STEP_DECAY = 0.8  # weight of unrolled step s is STEP_DECAY ** s


def draft_vocabulary(segments: Segments, size: int, vocab: int) -> tuple[torch.Tensor, float]:
    """The ``size`` target ids the target chooses most often, and the share of its choices they cover."""
    counts = torch.bincount(segments.argmax, minlength=vocab)
    top = torch.topk(counts, min(size, vocab)).indices
    return torch.sort(top).values, float(counts[top].sum() / counts.sum())


def new_head(target_model, feature_layers: tuple[int, ...], draft_ids: torch.Tensor, seed: int) -> EagleHead:
    """A head shaped like one decoder layer of the target, its LM head and norm started from the target's."""
    c = target_model.config
    hidden = int(c.hidden_size)
    heads = int(c.num_attention_heads)
    config = HeadConfig(
        hidden_size=hidden, intermediate_size=int(c.intermediate_size), num_attention_heads=heads,
        num_key_value_heads=int(getattr(c, "num_key_value_heads", heads) or heads),
        head_dim=int(getattr(c, "head_dim", None) or hidden // heads), vocab_size=int(c.vocab_size),
        draft_vocab_size=int(draft_ids.numel()), target_hidden_size=hidden, feature_layers=tuple(feature_layers),
        rms_norm_eps=float(getattr(c, "rms_norm_eps", 1e-6)),
        rope_theta=float((getattr(c, "rope_parameters", None) or {}).get("rope_theta", getattr(c, "rope_theta", 1e4))),
        max_position_embeddings=int(getattr(c, "max_position_embeddings", 8192)),
    )
    torch.manual_seed(seed)
    head = EagleHead(config, target_model.get_input_embeddings().weight.float())
    head.set_vocabulary(draft_ids)
    with torch.no_grad():
        head.lm_head.weight.copy_(target_model.get_output_embeddings().weight[head.draft_ids()].float())
        head.norm.weight.copy_(target_model.model.norm.weight.float())
    return head


def ttt_mask(width: int, step: int, device=None) -> torch.Tensor:
    """[width, (step + 1) * width] bool: what row r of unrolled step ``step`` attends to.

    Step-0 keys (rows from the target's features) up to the branch point
    r - step, and the key of step s' (1 <= s' <= step) at row r - (step - s'):
    the chained rows of the same draft.
    """
    rows = torch.arange(width, device=device)[:, None]
    cols = torch.arange(width, device=device)[None, :]
    blocks = [cols <= rows - step]
    blocks += [cols == rows - (step - s) for s in range(1, step + 1)]
    return torch.cat(blocks, dim=1)


def unrolled(head: EagleHead, features: torch.Tensor, next_tokens: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """Outputs [B, T, H] of each unrolled step for rows (features [B, T, F], next tokens [B, T])."""
    batch, width, _ = features.shape
    positions = torch.arange(width, device=features.device)[None].expand(batch, width)
    rope = head.rope(positions)
    emb = head.embed(next_tokens)
    hidden = head.fc(features)
    keys, values, outs = [], [], []
    for step in range(steps):
        past = (torch.cat(keys, 2), torch.cat(values, 2)) if keys else None
        out, k, v = head.midlayer(emb, hidden, rope, past, ttt_mask(width, step, features.device))
        keys.append(k)
        values.append(v)
        outs.append(out)
        hidden = torch.cat([torch.zeros_like(out[:, :1]), out[:, :-1]], dim=1)  # row r chains row r - 1
    return outs


@dataclass
class Batch:
    features: torch.Tensor  # [B, T, F] float32, rows 0..T-1
    next_tokens: torch.Tensor  # [B, T] the token after each row's position
    target_final: torch.Tensor  # [B, T, H] the target's final hidden state at the position after each row
    target_argmax: torch.Tensor  # [B, T] the target's greedy choice at the position after each row
    valid: torch.Tensor  # [B, T] bool: the row and the position after it exist
    answer: torch.Tensor  # [B, T] bool: the row predicts a token of the target's own answer (or corpus text)


def windows(segments: Segments, picks: list[tuple[int, int]], width: int) -> Batch:
    """Rows [start, start + width) of the chosen sequences, right-padded."""
    f = segments.features.shape[1]
    h = segments.final.shape[1]
    out = Batch(
        torch.zeros(len(picks), width, f), torch.zeros(len(picks), width, dtype=torch.long),
        torch.zeros(len(picks), width, h), torch.zeros(len(picks), width, dtype=torch.long),
        torch.zeros(len(picks), width, dtype=torch.bool), torch.zeros(len(picks), width, dtype=torch.bool),
    )
    for row, (seq, start) in enumerate(picks):
        a, b = int(segments.starts[seq]), int(segments.starts[seq + 1])
        first = a + start
        n = min(width, b - 1 - first)  # row j needs the token and the target's output at position j + 1
        if n <= 0:
            continue
        out.features[row, :n] = segments.features[first : first + n].float()
        out.next_tokens[row, :n] = segments.tokens[first + 1 : first + 1 + n]
        out.target_final[row, :n] = segments.final[first + 1 : first + 1 + n].float()
        out.target_argmax[row, :n] = segments.argmax[first + 1 : first + 1 + n]
        out.valid[row, :n] = True
        answer_row = int(segments.answer_from[seq]) - 1 - start  # rows from here predict answer tokens
        out.answer[row, max(answer_row, 0) : n] = True
    return out


def sample_windows(segments: Segments, count: int, width: int, generator: torch.Generator) -> list[tuple[int, int]]:
    """Random (sequence, start) pairs, sequences drawn in proportion to their length."""
    lengths = segments.lengths().float()
    seqs = torch.multinomial(lengths, count, replacement=True, generator=generator).tolist()
    picks = []
    for seq in seqs:
        slack = int(lengths[seq]) - 1 - width
        start = int(torch.randint(0, slack + 1, (1,), generator=generator)) if slack > 0 else 0
        picks.append((seq, start))
    return picks


def ttt_loss(
    head: EagleHead, batch: Batch, steps: int, target_rows: torch.Tensor, loss_share: float = 1.0,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, list[float]]:
    """Weighted cross-entropy against the target's restricted distribution; also top-1 agreement per step.

    With ``loss_share`` < 1 the loss reads a random share of the rows (the
    same ones at every step): every row still runs through the layer, since
    later rows attend to it, but the LM head and the target's distribution,
    most of a step's cost, run on the share only.
    """
    outs = unrolled(head, batch.features, batch.next_tokens, steps)
    chosen = batch.valid.clone()
    if loss_share < 1.0:
        chosen &= torch.rand(chosen.shape, generator=generator) < loss_share
    where = torch.nonzero(chosen)  # [n, 2] (sequence, row)
    with torch.no_grad():
        target_p = F.softmax(batch.target_final[chosen] @ target_rows.T, dim=-1)  # [n, Vd]
        target_choice = batch.target_argmax[chosen]
    total = torch.zeros(())
    agreement = []
    for step, out in enumerate(outs):
        rows = where[:, 1] >= step  # a row of step s branches at row r - s
        logq = F.log_softmax(head.logits(out[chosen][rows]), dim=-1)  # [m, Vd]
        ce = -(target_p[rows] * logq).sum(-1).mean()
        total = total + STEP_DECAY**step * ce
        with torch.no_grad():
            agreement.append(float((head.draft_to_target(logq.argmax(-1)) == target_choice[rows]).float().mean()))
    return total, agreement


@torch.no_grad()
def acceptance(head: EagleHead, segments: Segments, depth: int = 4, answers_only: bool = True) -> dict:
    """Greedy drafting on held-out sequences, teacher-forced: agreement per depth and tokens per round at k = 1..depth.

    On the target's own greedy answers this is what a greedy session sees: a
    block of k drafted after row b is accepted up to its first token that
    differs from the target's choice.
    """
    matches = []  # per sequence: [depth, rows] bool, the step-s prediction of row r is the target's choice
    for seq in range(segments.count):
        a, b = int(segments.starts[seq]), int(segments.starts[seq + 1])
        batch = windows(segments, [(seq, 0)], b - a - 1)
        outs = unrolled(head, batch.features, batch.next_tokens, depth)
        hit = torch.stack([head.draft_to_target(head.logits(out[0]).argmax(-1)) == batch.target_argmax[0]
                           for out in outs])  # [depth, rows]
        rows = batch.answer[0] if answers_only else batch.valid[0]
        matches.append((hit, rows))
    drafted = {k: 0 for k in range(1, depth + 1)}
    accepted = {k: 0 for k in range(1, depth + 1)}
    for hit, rows in matches:
        n = hit.shape[1]
        for start in torch.nonzero(rows).flatten().tolist():
            run = 0  # consecutive hits of the block drafted after row ``start``
            while run < depth and start + run < n and hit[run, start + run]:
                run += 1
            for k in drafted:
                drafted[k] += k
                accepted[k] += min(run, k)
    top1 = sum(int(h[0][r].sum()) for h, r in matches) / max(sum(int(r.sum()) for _, r in matches), 1)
    return {
        "top1_agreement": round(top1, 4),
        "rows": sum(int(r.sum()) for _, r in matches),
        "alpha_at_k": {k: round(accepted[k] / drafted[k], 4) for k in drafted if drafted[k]},
        "tokens_per_round_at_k": {k: round(1 + accepted[k] * k / drafted[k], 3) for k in drafted if drafted[k]},
    }

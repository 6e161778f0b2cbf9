"""Token masks: which tokens a grammar allows at each verified position, packed 32 to an int32 word.

The layout is xgrammar's bitmask: row r holds ceil(vocab / 32) int32 words and
bit b of word w allows token 32 * w + b. Applying a mask sets the logits of the
refused tokens to -inf before verification, so every verifier (greedy argmax,
token-only, coupled Gumbel-max) decides from the target's distribution
restricted to the allowed tokens and renormalised: the constrained
distribution, whatever the block. Pure: no I/O.
"""

from __future__ import annotations

import torch

BITS = 32


def words_per_row(vocab_size: int) -> int:
    return -(-vocab_size // BITS)


def unpack(bits: bytes, rows: int, vocab_size: int) -> torch.Tensor:  # -> [rows, vocab] bool
    """A packed mask as booleans; ValueError (saying what to send) unless it has ``rows`` full rows that each allow
    at least one token below ``vocab_size``."""
    words = words_per_row(vocab_size)
    if len(bits) != rows * words * 4:
        raise ValueError(
            f"the token mask has {len(bits)} bytes; {rows} rows of a {vocab_size}-token vocabulary take "
            f"{rows * words * 4} ({words} int32 words a row)"
        )
    packed = torch.frombuffer(bytearray(bits), dtype=torch.int32).view(rows, words)  # little-endian, as sent
    shifts = torch.arange(BITS, dtype=torch.int32)
    allowed = ((packed.unsqueeze(-1) >> shifts) & 1).view(rows, words * BITS)[:, :vocab_size].bool()
    empty = (~allowed.any(dim=-1)).nonzero().flatten().tolist()
    if empty:
        raise ValueError(f"token mask rows {empty} allow no token; every verified position needs one")
    return allowed


def pack(allowed: torch.Tensor) -> bytes:  # allowed: [rows, vocab] bool
    """Booleans as the packed layout ``unpack`` reads."""
    rows, vocab = allowed.shape
    padded = torch.zeros(rows, words_per_row(vocab) * BITS, dtype=torch.int64)
    padded[:, :vocab] = allowed.long()
    weights = torch.ones(BITS, dtype=torch.int64) << torch.arange(BITS, dtype=torch.int64)
    words = (padded.view(rows, -1, BITS) * weights).sum(-1)  # [rows, words] in [0, 2**32)
    return words.to(torch.int64).numpy().astype("<u4").tobytes()


def apply(logits: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
    """``logits`` [rows, vocab] with every token ``allowed`` [rows, vocab] refuses at -inf (a new tensor); the
    logits themselves when there is no mask."""
    if allowed is None:
        return logits
    if allowed.shape != logits.shape:
        raise ValueError(f"token mask of shape {tuple(allowed.shape)} for logits of shape {tuple(logits.shape)}")
    return logits.masked_fill(~allowed.to(logits.device), float("-inf"))

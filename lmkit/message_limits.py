"""The largest request message each service can legitimately receive, from its model's shape.

A request over its service's bound is refused with RESOURCE_EXHAUSTED before it
is parsed (``lmkit.grpc_server``), instead of being buffered and parsed up to the
transport's 64 MiB ceiling. Each bound is the largest message a correct client
sends, with room to spare:

- a session's ``open``: every prompt token (``max_context``);
- a target's ``verify``: a block of ``max_block`` tokens with their parents and
  dense fp16 draft probabilities (``max_block * vocab_size`` values; the codec
  sends the smaller of dense and sparse);
- a draft's ``propose``: a block's tokens and the target's hidden features of up
  to every committed position (``max_context * feature_width`` fp16 values: the
  first verify carries the prompt's);
- ``Generate``: a prompt of ``max_context`` tokens of the tokenizer's longest.

A ``Sessions`` stream message carries many calls: the bound applies to each
message, and clients split their calls to fit (``ModelInfo.max_request_bytes``).
"""

from __future__ import annotations

TOKEN_BYTES = 6  # an int32 token id >= 0: a varint of at most 5 bytes, plus a tag when sent unpacked
PARENT_BYTES = 11  # a tree parent may be -1: a 10-byte varint plus a tag
ENVELOPE_BYTES = 64 * 1024  # ids, sampling parameters, stop strings, field tags: generous
UNKNOWN_CONTEXT = 1 << 20  # positions assumed when the service runs no model (a model-free draft)
CEILING = 64 * 1024 * 1024  # the transport's own limit (lmkit.grpc_server.MAX_MESSAGE_BYTES)


def _bounded(n: int) -> int:
    return min(n + ENVELOPE_BYTES, CEILING)


def _context(max_context: int) -> int:
    return max_context if max_context > 0 else UNKNOWN_CONTEXT


def target_request_bytes(max_context: int, max_block: int, vocab_size: int) -> int:
    """A target's open (the prompt) or verify (a block, its parents and dense draft probabilities)."""
    open_ = _context(max_context) * TOKEN_BYTES
    verify = max_block * (TOKEN_BYTES + PARENT_BYTES + TOKEN_BYTES) + max_block * vocab_size * 2
    return _bounded(max(open_, verify))


def draft_request_bytes(max_context: int, max_block: int, feature_width: int) -> int:
    """A draft's open (the prompt) or propose (new tokens and the target's features of the committed ones)."""
    context = _context(max_context)
    open_ = context * TOKEN_BYTES
    propose = (max_block + 1) * TOKEN_BYTES + context * feature_width * 2
    return _bounded(max(open_, propose))


def generate_request_bytes(max_context: int, max_token_bytes: int) -> int:
    """A ``Generate`` request: a prompt (or messages) of the context's worth of the tokenizer's longest tokens."""
    return _bounded(_context(max_context) * max_token_bytes)

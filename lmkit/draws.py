"""Counter-based random draws: every uniform is a pure function of (seed, stream, position, index).

A session's randomness is a fixed table, not a generator that advances as it is used: the draw with
index ``i`` at absolute token position ``position`` of ``stream`` is the same number whenever and
wherever it is computed (after a target reopen, a draft re-attach, an eviction, in a batch or alone,
in any process). Position n is decided once in a generation's committed sequence, with the draws
keyed by n, so no uniform decides two positions and a replayed round reaches the same verdict.

Counter-based generation follows Salmon et al. 2011, "Parallel Random Numbers: As Easy as 1, 2, 3":
``key = BLAKE2b-64(seed, stream, position)``, and draw ``i`` is SplitMix64's output
``mix(key + (i + 1) * GAMMA)`` (Steele, Lea and Flood 2014, "Fast Splittable Pseudorandom Number
Generators"), whose top 53 bits give a float64 in (0, 1). Any index is computed without the others,
so Gumbel noise is made only for the tokens a truncated distribution keeps. Which draw means what:
``Stream``.
"""

from __future__ import annotations

import enum
import hashlib
import struct
from typing import Callable, Sequence

import numpy as np
import torch

SEED_LIMIT = 2**63  # seeds are in [0, 2**63): what every wire format and torch accept

# Which draw of a TARGET position is which.
ACCEPT = 0  # the test of the draft token at this position
SAMPLE = 1  # the recovered or bonus token at this position

_GAMMA = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
_PERSON = b"specsplit.draws"  # BLAKE2b personalisation: these keys are for nothing else
_SAMPLE_PERSON = b"specsplit.sample"  # and these are the seeds of a request's samples 1..n-1


class Stream(enum.Enum):
    """Who draws: disjoint tables, so draft and target never share a uniform (COUPLED shares on purpose).

    At position n: TARGET's index 0 (``ACCEPT``) tests the draft token at n (accept iff u < p/q), index 1
    (``SAMPLE``) samples the recovered or bonus token at n, and indices 2 and up test a token tree's later
    siblings; DRAFT's index 0 samples a model drafter's token at n; COUPLED's index t is the Gumbel noise
    of token id t, shared by target and draft in ``VerificationMode.COUPLED``.
    """

    TARGET = 1  # acceptance tests and recovered / bonus samples of the target
    DRAFT = 2  # a model drafter's sampled tokens
    COUPLED = 3  # Gumbel noise over token ids, shared by draft and target in COUPLED mode


def position_keys(seed: int, stream: Stream, positions: Sequence[int]) -> np.ndarray:  # -> [n] uint64
    """The 64-bit key of each (seed, stream, position): a BLAKE2b hash, the same in every process."""
    _check(seed, stream)
    keys = np.empty(len(positions), dtype=np.uint64)
    for i, position in enumerate(positions):
        if isinstance(position, bool) or not isinstance(position, int) or not 0 <= position < 2**64:
            raise ValueError(f"positions must be ints >= 0, got {position!r}")
        digest = hashlib.blake2b(
            struct.pack("<QBQ", seed, stream.value, position), digest_size=8, person=_PERSON
        ).digest()
        keys[i] = int.from_bytes(digest, "little")
    return keys


def sample_seed(seed: int, index: int) -> int:
    """The seed of sample ``index`` of a request of several samples (``GenerateRequest.n``) seeded ``seed``.

    Sample 0 keeps ``seed`` (a request of one sample and sample 0 of several agree); sample i > 0 takes the top
    63 bits of BLAKE2b-64(seed, i), personalised apart from the position keys: reproducible, and different
    from the other samples' (a 2**-63 chance of a clash per pair).
    """
    _check(seed, Stream.TARGET)
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < 2**32:
        raise ValueError(f"index must be an int in [0, 2**32), got {index!r}")
    if index == 0:
        return seed
    digest = hashlib.blake2b(struct.pack("<QQ", seed, index), digest_size=8, person=_SAMPLE_PERSON).digest()
    return int.from_bytes(digest, "little") >> 1


def uniforms(seed: int, stream: Stream, positions: Sequence[int], count: int) -> torch.Tensor:
    """Draws 0..count-1 at each position: [len(positions), count] float64 in (0, 1)."""
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise ValueError(f"count must be an int >= 0, got {count!r}")
    keys = position_keys(seed, stream, positions)
    index = np.arange(count, dtype=np.uint64)
    return torch.from_numpy(_to_unit(_mix(keys[:, None], index[None, :])))


def gumbel(seed: int, stream: Stream, position: int, token_ids: torch.Tensor) -> torch.Tensor:
    """Standard Gumbel noise G = -log(-log u) of the given token ids at one position: [n] float64.

    The draw index is the token id, so a token's noise does not depend on which
    other tokens are asked for.
    """
    if not isinstance(token_ids, torch.Tensor) or token_ids.dim() != 1 or token_ids.dtype != torch.int64:
        raise ValueError("token_ids must be a 1-D int64 tensor")
    if token_ids.numel() and int(token_ids.min()) < 0:
        raise ValueError("token_ids must be >= 0")
    keys = key_tensor(position_keys(seed, stream, [position]), token_ids.device)
    return gumbel_rows(keys, token_ids)[0]


def key_tensor(keys: np.ndarray, device=None) -> torch.Tensor:  # [n] uint64 -> [n] int64, the same 64 bits
    """Position keys as a tensor the device computes noise from (``gumbel_rows``)."""
    return torch.from_numpy(keys.view(np.int64)).to(device)


def gumbel_rows(keys: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:  # [n] int64, [m] int64 -> [n, m] float64
    """The Gumbel noise of ``token_ids`` at each position of ``keys`` (``key_tensor``), computed where the tensors
    are with tensor operations only (no host value read: a CUDA graph captures it), from the draws
    ``uniform_rows`` gives."""
    return -torch.log(-torch.log(uniform_rows(keys, token_ids)))


def uniform_rows(keys: torch.Tensor, index: torch.Tensor) -> torch.Tensor:  # [n] int64, [m] int64 -> [n, m] float64
    """Draws ``index`` at each position of ``keys`` (``key_tensor``), computed where the tensors are with tensor
    operations only: bit for bit ``uniforms``' (SplitMix64 in int64, whose products wrap as uint64's do and whose
    right shifts are masked to be logical)."""
    z = keys[:, None] + (index[None, :] + 1) * _signed(_GAMMA)
    z = (z ^ _shift_right(z, 30)) * _signed(_MIX1)
    z = (z ^ _shift_right(z, 27)) * _signed(_MIX2)
    z = z ^ _shift_right(z, 31)
    return (_shift_right(z, 11).to(torch.float64) + 0.5) * 2.0**-53  # the top 53 bits, centred: in (0, 1)


def _signed(value: np.uint64) -> int:
    """A uint64 constant as the int64 with the same bits."""
    return int(value) - (1 << 64) if int(value) >= 1 << 63 else int(value)


def _shift_right(z: torch.Tensor, bits: int) -> torch.Tensor:
    """A logical right shift of int64 bits (torch's is arithmetic)."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def _mix(keys: np.ndarray, index: np.ndarray) -> np.ndarray:  # broadcast uint64 -> uint64
    """SplitMix64's output function at counter ``index + 1`` of the stream started at ``key``."""
    with np.errstate(over="ignore"):  # uint64 arithmetic wraps modulo 2**64, as SplitMix64 intends
        z = keys + (index + np.uint64(1)) * _GAMMA
        z = (z ^ (z >> np.uint64(30))) * _MIX1
        z = (z ^ (z >> np.uint64(27))) * _MIX2
    return z ^ (z >> np.uint64(31))


def _to_unit(bits: np.ndarray) -> np.ndarray:  # uint64 -> float64 in (0, 1)
    # The top 53 bits, centred in their cell: never 0 (so log u is finite) and never 1.
    return ((bits >> np.uint64(11)).astype(np.float64) + 0.5) * 2.0**-53


def _check(seed: int, stream: Stream) -> None:
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < SEED_LIMIT:
        raise ValueError(f"seed must be an int in [0, 2**63), got {seed!r}")
    if not isinstance(stream, Stream):
        raise ValueError(f"stream must be a draws.Stream, got {stream!r}")


def gumbel_max(
    probs: torch.Tensor,  # [vocab] >= 0, need not be normalised
    noise: Callable[[torch.Tensor], torch.Tensor],  # token ids [n] int64 -> their Gumbel noise [n] float64
) -> int:
    """argmax over the support of log p + G: a sample from p when G is i.i.d. standard Gumbel.

    The Gumbel-max trick (Gumbel 1954; Maddison, Tarlow and Minka 2014, "A*
    Sampling"). Noise is asked for the support only (ids ascending), so a
    truncated distribution costs its size, not the vocabulary's; ties go to
    the lowest id.
    """
    ids = probs.nonzero().flatten()  # [n] ascending
    if ids.numel() == 0:
        raise ValueError("gumbel_max needs a distribution with a positive probability")
    scores = probs[ids].to(torch.float64).log() + noise(ids)
    return int(ids[int(scores.argmax())])


def gumbel_runner_up(
    probs: torch.Tensor,  # [vocab] >= 0, need not be normalised
    noise: Callable[[torch.Tensor], torch.Tensor],  # token ids [n] int64 -> their Gumbel noise [n] float64
    first: int,  # the token gumbel_max chose with the same noise
) -> int | None:
    """The token with the second largest log p + G over the support (the largest being ``first``); None when the
    support holds one token. A coupled drafter's second choice: what it would have drafted had ``first`` not
    been there."""
    ids = probs.nonzero().flatten()  # [n] ascending
    if ids.numel() < 2:
        return None
    scores = probs[ids].to(torch.float64).log() + noise(ids)
    scores[ids == first] = float("-inf")
    return int(ids[int(scores.argmax())])


def inverse_cdf(
    probs: torch.Tensor,  # [vocab] float64 >= 0, need not be normalised
    uniform: float,  # in (0, 1)
    fallback: torch.Tensor | None = None,  # [vocab] float64, used when probs has no mass
) -> int:
    """The token whose CDF cell holds ``uniform``: one sample; zero-probability tokens are never returned."""
    if fallback is not None and not float(probs.sum()) > 0.0:
        return inverse_cdf(fallback, uniform)
    token = int(_cell(probs, torch.tensor(uniform, dtype=torch.float64, device=probs.device)))
    if token >= probs.shape[0]:  # uniform * total rounded up onto the total: take the last token with mass
        token = int(probs.nonzero()[-1])
    return token


def inverse_cdf_index(
    probs: torch.Tensor,  # [..., vocab] float64 >= 0, each row with a positive entry, need not be normalised
    uniform: torch.Tensor,  # [...] float64 in (0, 1): a draw per row
) -> torch.Tensor:  # [...] int64
    """``inverse_cdf`` of each row by tensor operations only (no host value read: a CUDA graph captures it)."""
    token = _cell(probs, uniform)
    ids = torch.arange(probs.shape[-1], device=probs.device)
    last = torch.where(probs > 0, ids, torch.zeros_like(ids)).amax(dim=-1)  # the last token with mass
    return torch.where(token >= probs.shape[-1], last, token)


def _cell(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:  # [..., vocab], [...] -> [...] int64
    """The first token whose CDF exceeds ``uniform`` times the row's total (right=True skips tokens with p == 0);
    the vocabulary size where rounding puts the target onto the total."""
    cdf = torch.cumsum(probs, dim=-1)
    return torch.searchsorted(cdf, (uniform * cdf[..., -1])[..., None], right=True)[..., 0]

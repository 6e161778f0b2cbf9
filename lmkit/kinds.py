"""Wire-level kinds shared by every component: how a block is verified, and which drafter drafts it.

They mirror the enums of ``protos/specsplit/v1/specsplit.proto`` and carry the
same integer values on the wire. Pure: no torch, no grpc, so the orchestrator
and light clients use them without the model stack.

Verification modes are a closed set (the target implements each one).
Drafter kinds are open: the built-in ones are listed here and in the proto, and
a draft service may serve more. Each kind is registered once, by its value and
name, by whoever defines it (this module for the built-ins, a drafter module
for its own); a draft service reports the kinds it serves with their traits in
``ModelInfo.drafter_info``, and the orchestrator learns them from there.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import ClassVar, Iterator


class VerificationMode(enum.Enum):
    """How the target checks draft tokens; carried in the session config and on the wire."""

    GREEDY = 1  # accept while draft token == target argmax; correction = argmax
    TOKEN_ONLY = 2  # x is a point proposal: accept w.p. p(x); on rejection sample from p without x, renormalised
    DRAFT_PROBS = 3  # accept w.p. min(1, p(x)/q(x)); on rejection sample from norm(max(0, p - q))
    COUPLED = 4  # target token = argmax(log p + G(seed, position)); accept iff the draft token equals it

    @property
    def samples(self) -> bool:
        """True for the modes that sample (temperature > 0)."""
        return self is not VerificationMode.GREEDY


# The modes a target verifies token trees in (target_service.tree_verify); the others take chains.
TREE_MODES = frozenset({VerificationMode.GREEDY, VerificationMode.TOKEN_ONLY, VerificationMode.COUPLED})


class _KindRegistry(type):
    """Enum-like class access over the registered drafter kinds: ``DrafterKind["NGRAM"]``, iteration."""

    def __iter__(cls) -> Iterator[DrafterKind]:
        return iter(sorted(cls._by_value.values(), key=lambda kind: kind.value))

    def __getitem__(cls, name: str) -> DrafterKind:
        return cls._by_name[name.upper()]


class DrafterKind(metaclass=_KindRegistry):
    """A drafter's id on the wire (a ``specsplit.v1.DrafterKind`` value) and its name.

    ``DrafterKind(2)`` is the registered kind with value 2 (ValueError when none
    is); ``DrafterKind(90, "ECHO")`` registers a new kind, or returns it when the
    same pair is already registered. Kinds are interned, so ``is`` compares them.
    """

    __slots__ = ("value", "name")
    _by_value: ClassVar[dict[int, DrafterKind]] = {}
    _by_name: ClassVar[dict[str, DrafterKind]] = {}

    MODEL: ClassVar[DrafterKind]
    NGRAM: ClassVar[DrafterKind]
    LAYERSKIP: ClassVar[DrafterKind]
    QUANTIZED: ClassVar[DrafterKind]
    CHAIN: ClassVar[DrafterKind]
    EAGLE: ClassVar[DrafterKind]
    RECYCLING: ClassVar[DrafterKind]
    MEDUSA: ClassVar[DrafterKind]

    value: int
    name: str

    def __new__(cls, value: int, name: str | None = None) -> DrafterKind:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"a drafter kind is an int, got {value!r}")
        known = cls._by_value.get(value)
        if name is None:
            if known is None:
                raise ValueError(f"{value} is not a registered drafter kind")
            return known
        name = name.upper()
        if known is not None:
            if known.name != name:
                raise ValueError(f"drafter kind {value} is already registered as {known.name}, not {name}")
            return known
        if value <= 0:
            raise ValueError(f"drafter kind values are > 0 (0 means unspecified), got {value}")
        if not name.replace("_", "").isalnum() or name in cls._by_name:
            raise ValueError(f"drafter name {name!r} is taken or not an identifier")
        kind = super().__new__(cls)
        object.__setattr__(kind, "value", value)
        object.__setattr__(kind, "name", name)
        cls._by_value[value] = kind
        cls._by_name[name] = kind
        return kind

    def __setattr__(self, name, value) -> None:
        raise AttributeError("drafter kinds are immutable")

    def __reduce__(self):  # unpickles (Ray) to the interned kind, registering it where it is new
        return DrafterKind, (self.value, self.name)

    def __repr__(self) -> str:
        return f"DrafterKind.{self.name}"


DrafterKind.MODEL = DrafterKind(1, "MODEL")  # a causal LM sharing the target's vocabulary
DrafterKind.NGRAM = DrafterKind(2, "NGRAM")  # prompt lookup: model-free, continues the latest n-gram match
DrafterKind.LAYERSKIP = DrafterKind(3, "LAYERSKIP")  # the target's own first L layers + final norm + LM head
DrafterKind.QUANTIZED = DrafterKind(4, "QUANTIZED")  # the target's own checkpoint, transformer layers in int8
DrafterKind.CHAIN = DrafterKind(5, "CHAIN")  # an ordered list of other kinds, tried in turn each round
DrafterKind.EAGLE = DrafterKind(6, "EAGLE")  # a feature head over the target's hidden states (EAGLE-3 layout)
DrafterKind.RECYCLING = DrafterKind(7, "RECYCLING")  # token recycling: the target's own successors of verified tokens
DrafterKind.MEDUSA = DrafterKind(8, "MEDUSA")  # heads over the target's final hidden state, one shot, as a tree


def drafter_value(drafter: DrafterKind | str | int) -> int:
    """The wire value of a drafter given as a kind, a built-in name (any case) or a number."""
    if isinstance(drafter, DrafterKind):
        return drafter.value
    if isinstance(drafter, int):
        return drafter
    if drafter.isdigit():
        return int(drafter)
    try:
        return DrafterKind[drafter].value
    except KeyError:
        names = ", ".join(kind.name.lower() for kind in DrafterKind)
        raise ValueError(f"unknown drafter {drafter!r}; use one of {names} or a drafter's number") from None


@dataclass(frozen=True)
class DrafterTraits:
    """What a drafter can do, as its draft service reports it (``ModelInfo.drafter_info``)."""

    kind: DrafterKind
    has_probs: bool = False  # can send the distributions its tokens were sampled from (DRAFT_PROBS mode)
    needs_model: bool = False  # runs a model that must share the target's vocabulary
    free: bool = False  # proposals cost ~nothing to make: asked for up to the free bound, cut by quality
    # Drafts from the target's hidden features: the target must send them (TargetOpen.feature_layers).
    needs_features: bool = False
    feature_layers: tuple[int, ...] = ()  # the target's hidden-state indices it reads, in order
    feature_width: int = 0  # values per position it expects (the sum of those layers' hidden sizes)
    # Drafts from the target's best successors of verified positions: this many per position (TargetOpen.successors_k).
    successors_k: int = 0


# Model-backed drafters in order of preference as the fallback behind n-gram lookup.
_FALLBACK_ORDER = (DrafterKind.EAGLE, DrafterKind.LAYERSKIP, DrafterKind.QUANTIZED, DrafterKind.MODEL)


def default_chain(available) -> tuple[DrafterKind, ...]:
    """The chain used when CHAIN is asked for without members: n-gram, then the first model drafter served.

    Prompt lookup costs ~0 and is right where the output copies its input; the
    model drafter covers the rounds where nothing matches.
    """
    fallback = next((kind for kind in _FALLBACK_ORDER if kind in available), None)
    return (DrafterKind.NGRAM,) if fallback is None else (DrafterKind.NGRAM, fallback)

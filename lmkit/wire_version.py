"""The version of ``specsplit.v1`` a build speaks, and the versions of the peers it accepts.

Field numbers never change (docs/protocol.md, "Compatibility"), so adding a field needs no version: an
older peer reads it as absent. The version counts the changes an older peer would misread without
noticing: a value that moved to another field (it would read the default where the value used to be)
or a meaning that changed. Every call a peer makes on a session stream states the caller's version in
the metadata ``specsplit-wire-version``; every service states its own and the oldest it accepts in
``ModelInfo``. A caller that states none is version 1.

- 1: the contract before versions were stated (protos/baseline/).
- 2: versions stated; each call's timings moved from DraftBlock and VerifyResult into ServiceTiming and
  ForwardReport, sessions share one stream per service (``Sessions``).

The draft and target services refuse version-1 orchestrators, which would read every service timing as
0, and the orchestrator refuses version-1 services, which would send none; the public
``Generator`` serves version-1 clients as before: its messages only gained fields.
"""

from __future__ import annotations

from collections.abc import Iterable

from specsplit.lmkit import errors

WIRE_VERSION = 2
UNSTATED = 1  # the version of a peer that states none
METADATA_KEY = "specsplit-wire-version"

# The oldest version each side accepts. A newer peer is accepted: it has read this build's version (in
# ModelInfo, or as unstated) and speaks down to it, or refuses it itself.
OLDEST_ORCHESTRATOR = 2  # what the draft and target services accept from orchestrators
OLDEST_SERVICE = 2  # what the orchestrator accepts from draft and target services
OLDEST_CLIENT = 1  # what the public Generator accepts from clients


def metadata() -> tuple[tuple[str, str], ...]:
    """The metadata that states this build's version on a call."""
    return ((METADATA_KEY, str(WIRE_VERSION)),)


def stated_version(invocation_metadata: Iterable[tuple[str, str | bytes]] | None) -> int:
    """The version a caller states in its metadata; ``UNSTATED`` when it states none.

    A value that is not a positive integer is refused (InvalidArgument) rather than guessed at."""
    value = next((v for k, v in invocation_metadata or () if k == METADATA_KEY), None)
    if value is None:
        return UNSTATED
    text = value.decode(errors="replace") if isinstance(value, bytes) else value
    if not text.isdigit() or int(text) < 1:
        raise errors.InvalidArgument(f"metadata {METADATA_KEY} must be a positive integer; got {text!r}")
    return int(text)


def describe(version: int) -> str:
    """A peer's version as a message states it."""
    if version <= UNSTATED:
        return f"wire version {UNSTATED} (it states none: a build from before versions were stated)"
    return f"wire version {version}"


_FIX = "Run builds that accept each other's versions (docs/protocol.md, \"Compatibility\")"


def check_caller(version: int, oldest: int, service: str, caller: str) -> None:
    """Refuse (FailedPrecondition) a caller older than ``oldest``, naming both versions."""
    if version < oldest:
        raise errors.FailedPrecondition(
            f"this {service} speaks specsplit.v1 wire version {WIRE_VERSION} and accepts {caller}s of version "
            f"{oldest} or later; the {caller} speaks {describe(version)}. {_FIX}"
        )


def check_service(version: int, oldest_accepted: int, service: str, address: str) -> None:
    """Refuse (FailedPrecondition) a service older than ``OLDEST_SERVICE`` or one that does not accept this build.

    ``version`` and ``oldest_accepted`` are its ``ModelInfo.wire_version`` and ``min_wire_version`` (0: unstated)."""
    version = max(version, UNSTATED)
    if version < OLDEST_SERVICE:
        raise errors.FailedPrecondition(
            f"the {service} at {address} speaks specsplit.v1 {describe(version)}; this orchestrator speaks wire "
            f"version {WIRE_VERSION} and accepts {service}s of version {OLDEST_SERVICE} or later. {_FIX}"
        )
    if oldest_accepted > WIRE_VERSION:
        raise errors.FailedPrecondition(
            f"the {service} at {address} speaks specsplit.v1 wire version {version} and accepts orchestrators of "
            f"version {oldest_accepted} or later; this orchestrator speaks wire version {WIRE_VERSION}. {_FIX}"
        )

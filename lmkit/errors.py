"""Domain errors that services raise and servicers turn into gRPC status codes.

Engines stay free of grpc: they raise these, and ``specsplit.lmkit.grpc_server`` maps
each to its status code with the message unchanged. Messages say what to fix.
"""


class SpecsplitError(Exception):
    """Base class; never raised directly."""


class InvalidArgument(SpecsplitError, ValueError):
    """The request itself is malformed (INVALID_ARGUMENT)."""


class FailedPrecondition(SpecsplitError):
    """The request is well-formed but does not fit the session's state (FAILED_PRECONDITION)."""


class NotFound(SpecsplitError):
    """The named session does not exist (NOT_FOUND)."""


class AlreadyExists(SpecsplitError):
    """A session with that id is already live (ALREADY_EXISTS)."""


class ResourceExhausted(SpecsplitError):
    """A bounded resource (sessions, queue) is full (RESOURCE_EXHAUSTED)."""


class Unavailable(SpecsplitError):
    """The service cannot serve now: loading, draining, or a peer is down (UNAVAILABLE)."""


class Unauthenticated(SpecsplitError):
    """The caller's credentials are missing, wrong or not admitted (UNAUTHENTICATED)."""


class Internal(SpecsplitError):
    """The service failed on this request's own data (NaN logits, out of memory, a bad cache) (INTERNAL)."""

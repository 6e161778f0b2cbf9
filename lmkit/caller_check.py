"""The caller check of the draft and target services: a bearer token, an allowed certificate name, or both.

A server interceptor that wraps every handler but health and reflection:
before the handler runs it checks ``authorization: Bearer <token>`` against the
service's ``Tokens`` (``lmkit.auth``) and, on mTLS with ``--tls-allowed-sans``,
that the client certificate names an allowed SAN. A refused call ends with
UNAUTHENTICATED (no or a wrong token) or PERMISSION_DENIED (a certificate of
the CA without an allowed name), its message naming the flag to set. An
admitted call runs with its caller's identity in ``auth.CALLER``, which the
session tables count per-caller quotas against.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from dataclasses import dataclass

import grpc

from specsplit.lmkit.auth import CALLER, Tokens

OPEN_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
_SAN_KEY = "x509_subject_alternative_name"


class Refused(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class CallerPolicy:
    """What a service requires of its callers; nothing set: every caller is ``anonymous`` and admitted."""

    service: str  # "target" or "draft", for messages
    tokens: Tokens | None = None
    allowed_sans: frozenset[str] = frozenset()  # on mTLS: the client certificate must name one of these

    @property
    def enabled(self) -> bool:
        return self.tokens is not None or bool(self.allowed_sans)

    def identify(self, metadata, auth_context: dict) -> str:
        """The caller's identity; raises ``Refused`` for a caller the policy does not admit."""
        san = self._allowed_san(auth_context)
        if self.tokens is None:
            return san
        offered = ""
        for key, value in metadata or ():
            if key == "authorization":
                offered = value if isinstance(value, str) else value.decode(errors="replace")
                break
        caller = self.tokens.caller(offered[len("Bearer "):]) if offered.startswith("Bearer ") else None
        if caller is None:
            raise Refused(
                grpc.StatusCode.UNAUTHENTICATED,
                f"the {self.service} service requires `authorization: Bearer <token>` with a token of its "
                f"--auth-token-file; {'a wrong' if offered else 'no'} token was sent (the orchestrator sends "
                "one with --peer-token-file or SPECSPLIT_PEER_TOKEN)",
            )
        return san if san and caller.startswith("token:") else caller

    def _allowed_san(self, auth_context: dict) -> str:
        if not self.allowed_sans:
            return ""
        names = [n.decode(errors="replace") for n in auth_context.get(_SAN_KEY, ())]
        for name in names:
            if name in self.allowed_sans:
                return name
        raise Refused(
            grpc.StatusCode.PERMISSION_DENIED,
            f"the {self.service} service admits client certificates naming one of "
            f"{sorted(self.allowed_sans)} (--tls-allowed-sans); this one names {names or 'nothing'}",
        )


class CallerCheck(grpc.aio.ServerInterceptor):
    """Checks every call but health and reflection against a ``CallerPolicy`` before its handler runs."""

    def __init__(self, policy: CallerPolicy) -> None:
        self._policy = policy

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(OPEN_PREFIXES):
            return handler
        return _guarded(handler, self._policy)


# A refused stream waits this long for the client's first message before it ends: a client whose write races
# the refusal's status would otherwise see its own write fail as INTERNAL instead of the status.
_FIRST_MESSAGE_S = 1.0


async def _admit(policy: CallerPolicy, context, streamed: bool) -> None:
    try:
        CALLER.set(policy.identify(context.invocation_metadata(), context.auth_context()))
    except Refused as exc:
        if streamed:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(_FIRST_MESSAGE_S):
                    await context.read()
        await context.abort(exc.code, str(exc))


def _guard(inner, policy: CallerPolicy, streamed: bool):
    """``inner`` behind the check, of the same kind (an async generator stays one, a coroutine stays one)."""
    if inspect.isasyncgenfunction(inner):
        async def stream(request, context):
            await _admit(policy, context, streamed)
            async for response in inner(request, context):
                yield response

        return stream

    async def call(request, context):
        await _admit(policy, context, streamed)
        return await inner(request, context)

    return call


def _guarded(handler: grpc.RpcMethodHandler, policy: CallerPolicy) -> grpc.RpcMethodHandler:
    kwargs = {"request_deserializer": handler.request_deserializer, "response_serializer": handler.response_serializer}
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(_guard(handler.unary_unary, policy, False), **kwargs)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(_guard(handler.unary_stream, policy, False), **kwargs)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(_guard(handler.stream_unary, policy, True), **kwargs)
    return grpc.stream_stream_rpc_method_handler(_guard(handler.stream_stream, policy, True), **kwargs)


def add_caller_flags(parser) -> None:
    """The flags that set a service's ``CallerPolicy``."""
    parser.add_argument(
        "--auth-token-file", "--token-file", default="",
        help="require `authorization: Bearer <token>` with a token of this file (one a line, `TOKEN` or "
             "`NAME TOKEN`; re-read when it changes); or SPECSPLIT_AUTH_TOKEN",
    )
    parser.add_argument("--auth-token-grace-s", type=float, default=120.0,
                        help="seconds a token removed from --auth-token-file is still accepted")
    parser.add_argument("--tls-allowed-sans", default="",
                        help="with --tls-ca (mTLS): admit only client certificates naming one of these "
                             "comma-separated SANs (DNS names, URIs, IPs)")
    parser.add_argument("--max-sessions-per-caller", type=int, default=0,
                        help="live sessions one caller (token name or certificate SAN) may hold; 0: --max-sessions")


def caller_policy(args, service: str) -> CallerPolicy:
    """A service's policy from its flags (ValueError for a bad combination)."""
    sans = frozenset(name.strip() for name in args.tls_allowed_sans.split(",") if name.strip())
    if sans and not args.tls_ca:
        raise ValueError("--tls-allowed-sans checks client certificates: it needs --tls-ca (mTLS)")
    tokens = Tokens.load(args.auth_token_file, "SPECSPLIT_AUTH_TOKEN", args.auth_token_grace_s)
    return CallerPolicy(service, tokens, sans)

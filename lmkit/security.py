"""TLS / mTLS for every service and its clients' channels, and a bearer-token check for the public API.

Both are off by default (the local demo runs on loopback) and meant on in
production: ``--tls-cert/--tls-key`` serve TLS, adding ``--tls-ca`` requires
client certificates signed by that CA (mTLS). Clients (the orchestrator to
its services, ``specsplit generate`` to the orchestrator) take
``--peer-tls-ca`` and, for mTLS, ``--peer-tls-cert/--peer-tls-key``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import grpc

from specsplit.lmkit.auth import Tokens


def _read(path: str, flag: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"{flag} {path}: {exc.strerror}") from None


@dataclass(frozen=True)
class ServerTls:
    cert: str = ""
    key: str = ""
    ca: str = ""  # set: clients must present a certificate signed by it (mTLS)

    def __post_init__(self) -> None:
        if bool(self.cert) != bool(self.key):
            raise ValueError("--tls-cert and --tls-key go together")
        if self.ca and not self.cert:
            raise ValueError("--tls-ca (mTLS) needs --tls-cert and --tls-key")

    @property
    def enabled(self) -> bool:
        return bool(self.cert)

    def credentials(self) -> grpc.ServerCredentials:
        pair = (_read(self.key, "--tls-key"), _read(self.cert, "--tls-cert"))
        ca = _read(self.ca, "--tls-ca") if self.ca else None
        return grpc.ssl_server_credentials([pair], root_certificates=ca, require_client_auth=ca is not None)


@dataclass(frozen=True)
class ClientTls:
    ca: str = ""  # trust this CA for the server's certificate
    cert: str = ""  # our certificate, for servers that require mTLS
    key: str = ""

    def __post_init__(self) -> None:
        if bool(self.cert) != bool(self.key):
            raise ValueError("--peer-tls-cert and --peer-tls-key go together")
        if self.cert and not self.ca:
            raise ValueError("--peer-tls-cert needs --peer-tls-ca")

    @property
    def enabled(self) -> bool:
        return bool(self.ca)

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca, "--peer-tls-ca"),
            private_key=_read(self.key, "--peer-tls-key") if self.key else None,
            certificate_chain=_read(self.cert, "--peer-tls-cert") if self.cert else None,
        )


# round_robin: a ``dns:///name:port`` address spreads calls over every replica the name resolves to.
_BALANCED = (("grpc.lb_policy_name", "round_robin"),)


def open_channel(address: str, tls: ClientTls | None = None, options: Sequence[tuple[str, object]] = ()):
    """An asyncio channel to any specsplit gRPC endpoint (TLS when ``tls`` is enabled)."""
    options = [*options, *_BALANCED]
    if tls is not None and tls.enabled:
        return grpc.aio.secure_channel(address, tls.credentials(), options=options)
    return grpc.aio.insecure_channel(address, options=options)


def open_sync_channel(address: str, tls: ClientTls | None = None) -> grpc.Channel:
    """A blocking channel to any specsplit gRPC endpoint, balanced and secured as ``open_channel``'s."""
    if tls is not None and tls.enabled:
        return grpc.secure_channel(address, tls.credentials(), options=list(_BALANCED))
    return grpc.insecure_channel(address, options=list(_BALANCED))


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls to the protected services without ``authorization: Bearer <token>``.

    Health checks and reflection stay open so probes and tooling work. The
    accepted tokens are ``tokens``' (``lmkit.auth``): a rotated token file takes
    effect on the next call.
    """

    def __init__(self, tokens: Tokens, protected_prefixes: tuple[str, ...]) -> None:
        self._tokens = tokens
        self._protected = protected_prefixes

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or not handler_call_details.method.startswith(self._protected):
            return handler
        metadata = dict(handler_call_details.invocation_metadata or ())
        if self._tokens.bearer_caller(str(metadata.get("authorization", ""))) is not None:
            return handler
        return _refuse(handler)


def _refuse(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    return refusing(handler, grpc.StatusCode.UNAUTHENTICATED,
                    "missing or wrong bearer token: send metadata `authorization: Bearer <token>`")


def refusing(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    """A handler of ``handler``'s shape that refuses every call with ``code`` and ``message``, reading nothing."""

    async def deny_unary(request, context):
        await context.abort(code, message)

    async def deny_stream(request_or_iterator, context):
        await context.abort(code, message)
        yield  # pragma: no cover - makes this an async generator for streaming handlers

    kwargs = {"request_deserializer": handler.request_deserializer, "response_serializer": handler.response_serializer}
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(deny_unary, **kwargs)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(deny_stream, **kwargs)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(deny_unary, **kwargs)
    return grpc.stream_stream_rpc_method_handler(deny_stream, **kwargs)

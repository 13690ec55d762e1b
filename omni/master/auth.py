"""Shared-token authentication and TLS / mTLS credentials for the master and its clients."""

from __future__ import annotations

import dataclasses
import hmac
from pathlib import Path

import grpc

from omni.errors import ConfigError

_HEADER = "authorization"


@dataclasses.dataclass(frozen=True)
class TlsFiles:
    """PEM files. Server: cert+key, and ca to require client certs (mTLS).
    Client: ca to verify the master (system roots when None), cert+key to present a client cert."""

    cert: str | None = None
    key: str | None = None
    ca: str | None = None

    def _read(self, name: str) -> bytes | None:
        path = getattr(self, name)
        if path is None:
            return None
        try:
            return Path(path).read_bytes()
        except OSError as e:
            raise ConfigError(f"cannot read TLS {name} file {path}: {e.strerror}") from None

    def server_credentials(self) -> grpc.ServerCredentials:
        if not self.cert or not self.key:
            raise ConfigError("the master needs both --tls-cert and --tls-key for TLS")
        ca = self._read("ca")
        return grpc.ssl_server_credentials(
            [(self._read("key"), self._read("cert"))], root_certificates=ca, require_client_auth=ca is not None)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        if bool(self.cert) != bool(self.key):
            raise ConfigError("a client certificate needs both --tls-cert and --tls-key")
        return grpc.ssl_channel_credentials(
            root_certificates=self._read("ca"), private_key=self._read("key"), certificate_chain=self._read("cert"))


def tls_from_options(cert: str | None, key: str | None, ca: str | None) -> TlsFiles | None:
    return TlsFiles(cert, key, ca) if (cert or key or ca) else None


def call_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    return ((_HEADER, f"Bearer {token}"),) if token else ()


class TokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call without `authorization: Bearer <token>` with UNAUTHENTICATED."""

    def __init__(self, token: str):
        if not token:
            raise ConfigError("the omni token must not be empty")
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        got = ""
        for key, value in handler_call_details.invocation_metadata or ():
            if key == _HEADER:
                got = value if isinstance(value, str) else value.decode(errors="replace")
        if hmac.compare_digest(got.encode(), self._expected) or handler is None:
            return handler
        return _refusing(handler, "missing or wrong omni token" if got else "no omni token sent "
                         "(set --omni-token or OMNI_TOKEN)")


def _refusing(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    async def refuse(request_or_iterator, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    kw = dict(request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse, **kw)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse, **kw)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse, **kw)
    return grpc.unary_unary_rpc_method_handler(refuse, **kw)

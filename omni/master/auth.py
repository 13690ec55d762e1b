"""Shared-token authentication and TLS / mTLS credentials for the master and its clients."""

from __future__ import annotations

import dataclasses
import hmac
import ipaddress
import os
import socket
from pathlib import Path

import grpc

from omni.errors import ConfigError
from omni.master.errors import Unauthenticated

_HEADER = "authorization"
FLAGS = {"cert": "--tls-cert", "key": "--tls-key", "ca": "--tls-ca"}
_PEM = {"cert": b"-----BEGIN CERTIFICATE-----", "key": b"PRIVATE KEY-----", "ca": b"-----BEGIN CERTIFICATE-----"}


class TlsRefused(Unauthenticated):
    """The TLS handshake with the master failed on a certificate: no retry makes it pass."""


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
            raise ConfigError(f"{FLAGS[name]} {path}: cannot read it: {e.strerror}") from None

    def check(self) -> None:
        """Refuse a missing, unreadable or non-PEM file, an encrypted key, or a key that is not the
        certificate's, naming the flag: at start-up, not at the first handshake."""
        import ssl

        if bool(self.cert) != bool(self.key):
            raise ConfigError("--tls-cert and --tls-key go together (a certificate and its private key)")
        for name in ("cert", "key", "ca"):
            data = self._read(name)
            if data is not None and _PEM[name] not in data:
                what = "private key" if name == "key" else "certificate"
                raise ConfigError(f"{FLAGS[name]} {getattr(self, name)}: not a PEM {what} (no '{_PEM[name].decode()}')")
            if name == "key" and data is not None and b"ENCRYPTED" in data:
                raise ConfigError(f"--tls-key {self.key}: an encrypted key; gRPC takes only unencrypted ones")
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        if self.ca:
            try:
                ctx.load_verify_locations(self.ca)
            except ssl.SSLError as e:
                raise ConfigError(f"--tls-ca {self.ca}: not a PEM CA certificate: {e.reason or e}") from None
        if self.cert:
            try:
                ctx.load_cert_chain(self.cert, self.key, password=b"")
            except ssl.SSLError as e:
                if e.reason == "KEY_VALUES_MISMATCH":
                    raise ConfigError(f"--tls-key {self.key}: not the private key of --tls-cert {self.cert}") from None
                raise ConfigError(f"--tls-cert {self.cert} / --tls-key {self.key}: cannot load them: "
                                  f"{e.reason or e}") from None

    def client_view(self) -> "TlsFiles":
        """How processes on the master's own host connect to it: its --tls-ca verifies it (none: the
        system's CAs) and, as that CA also requires client certs (mTLS), they present the master's cert."""
        return TlsFiles(self.cert, self.key, self.ca) if self.ca else TlsFiles()

    def argv(self) -> list[str]:
        """For a child process (omni.children): paths only; the child reads the files itself."""
        args = ["--tls"]
        for name, flag in FLAGS.items():
            if getattr(self, name):
                args += [flag, os.path.abspath(getattr(self, name))]
        return args

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


def is_loopback(host: str) -> bool:
    """Whether a bind address reaches this host only: 127.0.0.0/8, ::1, or a name that resolves to them alone."""
    h = host.strip().strip("[]")
    try:
        addrs = [ipaddress.ip_address(h)]
    except ValueError:
        try:
            addrs = [ipaddress.ip_address(i[4][0].split("%")[0]) for i in socket.getaddrinfo(h, None)]
        except (OSError, ValueError):
            return False
    mapped = [getattr(a, "ipv4_mapped", None) or a for a in addrs]   # ::ffff:127.0.0.1 is loopback too
    return bool(mapped) and all(a.is_loopback for a in mapped)


def refuse_open_master(host: str, token: str | None, flag: str) -> None:
    """A master bound beyond loopback without a token lets anyone who reaches it register a stage or send
    sleep and drain: refused naming both flags (a stage's listeners likewise: refuse_open_stage)."""
    if not token and not is_loopback(host):
        raise ConfigError(f"{flag} {host} opens the master to other hosts, and without --omni-token (or OMNI_TOKEN) "
                          "it authenticates no one (anyone reaching it can register a stage or send sleep and drain); "
                          "set --omni-token, or bind 127.0.0.1")


def refuse_open_stage(host: str, token: str | None, source: str) -> None:
    """A stage's listeners (its channel, tensor servers) bound beyond loopback without a token take anyone who
    reaches them: refused naming both flags, as an open master is. `source`: how the address was chosen."""
    if not token and not is_loopback(host):
        raise ConfigError(f"{source} opens this stage's listeners (its channel and tensor servers) to other hosts, "
                          "and without --omni-token (or OMNI_TOKEN) they authenticate no one (anyone reaching them "
                          "can send requests, or sleep and wake the stage); set --omni-token, or use a loopback "
                          "--omni-replica-address")


def tls_from_options(cert: str | None, key: str | None, ca: str | None) -> TlsFiles | None:
    for flag, value in (("--tls-cert", cert), ("--tls-key", key), ("--tls-ca", ca)):
        if value == "":   # read as unset, it would turn TLS off: fail closed, as an empty --omni-token does
            raise ConfigError(f"{flag} is empty; give a PEM file's path, or leave it unset for no TLS")
    return TlsFiles(cert, key, ca) if (cert or key or ca) else None


def serve_tls(cert: str | None, key: str | None, ca: str | None,
              hosts_master: bool) -> tuple[TlsFiles | None, TlsFiles | None]:
    """`omni serve`'s --tls-*: (the master's server files where it hosts the master, the files its
    processes connect to the master with). Checked here, so a bad file fails the start naming its flag."""
    given = tls_from_options(*(os.path.abspath(p) if p else p for p in (cert, key, ca)))
    if given is None:
        return None, None
    if hosts_master and not (cert and key):
        raise ConfigError("--tls-cert and --tls-key: the master this command runs needs both for TLS "
                          "(--tls-ca then requires client certificates, mTLS); with --headless, --tls-ca "
                          "alone verifies a remote master")
    given.check()
    return (given, given.client_view()) if hosts_master else (None, given)


def explain(details: str, address: str, tls: TlsFiles | None) -> tuple[str, bool] | None:
    """What a failed connection's gRPC details mean when TLS is involved: (message, final). Final:
    a certificate failure, which waiting does not cure. None: nothing TLS-specific in them."""
    if tls is None:
        if details.endswith("Socket closed"):
            return (f"cannot reach the omni master at {address}: {details} (a master with TLS closes plaintext "
                    "connections: if it runs with --tls-cert, connect with --tls-ca)"), False
        return None
    host = address.rpartition(":")[0].strip("[]")
    if "Hostname Verification Check failed" in details:
        return (f"omni master at {address}: TLS: {host} is not a name or IP address in the master's certificate; "
                "address a TLS master by one its certificate holds"), True
    if "WRONG_VERSION_NUMBER" in details:
        return (f"omni master at {address}: TLS: it does not answer with TLS (a master without --tls-cert "
                "takes plaintext connections: drop --tls-*)"), True
    if "andshake failed" in details and "SSL_ERROR_SSL" in details:
        by = f"--tls-ca {tls.ca}" if tls.ca else "the system's CA certificates (no --tls-ca given)"
        return (f"omni master at {address}: TLS: its certificate does not verify with {by}: "
                f"{details.rpartition('OPENSSL_internal:')[2] or details}"), True
    if details.endswith("Socket closed"):
        return (f"cannot reach the omni master at {address}: {details} (a master that requires client "
                "certificates closes the connection when none is presented or it does not take the one given: "
                "--tls-cert/--tls-key, signed by its --tls-ca, with the clientAuth key usage)"), False
    return None


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
    """A handler that refuses on the headers, whatever the method's kind: as a request-streaming one it reads no
    message, so an unfinished one is never waited for and held (a unary handler first reads its request whole)."""
    async def refuse(request_iterator, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    kw = dict(request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
    if handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse, **kw)
    return grpc.stream_unary_rpc_method_handler(refuse, **kw)

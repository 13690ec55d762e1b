"""Stage channel authentication: ZMQ CURVE with key pairs derived from the deployment token.

Both ends derive the same two Curve25519 key pairs from the token (HMAC-SHA256 under a
label, used as the secret key): the stage's server pair and the frontends' client pair.
A client needs the server's public key to start the handshake and the client secret key
to finish it; the stage's ZAP handler admits only the client public key. So every
connection proves the token in its own handshake before ZMQ delivers one message, a
ZMQ identity alone gets nothing, and the channel is encrypted between hosts.
Without a token the channel uses ZMQ's NULL mechanism (no authentication).
"""

from __future__ import annotations

import hashlib
import hmac
import threading

import zmq
from zmq.utils import z85

# Largest stage-channel message either end accepts (ZMQ drops the connection past it):
# token ids and descriptors only, tensors travel apart.
MAX_MESSAGE_BYTES = 64 << 20
ZAP_DOMAIN = "omni-stage"
HANDSHAKE_MS = 10_000

_lock = threading.Lock()
_authenticators: dict[int, tuple[object, set[bytes]]] = {}   # id(context) -> (authenticator, client keys)


def key_pair(token: str, label: bytes) -> tuple[bytes, bytes]:
    """(public, secret), z85-encoded, derived from the token."""
    secret = z85.encode(hmac.new(token.encode(), label, hashlib.sha256).digest())
    return zmq.curve_public(secret), secret


class _ClientKeys:
    def __init__(self, keys: set[bytes]):
        self.keys = keys

    def callback(self, domain: str, key: bytes) -> bool:
        # Constant-time against each admitted key (one per token served in this process).
        return any(hmac.compare_digest(key, k) for k in list(self.keys))


def _admit(ctx: zmq.Context, client_public: bytes) -> None:
    """One ZAP handler per context (ZMQ allows one); it admits the given client keys."""
    from zmq.auth.thread import ThreadAuthenticator

    with _lock:
        entry = _authenticators.get(id(ctx))
        if entry is None:
            auth = ThreadAuthenticator(ctx)
            auth.start()
            keys: set[bytes] = set()
            auth.configure_curve_callback(ZAP_DOMAIN, credentials_provider=_ClientKeys(keys))
            entry = _authenticators[id(ctx)] = (auth, keys)
        entry[1].add(client_public)


def secure_server(sock: zmq.Socket, token: str) -> None:
    """Before bind: CURVE server with the token's keys (no token: NULL, unauthenticated)."""
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
    sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_MS)   # a peer that never finishes its handshake goes
    if not token:
        return
    _admit(sock.context, key_pair(token, b"omni-stage-client")[0])
    _public, secret = key_pair(token, b"omni-stage-server")
    sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN.encode())
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_SECRETKEY, secret)


def secure_client(sock: zmq.Socket, token: str) -> None:
    """Before connect: CURVE client holding the token's client pair."""
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
    if not token:
        return
    public, secret = key_pair(token, b"omni-stage-client")
    sock.setsockopt(zmq.CURVE_SERVERKEY, key_pair(token, b"omni-stage-server")[0])
    sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, secret)

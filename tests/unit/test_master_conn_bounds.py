"""What a peer without the token can make the master hold (docs/security.md, omni/master/limits.py).

A call without the token is refused on its headers, its message never read: a unary handler first read its
request whole, so an unfinished 4 MiB KvPut was held until the peer finished it (250 of them: +1 GiB). A
connection with no call open is closed after limits.MAX_IDLE_MS, and one older than MAX_AGE_MS takes no new
call, while the open calls of a token holder (a stage's KeepAlive, a frontend's watch) run on."""

from __future__ import annotations

import socket
import struct
import time

import grpc
import h2.config
import h2.connection
import h2.events
import h2.exceptions
import h2.settings
import pytest

from omni.master import kv, limits
from omni.master.client import MasterClient
from omni.master.configdiff import hash_config
from omni.master.server import MasterServer
from tests.unit.master_peers import wait_until

CFG = {"model": "m", "stages": [{"stage_id": 0, "name": "a"}]}
HASH = hash_config(CFG)
TOKEN = "tk"


@pytest.fixture
def master(monkeypatch):
    yield from started(monkeypatch, idle_ms=500, age_ms=1500)


def started(monkeypatch, idle_ms: int, age_ms: int):
    monkeypatch.setattr(limits, "MAX_IDLE_MS", idle_ms)     # the server reads them when it starts
    monkeypatch.setattr(limits, "MAX_AGE_MS", age_ms)
    monkeypatch.setattr(limits, "KEEPALIVE_MS", 200)        # pings every 0.2 s are a client's, not abuse
    srv = MasterServer(CFG, HASH, token=TOKEN)
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture
def idle_only(monkeypatch):     # the age far off: a close is the idle one
    yield from started(monkeypatch, idle_ms=500, age_ms=600_000)


@pytest.fixture
def age_only(monkeypatch):      # the idle close far off: a close is the age one
    yield from started(monkeypatch, idle_ms=600_000, age_ms=1500)


class RawPeer:
    """An HTTP/2 client that says only what the test tells it to."""

    def __init__(self, port: int):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        self.h2 = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
        self.h2.initiate_connection()
        self.flush()
        self.settings: dict = {}
        self.trailers: dict[int, dict] = {}
        self.closed = False

    def flush(self) -> None:
        out = self.h2.data_to_send()
        if out:
            self.sock.sendall(out)

    def call(self, method: str, prefix_len: int, body: bytes, token: str | None = None) -> int:
        """Open a call whose message says it is `prefix_len` bytes long and send `body` of it."""
        sid = self.h2.get_next_available_stream_id()
        headers = [(":method", "POST"), (":scheme", "http"), (":path", f"/omni.v1.Master/{method}"),
                   (":authority", "x"), ("content-type", "application/grpc"), ("te", "trailers")]
        if token:
            headers.append(("authorization", f"Bearer {token}"))
        self.h2.send_headers(sid, headers)
        self.h2.send_data(sid, struct.pack(">BI", 0, prefix_len) + body)
        self.flush()
        return sid

    def read(self, until, timeout: float) -> bool:
        """Read frames until `until()` holds or the server closes; whether it held by the deadline."""
        deadline = time.monotonic() + timeout
        while not until() and not self.closed and time.monotonic() < deadline:
            self.sock.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                data = self.sock.recv(1 << 16)
            except socket.timeout:
                break
            except OSError:
                data = b""
            if not data:
                self.closed = True
                break
            try:
                events = self.h2.receive_data(data)
            except h2.exceptions.ProtocolError:     # past the GOAWAY: only the close is awaited
                continue
            for ev in events:
                if isinstance(ev, h2.events.RemoteSettingsChanged):
                    self.settings.update({k: v.new_value for k, v in ev.changed_settings.items()})
                elif isinstance(ev, h2.events.TrailersReceived):
                    self.trailers[ev.stream_id] = dict(ev.headers)
                elif isinstance(ev, h2.events.ResponseReceived) and ("grpc-status", "16") in ev.headers:
                    self.trailers[ev.stream_id] = dict(ev.headers)   # a trailers-only answer
            try:
                self.flush()
            except OSError:
                self.closed = True
        return until()

    def told_to_go(self) -> bool:
        """Whether the server's GOAWAY came: h2 then refuses new streams (and frames after it, so its event
        may be lost with a PING that came in the same read)."""
        return self.h2.state_machine.state is h2.connection.ConnectionState.CLOSED

    def close(self) -> None:
        self.sock.close()


@pytest.mark.parametrize("method", ["KvPut", "Register", "KeepAlive"])
@pytest.mark.parametrize("token", [None, "wrong"])
def test_a_call_without_the_token_is_refused_before_its_message_is_whole(master, method, token):
    peer = RawPeer(master.port)
    try:
        sid = peer.call(method, 3 << 20, b"\0" * 1024, token)      # 1 KiB of a 3 MiB message, never finished
        assert peer.read(lambda: sid in peer.trailers, timeout=3.0), "the master waits for the whole message"
        assert peer.trailers[sid]["grpc-status"] == "16"          # UNAUTHENTICATED
        assert "omni token" in peer.trailers[sid]["grpc-message"]
    finally:
        peer.close()


def test_the_master_caps_the_calls_a_connection_has_open(master):
    peer = RawPeer(master.port)
    try:
        peer.read(lambda: bool(peer.settings), timeout=3.0)
        assert peer.settings.get(h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS) == limits.MAX_STREAMS_PER_CONNECTION
    finally:
        peer.close()


def test_the_largest_legitimate_requests_fit_the_receive_limit():
    assert kv.MAX_VALUE_BYTES + kv.MAX_KEY_LEN + 4096 <= limits.MAX_REQUEST_BYTES    # a 3 MiB metrics value
    assert limits.MAX_CONFIG_BYTES + limits.MAX_REGISTRATION_BYTES + 4096 <= limits.MAX_REQUEST_BYTES
    assert limits.MAX_STREAMS_PER_CONNECTION >= 3 * 10   # a process's long calls, with room for its short ones


def test_a_connection_with_no_call_open_is_closed_pings_or_not(idle_only):
    # the age is 10 min here: a close within the test's 10 s is the idle one
    peer = RawPeer(idle_only.port)
    try:
        t0 = time.monotonic()
        while not peer.closed and not peer.told_to_go() and time.monotonic() - t0 < 10:
            peer.h2.ping(b"12345678")
            peer.flush()
            peer.read(lambda: False, timeout=0.2)
        peer.read(lambda: False, timeout=5.0)
        assert peer.closed, "the master holds an idle connection however long it pings"
    finally:
        peer.close()


def test_a_connection_kept_busy_by_refused_calls_is_told_to_go_at_its_age(age_only):
    # the idle close is 10 min off here: a GOAWAY within the test's 10 s is the age one. It takes no new call;
    # the connection then ends at the idle close (the test above), as a refused call leaves none open.
    peer = RawPeer(age_only.port)
    try:
        t0 = time.monotonic()
        while not peer.closed and not peer.told_to_go() and time.monotonic() - t0 < 10:
            peer.call("GetStatus", 0, b"")
            peer.read(lambda: False, timeout=0.2)
        assert peer.told_to_go() or peer.closed, "a peer refreshing its connection with refused calls holds it"
    finally:
        peer.close()


def _stage(address: str) -> MasterClient:
    c = MasterClient(address, token=TOKEN)
    c.register("STAGE", 0, config_hash=HASH)
    c.start_keepalive(lambda: {}, lambda cmd: (True, ""), interval_s=0.1)
    return c


def test_token_holders_streams_and_calls_outlive_idle_and_age_closes(master):
    stage = _stage(master.address)
    states: list = []
    stage._channel.subscribe(states.append)        # a GOAWAY sends the channel to IDLE
    watcher = MasterClient(master.address, token=TOKEN)
    caller = MasterClient(master.address, token=TOKEN)
    try:
        watch = watcher.watch(timeout_s=30)
        assert next(watch).kind == "SNAPSHOT"
        for pause in (0.2, 0.7, 1.0, 0.4, 0.9):                   # across idle closes and the age
            time.sleep(pause)
            caller.kv_put("x", "k", b"v")
            assert caller.get_status().replicas
        second = _stage(master.address)
        try:
            seen = next(watch)                                 # the old watch still gets events
            assert seen.kind in ("ADDED", "UPDATED")
            wait_until(lambda: sum(r.state == "READY" for r in caller.get_status().replicas) == 2)
        finally:
            second.close()
        assert grpc.ChannelConnectivity.IDLE in states[1:], states     # its connection was closed for new calls
        assert stage.registrations == 1 and stage.last_error is None   # but its KeepAlive never broke
        watch.cancel()
    finally:
        stage.close()
        watcher.close()
        caller.close()

"""Two hosts for the multi-host tests: fresh network namespaces joined directly by one veth pair
(nothing is configured in the root namespace; only the two addresses inside exist), made and removed
by the `hosts` fixture (root only; skipped elsewhere)."""

from __future__ import annotations

import ctypes
import itertools
import os
import re
import shutil
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.e2e.harness import REPO, OmniProcess, descendants, omni_env

# The token on: the stage channel runs CURVE and the tensor hellos HMAC across the two hosts.
TOKEN = "multihost-token"
ADDR_A, ADDR_B = "10.213.0.1", "10.213.0.2"
CLONE_NEWNET = 0x40000000
CMD_TIMEOUT_S = 30
# A frontend's /metrics line of tensor bytes by transport: (transport, bytes)
METRIC = re.compile(r'^omni_tensor_bytes_total\{[^}]*transport="(\w+)"[^}]*\} (\d+)$', re.M)


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=CMD_TIMEOUT_S)


def make_hosts(ns_a: str, ns_b: str) -> None:
    """Two namespaces, one veth pair created with an end in each, /30 addresses, lo up."""
    steps = [
        ("link", "add", "omni0", "netns", ns_a, "type", "veth", "peer", "name", "omni0", "netns", ns_b),
        ("-n", ns_a, "addr", "add", f"{ADDR_A}/30", "dev", "omni0"),
        ("-n", ns_b, "addr", "add", f"{ADDR_B}/30", "dev", "omni0"),
    ]
    for ns in (ns_a, ns_b):
        steps += [("-n", ns, "link", "set", "lo", "up"), ("-n", ns, "link", "set", "omni0", "up")]
    for i, step in enumerate(steps):
        r = _ip(*step)
        if r.returncode != 0 and i == 0:
            pytest.skip(f"cannot create a veth pair here: ip {' '.join(step)}: {r.stderr.strip()}")
        if r.returncode != 0:
            raise AssertionError(f"ip {' '.join(step)} failed: {r.stderr.strip()}")


def enter_netns(name: str) -> None:
    """Move the calling thread into network namespace `name` (network namespaces are per thread)."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns {name}: {os.strerror(err)}")
    finally:
        os.close(fd)


class Host:
    """A namespace: commands run in it with `ip netns exec`, HTTP calls from a thread inside it."""

    def __init__(self, name: str, addr: str):
        self.name = name
        self.addr = addr
        self.prefix = ("ip", "netns", "exec", name)
        self._pool = ThreadPoolExecutor(max_workers=1, initializer=enter_netns, initargs=(name,),
                                        thread_name_prefix=f"netns-{name}")

    def call(self, fn, *args, timeout: float = 180.0, **kwargs):
        return self._pool.submit(fn, *args, **kwargs).result(timeout)

    def run(self, *argv: str, timeout: float = CMD_TIMEOUT_S) -> subprocess.CompletedProcess:
        return subprocess.run([*self.prefix, *argv], capture_output=True, text=True, timeout=timeout,
                              cwd=REPO, env=omni_env(OMNI_TOKEN=TOKEN))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


_made = itertools.count()


@pytest.fixture(scope="module")
def hosts():
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root (CI runs this test as root)")
    if shutil.which("ip") is None:
        pytest.skip("iproute2's `ip` is not installed")
    tag = f"{os.getpid()}-{next(_made)}"    # each test module makes its own pair
    names = [f"omni-mh-a-{tag}", f"omni-mh-b-{tag}"]
    made: list[str] = []
    pools: list[Host] = []
    try:
        for name in names:
            r = _ip("netns", "add", name)
            if r.returncode != 0:
                pytest.skip(f"cannot create a network namespace here: ip netns add: {r.stderr.strip()}")
            made.append(name)
        make_hosts(*names)
        pools += [Host(names[0], ADDR_A), Host(names[1], ADDR_B)]
        yield pools[0], pools[1]
    finally:
        for host in pools:
            host.close()
        for name in made:   # deletes the veth pair too
            _ip("netns", "delete", name)


def status(host: Host, master: str, *extra: str) -> subprocess.CompletedProcess:
    return host.run(sys.executable, "-m", "omni.cli", "status", "--master", master, *extra)


def kill_all(procs: list[OmniProcess]) -> None:
    """The finalizer: a head's stages and frontends run in their own process groups, so by pid too."""
    children = [pid for p in procs for pid in descendants(p.proc.pid)]
    for p in procs:
        if p.proc.poll() is None:
            p.kill()
    for pid in children:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

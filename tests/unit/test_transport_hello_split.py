"""The token hello (magic | HMAC of the nonce) may reach the server in any number of reads: a correct one
is admitted however TCP splits it, a wrong magic is refused at its first wrong byte. The check compared
5-35 bytes with the 4-byte magic, so a hello split after the magic was refused."""

from __future__ import annotations

import socket

import pytest
import torch

from omni.transport import tcp
from omni.transport.server import HELLO_BYTES, NONCE_BYTES, hello_answer, token_hello

MAGIC = b"OMNt"
NONCE = bytes(range(NONCE_BYTES))


@pytest.mark.parametrize("split", range(1, HELLO_BYTES))
def test_a_correct_hello_is_admitted_split_at_any_offset(split):
    check = token_hello(MAGIC, b"tk")
    answer = hello_answer(MAGIC, "tk", NONCE)
    assert check(None, answer[:split], NONCE) is None          # more to come, not refused
    assert check(None, answer, NONCE) is True


def test_a_wrong_magic_is_refused_at_its_first_wrong_byte():
    check = token_hello(MAGIC, b"tk")
    assert check(None, b"OMx", NONCE) is False
    assert check(None, b"XMNt" + bytes(10), NONCE) is False


def test_a_wrong_token_is_refused_once_whole():
    check = token_hello(MAGIC, b"tk")
    answer = hello_answer(MAGIC, "other", NONCE)
    assert check(None, answer[:20], NONCE) is None             # the HMAC is checked whole only
    assert check(None, answer, NONCE) is False


@pytest.mark.parametrize("split", [3, 4, 10, 35])
def test_a_tcp_producer_admits_a_hello_in_two_sends(split):
    producer = tcp.TcpProducer(token="tk")
    try:
        producer.put(torch.zeros(4))
        host, port = producer.endpoint.split("//")[-1].rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=5) as s:
            nonce = b""
            while len(nonce) < NONCE_BYTES:
                nonce += s.recv(NONCE_BYTES - len(nonce))
            answer = hello_answer(tcp.MAGIC, "tk", nonce)
            s.sendall(answer[:split])
            with pytest.raises(socket.timeout):   # the server waits for the rest rather than refusing
                s.settimeout(0.2)
                s.recv(1)
            s.settimeout(5)
            s.sendall(answer[split:])
            assert s.recv(tcp.STATUS.size) == tcp.STATUS.pack(tcp.OK)
    finally:
        producer.close()

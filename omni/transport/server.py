"""A listening socket served by one accept thread; each connection gets its own thread.

Used by the shm fd server (unix socket) and the tcp/gloo data servers. `close()` wakes
the accept loop through a socketpair instead of relying on a timeout.
"""

from __future__ import annotations

import logging
import selectors
import socket
import threading
from collections.abc import Callable

logger = logging.getLogger(__name__)


class SocketServer:
    def __init__(self, sock: socket.socket, handler: Callable[[socket.socket], None], name: str):
        self._sock = sock
        self._handler = handler
        self._name = name
        self._wake_r, self._wake_w = socket.socketpair()
        self._lock = threading.Lock()
        self._conns: dict[socket.socket, threading.Thread] = {}
        self._closed = False
        self._thread = threading.Thread(target=self._accept_loop, name=f"{name}-accept", daemon=True)
        self._thread.start()

    def _accept_loop(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self._sock, selectors.EVENT_READ)
        sel.register(self._wake_r, selectors.EVENT_READ)
        try:
            while True:
                for key, _ in sel.select():
                    if key.fileobj is self._wake_r:
                        return
                    try:
                        conn, _addr = self._sock.accept()
                    except OSError as e:
                        logger.debug("%s: accept failed: %s", self._name, e)
                        continue
                    with self._lock:
                        if self._closed:
                            conn.close()
                            return
                        thread = threading.Thread(target=self._serve, args=(conn,),
                                                  name=f"{self._name}-conn", daemon=True)
                        self._conns[conn] = thread
                    thread.start()
        finally:
            sel.close()

    def _serve(self, conn: socket.socket) -> None:
        try:
            self._handler(conn)
        except (ConnectionError, OSError) as e:
            logger.debug("%s: connection ended: %s", self._name, e)
        except Exception:
            logger.exception("%s: connection handler failed", self._name)
        finally:
            with self._lock:
                self._conns.pop(conn, None)
            conn.close()

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._wake_w.send(b"x")
        self._thread.join(timeout=5)
        with self._lock:
            conns = dict(self._conns)
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        # let handlers unwind (and drop what they hold, e.g. process groups) before we return
        for thread in conns.values():
            if thread is not threading.current_thread():
                thread.join(timeout=5)
        self._sock.close()
        self._wake_r.close()
        self._wake_w.close()

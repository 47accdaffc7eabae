"""Who may talk to a snapshot endpoint: a connection's first bytes, its hello, read before anything else.

An ``Endpoint`` (``transfer.py``) listens on a TCP port of the node, reachable by anyone on its
network. ``admit_connections`` runs its accept loop: it reads every new connection's hello in that
one thread and hands only a connection that says the endpoint's secret to ``admit`` ([Note: hello]).

Example::

    secret = new_secret()
    threading.Thread(target=admit_connections, args=(server, secret, serve_one), daemon=True).start()
    conn = socket.create_connection(address)
    conn.sendall(hello(secret))                          # a Link's first bytes

# [Note: hello]
# A hello is HELLO_SIZE bytes: MAGIC and the endpoint's secret, and nothing of the connection is
# read before it: no header, no length, no thread. One thread (the accept loop) reads every pending
# hello through a selector, so a connection that has not said the secret costs a socket and a few
# bytes, never a thread or a header buffer. A hello must arrive within HELLO_TIMEOUT_S of the
# accept, and at most MAX_PENDING connections wait for theirs: beyond that the oldest is closed. A
# flood of half-open connections thus closes its own, while a link, which sends its hello with its
# connect, is read as soon as it is accepted. Only a connection whose hello matches (compared in
# constant time) gets a thread of its own, in ``admit``.
"""

from __future__ import annotations

import hmac
import secrets
import selectors
import socket
import time
from collections.abc import Callable

MAGIC = b"hf_lowzero-snapshots/1 "
SECRET_CHARS = 32  # secrets.token_hex(16)
HELLO_SIZE = len(MAGIC) + SECRET_CHARS
HELLO_TIMEOUT_S = 3.0  # a link sends its hello with its connect; a LAN's round trip is milliseconds
MAX_PENDING = 64  # connections waiting for their hello at once; beyond, the oldest is closed
POLL_S = 1.0  # how often the loop checks that its server socket is still open


def new_secret() -> str:
    """A new endpoint's secret: ``SECRET_CHARS`` hex characters."""
    return secrets.token_hex(SECRET_CHARS // 2)


def hello(secret: str) -> bytes:
    """The first bytes a link sends an endpoint whose secret is ``secret`` ([Note: hello])."""
    return MAGIC + secret.encode()


def admit_connections(server: socket.socket, secret: str, admit: Callable[[socket.socket], None]) -> None:
    """Accept connections on ``server`` until it is closed, and pass each whose hello says
    ``secret`` to ``admit`` (in blocking mode); close every other ([Note: hello]).
    """
    with selectors.DefaultSelector() as selector:
        hellos = _Hellos(selector, hello(secret), admit)
        try:
            server.setblocking(False)
            selector.register(server, selectors.EVENT_READ)
        except (OSError, ValueError):  # closed before this loop started
            return
        try:
            while server.fileno() != -1:
                for key, _ in selector.select(hellos.wait_s()):
                    if key.fileobj is not server:
                        hellos.read(key.fileobj)
                        continue
                    try:
                        conn, _ = server.accept()
                    except BlockingIOError:  # the connection went away before it was accepted
                        continue
                    except OSError:  # the server socket was closed
                        return
                    hellos.add(conn)
                hellos.expire()
        finally:
            hellos.close()


class _Hellos:
    """The connections whose hello is not whole yet, oldest first ([Note: hello])."""

    def __init__(self, selector: selectors.BaseSelector, expected: bytes, admit: Callable[[socket.socket], None]):
        self._selector, self._expected, self._admit = selector, expected, admit
        self._pending: dict[socket.socket, tuple[float, bytearray]] = {}  # conn -> (deadline, what came)

    def wait_s(self) -> float:
        """How long the loop may wait for the next event: until the oldest deadline, at most POLL_S."""
        now = time.monotonic()
        return max(0.0, min([POLL_S] + [deadline - now for deadline, _ in self._pending.values()]))

    def add(self, conn: socket.socket) -> None:
        if len(self._pending) >= MAX_PENDING:
            self._drop(next(iter(self._pending)))
        conn.setblocking(False)
        self._pending[conn] = (time.monotonic() + HELLO_TIMEOUT_S, bytearray())
        self._selector.register(conn, selectors.EVENT_READ)

    def read(self, conn: socket.socket) -> None:
        """Read what ``conn`` sent of its hello; once whole, admit it or close it."""
        got = self._pending[conn][1]
        try:
            chunk = conn.recv(len(self._expected) - len(got))
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        got += chunk
        if chunk and len(got) < len(self._expected):
            return
        if not chunk or not hmac.compare_digest(bytes(got), self._expected):  # closed early, or not ours
            self._drop(conn)
            return
        self._selector.unregister(conn)
        del self._pending[conn]
        conn.setblocking(True)
        self._admit(conn)

    def expire(self) -> None:
        now = time.monotonic()
        for conn in [c for c, (deadline, _) in self._pending.items() if deadline <= now]:
            self._drop(conn)

    def close(self) -> None:
        for conn in self._pending:
            conn.close()
        self._pending = {}

    def _drop(self, conn: socket.socket) -> None:
        self._selector.unregister(conn)
        del self._pending[conn]
        conn.close()

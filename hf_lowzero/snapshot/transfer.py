"""The snapshot data plane: standing connections to a node's holder, nothing through Ray per snapshot.

A snapshot moves a rank's piece to its own node's holder and a copy to the buddy node's holder, and
marks the step on every holder of the run ([Note: one request per snapshot] in
``hf_lowzero/ray/holder.py``). Each of those was a Ray call: a few milliseconds of CPU on each side
(serialization, the core worker's threads), on the cores that train, and the copy went through the
object store in four passes over the bytes. Here every holder listens on a TCP port of its own
(an ``Endpoint``), and the rank and the other holders keep a connection to it (a ``Link``) for the
whole run. Ray only says where an endpoint is (one call, at setup and after a failure).

Example::

    endpoint = Endpoint(host, {"mark": on_mark}, destination, landed)   # on a holder
    link = Link(endpoint.address)                                       # on a rank or another holder
    link.request({"op": "mark", "step": 15})                            # -> on_mark's answer
    link.send_piece(manifest, path)                                     # None, or what went wrong

# [Note: piece transfer]
# A connection's first bytes are its hello, which carries the endpoint's secret, read before anything
# else ([Note: hello] in ``gate.py``). Then requests go one at a time, each answered with one frame;
# a frame is 8 bytes of length and a JSON header. A request is
# ``{"op": ...}``: a piece (``"piece"``, with its manifest and size) or any op the endpoint has a
# handler for (a holder's ``land`` and ``mark``). For a piece the endpoint first asks
# ``destination(manifest, size)`` where it goes (``ValueError`` refuses it, and that refusal is the
# answer); otherwise it answers ``{"error": null}`` and the sender writes the file (``sendfile``:
# the kernel reads the file into the socket, no pass in Python), which the endpoint receives into
# ``<destination>.part`` mapped in memory, renames (a file under its final name is always whole)
# and hands to ``landed(manifest, path)``, whose error (the piece is removed) or None is the second
# answer. A piece request may carry a follow-up request (``then``: a holder's ``mark``), which the
# endpoint answers in that second answer once the piece landed: one request less per piece. One
# copy of the bytes on each node. A connection that breaks mid-request is closed (its
# stream is no longer in step); the next request opens a new one.
# The secret is made per endpoint and handed out only through its holder (a Ray call): a process
# that cannot call the holder cannot write into the node's memory.

# [Note: posted requests]
# A rank's request to its holder is answered once the holder copied the piece to the buddy node and
# marked it: milliseconds later, in the middle of the next step. A thread that waits for that
# answer wakes then and takes the GIL from the training thread, on cores the training shares. A
# request can instead be posted (``Link.post``: the frame is sent, nothing waits) and its answer
# read later by whoever posted it (``Link.answer``), at a moment of its choosing: answers come in
# the order of the requests on the connection, so the n-th answer belongs to the n-th post.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import select
import socket
import struct
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hf_lowzero.snapshot.gate import admit_connections, hello, new_secret
from hf_lowzero.snapshot.mapped import MappedFiles
from hf_lowzero.snapshot.segments import take_spare, unlink

LENGTH = struct.Struct("!Q")
MAX_HEADER = 1 << 24  # a manifest is tens of KB; anything larger is not one of ours
TIMEOUT_S = 120.0
BUFFER = 4 << 20  # socket buffers: fewer wake-ups per piece (the kernel caps it at its own maximum)

Address = tuple[str, int, str]  # host, port, secret
Handler = Callable[[dict[str, Any]], dict[str, Any]]


class Endpoint:
    """A TCP server thread answering ``Link`` requests: pieces, and the ops of ``handlers``
    ([Note: piece transfer]). Each connection that says the secret in its hello gets a thread
    ([Note: hello] in ``gate.py``); its requests are answered in turn.

    Args:
        host: The address to listen on (the node's IP); a free port is chosen.
        handlers: ``{op: request -> answer}`` for the ops other than ``"piece"``; an exception a
            handler raises becomes the answer ``{"error": ...}``.
        destination: ``(manifest, size) -> Path`` where a piece goes; raises ``ValueError`` to refuse
            it. None: pieces are refused.
        landed: ``(manifest, path) -> error or None``, called once a piece's file is whole.
        spares: A folder of spare files a piece may be written over ([Note: spare files] in
            ``segments.py``).
    """

    def __init__(
        self,
        host: str,
        handlers: dict[str, Handler] | None = None,
        destination: Callable[[dict[str, Any], int], Path] | None = None,
        landed: Callable[[dict[str, Any], Path], str | None] | None = None,
        spares: Path | None = None,
    ) -> None:
        self._handlers = dict(handlers or {})
        self._destination = destination
        self._landed = landed
        self._spares = spares
        self._files = MappedFiles()  # the files pieces were received into, mapped once
        secret = new_secret()
        self._server = socket.create_server((host, 0))
        self._server.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, BUFFER)  # the connections inherit it
        self.address: Address = (host, self._server.getsockname()[1], secret)
        threading.Thread(
            target=admit_connections, args=(self._server, secret, self._admit), daemon=True, name="hf_lowzero_endpoint"
        ).start()

    def close(self) -> None:
        """Stop accepting connections (open ones end with their next request)."""
        with contextlib.suppress(OSError):
            self._server.shutdown(socket.SHUT_RDWR)  # wakes the accept loop's select (close alone does not)
        self._server.close()
        self._files.close()

    def _admit(self, conn: socket.socket) -> None:
        """A connection whose hello said the secret ([Note: hello] in ``gate.py``): serve it."""
        threading.Thread(target=self._session, args=(conn,), daemon=True).start()

    def _session(self, conn: socket.socket) -> None:
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while True:
                conn.settimeout(None)  # a standing connection: the next snapshot may be minutes away
                try:
                    request = _read_header(conn)
                except (OSError, ValueError):
                    return  # the other side closed it (or died)
                conn.settimeout(TIMEOUT_S)
                try:
                    answer = self._answer(conn, request)
                    _write_header(conn, answer)
                except OSError:
                    return  # broken mid-request: the stream is out of step, the sender opens a new one

    def _answer(self, conn: socket.socket, request: dict[str, Any]) -> dict[str, Any]:
        op = request.get("op")
        try:
            if op == "piece":
                error = self._land(conn, request["manifest"], int(request["size"]))
                then = request.get("then")
                if error is None and then is not None:  # the follow-up, once the piece landed
                    if then.get("op") == "piece":
                        return {"error": "a piece's follow-up cannot be another piece"}
                    return self._answer(conn, then)
                return {"error": error}
            if op in self._handlers:
                return self._handlers[op](request)
            return {"error": f"this holder does not know the request {op!r}"}
        except OSError:
            raise  # this connection broke
        except Exception as e:  # the request's failure, answered: the connection stays in step
            return {"error": f"the request {op!r} failed here: {e!r}"}

    def _land(self, conn: socket.socket, manifest: dict[str, Any], size: int) -> str | None:
        if self._destination is None or self._landed is None:
            return "this endpoint takes no pieces"
        try:
            path = self._destination(manifest, size)
        except ValueError as e:
            return str(e)  # refused before a byte of the piece was sent
        _write_header(conn, {"error": None})  # send it
        part = path.with_name(path.name + ".part")
        recycled = self._spares is not None and take_spare(self._spares, size, part)  # [Note: spare files]
        try:
            fd = os.open(part, os.O_RDWR if recycled else os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                with self._files.writing(fd, size) as buffer:  # [Note: kept mappings] in mapped.py
                    _receive_into(conn, buffer, size)
            finally:
                os.close(fd)
            os.rename(part, path)
        except BaseException:
            unlink(part)
            raise
        error = self._landed(manifest, path)
        if error is not None:
            unlink(path)
        return error


class Link:
    """A standing connection to an ``Endpoint``; one request at a time (threads take turns).

    Args:
        address: The endpoint's ``(host, port, secret)``.
        timeout_s: How long to wait for the endpoint at any point of a request.

    Raises:
        OSError: The endpoint cannot be reached (its node or holder is gone). Any later request
            raises ``OSError`` too once the connection broke; make a new ``Link`` then.
    """

    def __init__(self, address: Address, timeout_s: float = TIMEOUT_S) -> None:
        host, port, secret = address
        self.address = address
        self._lock = threading.Lock()
        self._posted = 0  # requests posted whose answers were not read yet ([Note: posted requests])
        self._conn: socket.socket | None = socket.create_connection((host, port), timeout=timeout_s)
        self._conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, BUFFER)
        self._conn.sendall(hello(secret))  # [Note: hello] in gate.py

    @property
    def broken(self) -> bool:
        """The connection failed or was closed: this link serves no more requests."""
        return self._conn is None

    @property
    def posted(self) -> int:
        """How many posted requests still have an answer to read ([Note: posted requests])."""
        return self._posted

    def request(self, request: dict[str, Any]) -> dict[str, Any]:
        """Send ``request`` (``{"op": ..., ...}``) and return the endpoint's answer."""
        with self._lock:
            conn = self._open(in_step=True)
            try:
                _write_header(conn, request)
                return _answer(conn)
            except OSError:
                self._break()
                raise

    def post(self, request: dict[str, Any]) -> None:
        """Send ``request`` without waiting for its answer; ``answer()`` reads it later
        ([Note: posted requests]).
        """
        with self._lock:
            conn = self._open()
            try:
                _write_header(conn, request)
            except OSError:
                self._break()
                raise
            self._posted += 1

    def answer(self, wait: bool = True) -> dict[str, Any] | None:
        """The answer to the oldest posted request whose answer was not read yet; None when it has
        not come and ``wait`` is False. ``OSError``: the connection broke (no posted request will
        be answered).
        """
        with self._lock:
            if not self._posted:
                raise ValueError("no posted request is waiting for its answer on this link")
            conn = self._open()
            try:
                if not wait and not select.select([conn], [], [], 0)[0]:
                    return None
                answer = _answer(conn)
            except OSError:
                self._break()
                raise
            self._posted -= 1
            return answer

    def send_piece(self, manifest: dict[str, Any], path: str | Path, then: dict[str, Any] | None = None) -> str | None:
        """Send the piece in file ``path`` ([Note: piece transfer]), and ``then`` (a request the
        endpoint answers once the piece landed, or None). Returns None when it landed there (and
        ``then`` succeeded), else what went wrong (the endpoint refused the piece, found it wrong,
        or ``then`` failed).
        """
        with self._lock, open(path, "rb") as f:
            conn = self._open(in_step=True)
            try:
                size = os.fstat(f.fileno()).st_size
                _write_header(conn, {"op": "piece", "manifest": manifest, "size": size, "then": then})
                refused = _answer(conn).get("error")  # whether to send the bytes
                if refused is not None:
                    return refused
                conn.sendfile(f)
                return _answer(conn).get("error")  # whether they landed
            except OSError:
                self._break()
                raise

    def close(self) -> None:
        """Close the connection (the endpoint's thread for it ends)."""
        with self._lock:
            self._break()

    def _open(self, in_step: bool = False) -> socket.socket:
        """The connection; ``in_step``: the next frame read on it answers the next request sent
        (ValueError while posted requests' answers are due: [Note: posted requests]).
        """
        if in_step and self._posted:
            raise ValueError(f"{self._posted} posted requests' answers are still to be read on this link")
        if self._conn is None:
            raise OSError(f"the connection to {self.address[0]}:{self.address[1]} broke earlier")
        return self._conn

    def _break(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(OSError):
                self._conn.close()
            self._conn = None


def ask_all(links: list[Link], request: dict[str, Any]) -> list[dict[str, Any] | OSError]:
    """Send ``request`` on every link, then read every answer (the endpoints work on it at the same
    time); each link's answer, or the ``OSError`` that broke it.
    """
    out: list[dict[str, Any] | OSError] = []
    waiting = []
    for i, link in enumerate(links):
        link._lock.acquire()
        try:
            _write_header(link._open(), request)
            out.append({})
            waiting.append(i)
        except OSError as e:
            link._break()
            link._lock.release()
            out.append(e)
    for i in waiting:
        link = links[i]
        try:
            out[i] = _answer(link._open())
        except OSError as e:
            link._break()
            out[i] = e
        finally:
            link._lock.release()
    return out


def _answer(conn: socket.socket) -> dict[str, Any]:
    try:
        return _read_header(conn)
    except ValueError as e:
        raise OSError(f"the holder did not answer ({e})") from e


def _receive_into(conn: socket.socket, buffer: mmap.mmap, size: int) -> None:
    view = memoryview(buffer)
    try:
        got = 0
        while got < size:
            n = conn.recv_into(view[got:], size - got)
            if n == 0:
                raise OSError(f"the sender stopped after {got} of {size} bytes")
            got += n
    finally:
        view.release()


def _write_header(conn: socket.socket, header: dict[str, Any]) -> None:
    raw = json.dumps(header).encode()
    conn.sendall(LENGTH.pack(len(raw)) + raw)


def _read_header(conn: socket.socket) -> dict[str, Any]:
    (length,) = LENGTH.unpack(_read_exactly(conn, LENGTH.size))
    if length > MAX_HEADER:
        raise ValueError(f"a header of {length} bytes")
    header = json.loads(_read_exactly(conn, length))
    if not isinstance(header, dict):
        raise ValueError("a header that is not an object")
    return header


def _read_exactly(conn: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise ValueError(f"the connection closed after {len(data)} of {n} bytes")
        data += chunk
    return bytes(data)

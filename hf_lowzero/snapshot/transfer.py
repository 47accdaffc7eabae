"""Sending a snapshot piece to a buddy node: the file over one TCP connection, nothing through Ray.

A node's holder keeps the file a rank wrote its piece into ([Note: one call per snapshot] in
``hf_lowzero/ray/holder.py``) and must hand a copy to the buddy node's holder. Through Ray's object
store that copy took four passes over the bytes (into the local store, the raylets' transfer, out
of the remote store, into the buddy's file), on the CPUs that train. Here the sender's kernel reads
the file into the socket (``sendfile``: no pass in Python) and the receiver's kernel writes the
socket into the memory-mapped destination file: one copy on each node.

Example::

    receiver = PieceReceiver(host, destination, landed)   # on the buddy node's holder
    send_piece(receiver.address, manifest_json, path)      # on the own node's holder: None, or what went wrong

# [Note: piece transfer]
# One connection per piece. The sender writes a header (8 bytes of length, then JSON: the
# receiver's secret, the piece's manifest and its size in bytes). The receiver asks
# ``destination(manifest, size)`` where the piece goes (it raises ``ValueError`` to refuse it) and
# answers with a header (JSON: ``error``, None to go on). The sender then writes the file; the
# receiver fills ``<destination>.part``, renames it (a file under the final name is always whole),
# and ``landed(manifest, path)`` checks and keeps it (an error removes it). Its answer is the second
# reply. The secret is made
# per receiver and handed out only through its holder (a Ray call): a process that cannot call the
# holder cannot write into the node's memory.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import mmap
import os
import secrets
import socket
import struct
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hf_lowzero.snapshot.segments import take_spare, unlink

LENGTH = struct.Struct("!Q")
MAX_HEADER = 1 << 24  # a manifest is a few KB; anything larger is not one of ours
TIMEOUT_S = 120.0
BUFFER = 4 << 20  # socket buffers: fewer wake-ups per piece (the kernel caps it at its own maximum)


class PieceReceiver:
    """A TCP server thread that lands pieces sent by ``send_piece`` ([Note: piece transfer]).

    Args:
        host: The address to listen on (the node's IP); a free port is chosen.
        destination: ``(manifest, size) -> Path`` where the piece goes; raises ``ValueError`` to refuse it.
        landed: ``(manifest, path) -> error or None``, called once the file is whole.
    """

    def __init__(
        self,
        host: str,
        destination: Callable[[dict[str, Any], int], Path],
        landed: Callable[[dict[str, Any], Path], str | None],
        spares: Path | None = None,
    ) -> None:
        self._destination = destination
        self._landed = landed
        self._spares = spares
        self._secret = secrets.token_hex(16)
        self._server = socket.create_server((host, 0))
        self._server.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, BUFFER)  # the connections inherit it
        self.address = (host, self._server.getsockname()[1], self._secret)
        threading.Thread(target=self._serve, daemon=True, name="hf_lowzero_piece_receiver").start()

    def close(self) -> None:
        """Stop accepting pieces."""
        with contextlib.suppress(OSError):
            self._server.shutdown(socket.SHUT_RDWR)  # wakes the thread in accept() (close alone does not)
        self._server.close()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._server.accept()
            except OSError:  # closed
                return
            threading.Thread(target=self._receive, args=(conn,), daemon=True).start()

    def _receive(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(TIMEOUT_S)
            try:
                header = _read_header(conn)
            except (OSError, ValueError):
                return  # not a sender of ours, or gone: nothing to answer
            if not hmac.compare_digest(str(header.get("secret", "")), self._secret):
                return
            try:
                error = self._land(conn, header["manifest"], int(header["size"]))
            except (OSError, ValueError, KeyError, TypeError) as e:
                error = f"the buddy node could not take the piece: {e}"
            with contextlib.suppress(OSError):
                _write_header(conn, {"error": error})

    def _land(self, conn: socket.socket, manifest: dict[str, Any], size: int) -> str | None:
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
                os.ftruncate(fd, size)
                with mmap.mmap(fd, size) as buffer:
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


def send_piece(address: tuple[str, int, str], manifest_json: str, path: str | Path) -> str | None:
    """Send the piece in file ``path`` to the ``PieceReceiver`` at ``address`` ([Note: piece
    transfer]). Returns None when it landed there, else what went wrong.

    Raises:
        OSError: The receiver cannot be reached (its node or holder is gone).
    """
    host, port, secret = address
    with open(path, "rb") as f, socket.create_connection((host, port), timeout=TIMEOUT_S) as conn:
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, BUFFER)
        size = os.fstat(f.fileno()).st_size
        _write_header(conn, {"secret": secret, "manifest": json.loads(manifest_json), "size": size})
        refused = _reply(conn).get("error")  # whether to send the bytes
        if refused is not None:
            return refused
        conn.sendfile(f)
        return _reply(conn).get("error")  # whether they landed


def _reply(conn: socket.socket) -> dict[str, Any]:
    try:
        return _read_header(conn)
    except ValueError as e:
        raise OSError(f"the buddy node's holder did not answer ({e})") from e


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

"""The snapshot data plane: pieces and requests on standing connections, hf_lowzero/snapshot/transfer.py."""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path

import pytest
import torch

from hf_lowzero.snapshot.checks import payload_error, piece_file_error
from hf_lowzero.snapshot.format import write_piece
from hf_lowzero.snapshot.frame import Frame
from hf_lowzero.snapshot.gate import HELLO_TIMEOUT_S, hello
from hf_lowzero.snapshot.transfer import LENGTH, Endpoint, Link, ask_all


def send_piece(address, frame_json: str, path: Path) -> str | None:
    """One piece on a link of its own."""
    link = Link(address)
    try:
        return link.send_piece(json.loads(frame_json), path)
    finally:
        link.close()


def _piece(folder: Path, step: int = 7, rank: int = 1) -> tuple[str, Path]:
    """A piece in a file, and its frame as the JSON a holder sends (``Frame.wire``)."""
    g = torch.Generator().manual_seed(step)
    shard = {"w.exp_avg": torch.randn(3000, generator=g), "w.master": torch.randn(3000, generator=g)}
    extras = {"step": torch.tensor([step], dtype=torch.int64)}
    path = folder / f"step{step}-rank{rank}.piece"
    manifest = write_piece(shard, extras, path, step=step, rank=rank, world_size=2, details={})
    return json.dumps(manifest.frame.wire()), path


class Buddy:
    """A receiver the way a holder sets one up: pieces go into its folder, checked as they land."""

    def __init__(self, folder: Path) -> None:
        self.folder, self.kept = folder, []
        folder.mkdir()
        self.requests = []  # (op, the thread of the connection it came on)
        self.receiver = Endpoint("127.0.0.1", {"echo": self.echo, "fail": self.fail}, self.destination, self.landed)

    def echo(self, request):
        self.requests.append((request["op"], threading.get_ident()))
        return {"error": None, "got": request["value"]}

    def fail(self, request):
        raise RuntimeError("a handler that fails")

    def destination(self, wire, size):
        if size > 1 << 24:
            raise ValueError(f"a piece of {size} bytes is too large")
        frame = Frame.from_wire(wire)
        return self.folder / f"copy-step{frame.step}-rank{frame.rank}.piece"

    def landed(self, wire, path):
        error = piece_file_error(Frame.from_wire(wire), path)
        if error is None:
            self.kept.append(path)
        return error


@pytest.fixture
def buddy(tmp_path):
    b = Buddy(tmp_path / "buddy")
    yield b
    b.receiver.close()


def test_a_piece_lands_byte_for_byte_and_checks_out(tmp_path, buddy):
    manifest_json, path = _piece(tmp_path)
    assert send_piece(buddy.receiver.address, manifest_json, path) is None
    (copy,) = buddy.kept
    assert copy.read_bytes() == path.read_bytes()
    assert payload_error(Frame.from_wire(json.loads(manifest_json)), copy.read_bytes(), checksums=True) is None
    assert sorted(p.name for p in buddy.folder.iterdir()) == [copy.name]  # no .part left


def test_a_pieces_follow_up_is_answered_only_once_the_piece_landed(tmp_path, buddy):
    # A holder's copy carries the buddy's mark ([Note: one request per snapshot] in holder.py): the
    # follow-up runs after the piece is whole and checked, its answer (or failure) is the send's,
    # and a piece that did not land runs none.
    manifest_json, path = _piece(tmp_path)
    manifest = json.loads(manifest_json)
    link = Link(buddy.receiver.address)
    try:
        assert link.send_piece(manifest, path, then={"op": "echo", "value": 3}) is None
        assert [op for op, _ in buddy.requests] == ["echo"] and len(buddy.kept) == 1
        assert "a handler that fails" in link.send_piece(manifest, path, then={"op": "fail"})
        assert "another piece" in link.send_piece(manifest, path, then={"op": "piece", "manifest": manifest})
        wrong = {**manifest, "parts": {**manifest["parts"], "shard": [0, 9]}}  # lands, then fails its check
        assert link.send_piece(wrong, path, then={"op": "echo", "value": 4}) is not None
        assert [op for op, _ in buddy.requests] == ["echo"]  # the follow-up of a piece that did not land never ran
        assert link.send_piece(manifest, path) is None  # the connection is still in step
    finally:
        link.close()


def test_two_senders_at_once_each_land_their_own(tmp_path, buddy):
    from concurrent.futures import ThreadPoolExecutor

    pieces = [_piece(tmp_path, step=3, rank=r) for r in range(4)]
    with ThreadPoolExecutor(4) as pool:
        errors = list(pool.map(lambda p: send_piece(buddy.receiver.address, *p), pieces))
    assert errors == [None] * 4
    for rank, (_, path) in enumerate(pieces):
        assert (buddy.folder / f"copy-step3-rank{rank}.piece").read_bytes() == path.read_bytes()


def test_a_piece_its_manifest_does_not_describe_is_refused_and_not_kept(tmp_path, buddy):
    manifest_json, path = _piece(tmp_path)
    manifest = json.loads(manifest_json)
    manifest["parts"]["details"][1] += 8  # says the piece is longer than the file
    error = send_piece(buddy.receiver.address, json.dumps(manifest), path)
    assert error is not None and "bytes" in error
    assert buddy.kept == [] and list(buddy.folder.iterdir()) == []


def test_the_receivers_refusal_is_the_senders_answer(tmp_path, buddy):
    manifest_json, path = _piece(tmp_path)
    with open(path, "ab") as f:
        f.truncate(1 << 25)  # larger than destination() accepts
    error = send_piece(buddy.receiver.address, manifest_json, path)
    assert "too large" in error
    assert list(buddy.folder.iterdir()) == []


def test_a_sender_without_the_secret_writes_nothing(tmp_path, buddy):
    manifest_json, path = _piece(tmp_path)
    host, port, _ = buddy.receiver.address
    with pytest.raises(OSError):
        send_piece((host, port, "not-the-secret"), manifest_json, path)
    assert list(buddy.folder.iterdir()) == []


def test_a_sender_that_dies_midway_leaves_no_piece(tmp_path, buddy):
    manifest_json, path = _piece(tmp_path, step=7)
    host, port, secret = buddy.receiver.address
    data = path.read_bytes()
    header = json.dumps({"op": "piece", "manifest": json.loads(manifest_json), "size": len(data)}).encode()
    with socket.create_connection((host, port)) as conn:
        conn.sendall(hello(secret) + LENGTH.pack(len(header)) + header + data[: len(data) // 2])
    assert send_piece(buddy.receiver.address, *_piece(tmp_path, step=8)) is None  # it still takes the next one
    deadline = time.monotonic() + 10
    while len(list(buddy.folder.iterdir())) > 1 and time.monotonic() < deadline:
        time.sleep(0.01)  # the torn one's thread removes its .part once it sees the connection end
    assert [p.name for p in buddy.folder.iterdir()] == ["copy-step8-rank1.piece"]
    assert [p.name for p in buddy.kept] == ["copy-step8-rank1.piece"]


def test_one_link_carries_pieces_and_requests_in_turn_on_one_connection(tmp_path, buddy):
    # [Note: one request per snapshot]: a rank's snapshots and a holder's marks reuse a connection.
    link = Link(buddy.receiver.address)
    try:
        for step in (3, 4):
            manifest_json, path = _piece(tmp_path, step=step)
            assert link.send_piece(json.loads(manifest_json), path) is None
            assert link.request({"op": "echo", "value": step}) == {"error": None, "got": step}
        failed = link.request({"op": "fail"})
        assert "a handler that fails" in failed["error"]  # answered, and the connection stays in step
        assert (
            link.request({"op": "nothing-of-ours"})["error"]
            == "this holder does not know the request 'nothing-of-ours'"
        )
        assert link.request({"op": "echo", "value": 5})["got"] == 5
    finally:
        link.close()
    assert [p.name for p in buddy.kept] == ["copy-step3-rank1.piece", "copy-step4-rank1.piece"]
    assert len({thread for _, thread in buddy.requests}) == 1  # one connection served all of them


def test_a_broken_link_says_so_and_a_new_one_works(tmp_path, buddy):
    link = Link(buddy.receiver.address)
    link._conn.shutdown(socket.SHUT_RDWR)  # the connection breaks (the holder's node is gone, say)
    with pytest.raises(OSError):
        link.request({"op": "echo", "value": 1})
    assert link.broken
    with pytest.raises(OSError, match="broke earlier"):
        link.request({"op": "echo", "value": 1})
    again = Link(buddy.receiver.address)
    assert again.request({"op": "echo", "value": 2})["got"] == 2
    again.close()


def test_ask_all_answers_each_link_and_names_the_one_that_broke(tmp_path):
    buddies = [Buddy(tmp_path / f"b{i}") for i in range(3)]
    links = [Link(b.receiver.address) for b in buddies]
    try:
        answers = ask_all(links, {"op": "echo", "value": 7})
        assert answers == [{"error": None, "got": 7}] * 3
        links[1]._conn.shutdown(socket.SHUT_RDWR)
        answers = ask_all(links, {"op": "echo", "value": 8})
        assert answers[0] == answers[2] == {"error": None, "got": 8}
        assert isinstance(answers[1], OSError) and links[1].broken and not links[0].broken
    finally:
        for link, b in zip(links, buddies):
            link.close()
            b.receiver.close()


def test_posted_requests_are_answered_in_order_when_their_answers_are_read(tmp_path):
    # [Note: posted requests]: nothing waits at the post; each answer is read later, in the order
    # of the posts, and one not yet come reads as None without waiting.
    gate, never = threading.Event(), threading.Event()

    def slow_echo(request):
        if request["value"] == 2:
            gate.wait(10)
        if request["value"] == 6:
            never.wait(10)
        return {"error": None, "got": request["value"]}

    receiver = Endpoint("127.0.0.1", {"echo": slow_echo})
    link = Link(receiver.address)
    try:
        for value in (1, 2, 3):
            link.post({"op": "echo", "value": value})
        assert link.posted == 3
        assert link.answer(wait=True) == {"error": None, "got": 1}
        assert link.answer(wait=False) is None  # 2 waits for the gate, and 3 comes after it
        with pytest.raises(ValueError, match="posted requests' answers are still to be read"):
            link.request({"op": "echo", "value": 4})  # its answer would be the one of 2
        gate.set()
        assert [link.answer(wait=True) for _ in range(2)] == [{"error": None, "got": 2}, {"error": None, "got": 3}]
        assert link.posted == 0
        with pytest.raises(ValueError, match="no posted request"):
            link.answer()
        assert link.request({"op": "echo", "value": 5}) == {"error": None, "got": 5}  # in step again
        link.post({"op": "echo", "value": 6})
        link._conn.shutdown(socket.SHUT_RDWR)  # broken before its answer came
        with pytest.raises(OSError):
            link.answer(wait=True)
        assert link.broken
    finally:
        gate.set()
        never.set()
        link.close()
        receiver.close()


def test_a_closed_receiver_is_an_os_error_for_the_sender(tmp_path, buddy):
    manifest_json, path = _piece(tmp_path)
    buddy.receiver.close()
    with pytest.raises(OSError):
        send_piece(buddy.receiver.address, manifest_json, path)


def test_spare_files_are_written_over_and_give_the_same_bytes(tmp_path):
    # [Note: spare files]: a piece written over a spare of its size (old bytes in it) is byte for
    # byte the piece written into a new file; a spare of another size is left alone.
    from hf_lowzero.snapshot import segments

    fresh_json, fresh = _piece(tmp_path, step=5)
    folder = tmp_path / "node"
    folder.mkdir()
    size = fresh.stat().st_size
    (folder / "old").write_bytes(b"\xab" * size)
    (folder / "other").write_bytes(b"\xab" * (size + 1))
    segments.recycle(folder / "old", keep_at_most=4)
    segments.recycle(folder / "other", keep_at_most=4)
    assert sorted(p.name.split("-")[1] for p in folder.iterdir()) == sorted([str(size), str(size + 1)])

    g = torch.Generator().manual_seed(5)
    shard = {"w.exp_avg": torch.randn(3000, generator=g), "w.master": torch.randn(3000, generator=g)}
    extras = {"step": torch.tensor([5], dtype=torch.int64)}
    again = folder / "again.piece"
    manifest = write_piece(shard, extras, again, step=5, rank=1, world_size=2, details={}, spares=folder)
    assert json.dumps(manifest.frame.wire()) == fresh_json and again.read_bytes() == fresh.read_bytes()
    assert [p.name.split("-")[1] for p in folder.glob("spare-*")] == [str(size + 1)]  # the other size stays


def test_spares_are_limited_per_size_and_sizes_no_piece_has_are_dropped(tmp_path):
    # [Note: spare files]: rank 0's piece grows with the trainer state's log. The spares of its old
    # size must neither use up the room of the sizes still written nor stay once no piece has it.
    from hf_lowzero.snapshot import segments

    for name, size in [("old-rank0", 811), ("old-rank0-again", 811), ("rank1", 794), ("rank1-again", 794)]:
        (tmp_path / name).write_bytes(b"\xab" * size)
    segments.recycle(tmp_path / "old-rank0", keep_at_most=1)
    segments.recycle(tmp_path / "old-rank0-again", keep_at_most=1)  # one spare of 811 is enough: removed
    segments.recycle(tmp_path / "rank1", keep_at_most=1)  # the 811 spare leaves room for a 794 one
    assert not (tmp_path / "old-rank0-again").exists() and not (tmp_path / "rank1").exists()
    assert sorted(p.name.split("-")[1] for p in tmp_path.glob("spare-*")) == ["794", "811"]
    segments.drop_spares(tmp_path, {794, 843})  # the pieces held now: no 811 any more
    assert [p.name.split("-")[1] for p in tmp_path.glob("spare-*")] == ["794"]
    assert (tmp_path / "rank1-again").stat().st_size == 794  # not a spare: left alone


def test_the_receiver_writes_over_a_spare_of_the_pieces_size(tmp_path):
    manifest_json, path = _piece(tmp_path)
    folder = tmp_path / "buddy"
    folder.mkdir()
    (folder / f"spare-{path.stat().st_size}-x").write_bytes(b"\xcd" * path.stat().st_size)
    kept = []
    receiver = Endpoint("127.0.0.1", None, lambda m, size: folder / "copy.piece",
                        lambda m, p: kept.append(p) or piece_file_error(Frame.from_wire(m), p),
                        spares=folder)  # fmt: skip
    try:
        assert send_piece(receiver.address, manifest_json, path) is None
    finally:
        receiver.close()
    assert sorted(p.name for p in folder.iterdir()) == ["copy.piece"]  # the spare became the copy
    assert (folder / "copy.piece").read_bytes() == path.read_bytes()


def test_a_node_keeps_no_more_spares_than_it_is_told():
    import tempfile

    from hf_lowzero.snapshot import segments

    with tempfile.TemporaryDirectory() as d:
        for i in range(5):
            Path(d, f"p{i}").write_bytes(b"x" * 10)
            segments.recycle(Path(d, f"p{i}"), keep_at_most=2)
        assert len(list(Path(d).iterdir())) == 2


def closed_by_the_endpoint(conn: socket.socket) -> bool:
    """The endpoint closed ``conn`` (waits for it, up to the socket's timeout)."""
    try:
        return conn.recv(1) == b""
    except ConnectionResetError:  # closed with bytes it never read
        return True


def test_half_open_connections_get_no_thread_and_the_port_keeps_serving(tmp_path, buddy):
    # [Note: hello] in gate.py: 200 half-open hellos had made 200 threads, each allowed 16 MiB of
    # header and 120 s before its secret was checked.
    host, port, secret = buddy.receiver.address
    standing = Link(buddy.receiver.address)  # opened before the flood
    assert standing.request({"op": "echo", "value": 0})["got"] == 0  # its thread serves it now
    threads = threading.active_count()
    sent = [b"", hello(secret)[:10], LENGTH.pack(1 << 24), hello("0" * 32)[:-1]]  # nothing, part of a hello,
    flood = []  # a header's 16 MiB length, all of a wrong hello but its last byte
    try:
        for i in range(300):
            flood.append(socket.create_connection((host, port), timeout=10))
            flood[-1].sendall(sent[i % len(sent)])
        manifest_json, path = _piece(tmp_path, step=5)
        assert send_piece(buddy.receiver.address, manifest_json, path) is None  # a new link, through the flood
        assert threading.active_count() <= threads + 1  # + that link's, ending: the flood got none
        assert standing.request({"op": "echo", "value": 1}) == {"error": None, "got": 1}
        assert [p.read_bytes() for p in buddy.kept] == [path.read_bytes()]
        assert [op for op, _ in buddy.requests] == ["echo", "echo"]  # no byte of the flood was taken for a request
        assert all(closed_by_the_endpoint(conn) for conn in flood)  # each within HELLO_TIMEOUT_S, or evicted
    finally:
        standing.close()
        for conn in flood:
            conn.close()


def test_a_wrong_hello_is_closed_at_once_and_nothing_after_it_is_read(buddy):
    host, port, secret = buddy.receiver.address
    old_style = json.dumps({"secret": secret}).encode()  # a frame: length and JSON, as hellos were
    for first in [hello("f" * 32), LENGTH.pack(len(old_style)) + old_style + b" " * 64]:
        with socket.create_connection((host, port), timeout=HELLO_TIMEOUT_S / 2) as conn:  # at once, not timed out
            conn.sendall(first + LENGTH.pack(2) + b"{}")
            assert closed_by_the_endpoint(conn)
    assert buddy.requests == [] and list(buddy.folder.iterdir()) == []

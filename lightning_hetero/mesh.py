"""Messages between the processes of one host over Unix sockets: the steps' reports
(``results.ReportExchange``).

Every step, every rank tells every other what it logged and found: a few hundred bytes each way.
Over gloo, such a message passes through a thread of gloo's in the sending and in the receiving
process, and where the processes keep their cores busy (the CPU workers compute on all of theirs,
emulated stages share two) that thread waits for a core before it moves the bytes. Between two
processes that computed 3 ms between exchanges on two cores, a pairwise exchange of 1 KiB took
1.9-3.2 ms on average over gloo (pinned to a core each or not), and 0.07-0.08 ms over a Unix
socket, where the kernel copies the bytes and wakes the receiver itself. In a step of two emulated
stages, the exchange went from 2.2 ms to 0.26 ms.

The same sockets sum coarse mode's gradients between the ranks that hold them (``all_reduce_sum``):
two processes that computed between sums on two cores summed 1 MiB in 0.85 ms this way against
3.9 ms for gloo's ``all_reduce``, 4 MiB in 3.0 against 5.3 ms, 16 MiB in 10.6 against 15.9 ms.
From ``SHARED_FROM`` bytes on, the parts do not travel through the sockets: each member puts its
tensor in memory it shares with the others (a ``memfd`` each, mapped by every member), and the
sockets carry a byte to say when the parts, then the sums, are in place, then read.

``LocalMesh.connect`` joins every pair of a group's processes with a Unix stream socket (in
Linux's abstract namespace: nothing on disk to clean up), where all of them run on this host; a
group that spans hosts, or a platform without them, keeps to gloo (``None``). The strategy makes
one over every rank with its process groups; the steps' reports and the strategy's object collectives
(``gather``, ``broadcast``: the rebalancer's every few steps, Lightning's own) use it. Messages are frames:
a kind, a length, then the bytes, in the order they were sent; a sender never waits for its
receiver to read, unless the socket's buffer is full. A peer that ends closes its sockets, so a
rank waiting for it fails at once, naming it; a peer that neither sends nor ends fails the wait
after the group's timeout, as a gloo collective would.
"""

from __future__ import annotations

import os
import pickle
import secrets
import select
import socket
import struct
import sys
import threading
import time
from collections.abc import Iterable, Sequence
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["LocalMesh", "NOT_ANSWERED", "note_not_answered", "REPORTS", "POSTS", "OBJECTS", "SUMS", "SHARED_FROM", "sum_over"]

REPORTS, POSTS, OBJECTS, SUMS = 1, 2, 3, 4
"""The kinds of frames: the steps' reports both ways, those sent one way, any other objects, and
the parts of a sum (``all_reduce_sum``)."""

_HEAD = struct.Struct("<IQ")
"""A frame's kind and the length of its bytes."""

_READ = 1 << 16
"""Bytes asked of a socket at a time (a frame's rest, where more are due)."""

SHARED_FROM = 1 << 18
"""Bytes from which ``all_reduce_sum`` sums in shared memory (three rounds of a byte) rather than
sending the parts through the sockets (two rounds of the parts)."""

_TOKEN = 16
"""Bytes at the end of a shared segment that name it, so that a member knows it mapped its peer's."""


NOT_ANSWERED = (
    "a process that hangs, one far behind the others, or one that waits in a call the others did not make"
    " (`trainer.save_checkpoint` under `if trainer.is_global_zero:`, where every rank must call it, as with DDP)."
)
"""What keeps a rank from answering the others within the timeout, for their errors."""


def note_not_answered(error: BaseException, what: str) -> None:
    """Where ``error`` is gloo's timeout ("Timed out waiting 3000ms for recv operation to complete"),
    note ``what`` did not happen within it, and what keeps a rank from answering (``NOT_ANSWERED``)."""
    if "timed out" in str(error).lower():
        error.add_note(f"[hetero] {what} within the timeout: {NOT_ANSWERED}")


class LocalMesh:
    """A Unix stream socket between this process and every other of a group, all on this host.

    Peers are named by their rank in the group. Not thread-safe: one thread at a time uses a mesh.
    That is the thread that runs the steps, except while it is lent (``lend``): fine mode lends it
    to the thread that sums the buckets from the first gradient of a backward until its last sum
    is done (``sync._Overlap``), and another thread's use then is an error."""

    def __init__(self, sockets: dict[int, socket.socket], rank: int, global_ranks: Sequence[int], timeout: timedelta) -> None:
        self.rank, self.size = rank, len(global_ranks)
        self._sockets = sockets
        self._others = [r for r in range(self.size) if r != rank]
        self._global = list(global_ranks)
        self._timeout = timeout.total_seconds()
        self._inbox = {peer: bytearray() for peer in sockets}
        self._shared: dict[tuple[int, ...], Optional[_Shared]] = {}
        self._peer_of = {s.fileno(): peer for peer, s in sockets.items()}
        self._lent_to: Optional[threading.Thread] = None
        for s in sockets.values():
            s.setblocking(False)

    @classmethod
    def connect(cls, group: Optional[dist.ProcessGroup], timeout: timedelta) -> Optional["LocalMesh"]:
        """Collective over ``group`` (the default group where ``None``): the mesh, or ``None`` on every
        rank where its processes do not all run on this host (or cannot reach each other's sockets)."""
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        listener, name = None, None
        if sys.platform == "linux":
            try:
                listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                name = f"\0lightning-hetero-{os.getpid()}-{secrets.token_hex(8)}"
                listener.bind(name)
                listener.listen(size)
            except OSError:  # a sandbox without Unix sockets: gloo, on every rank alike
                listener, name = None, None
        found: list = [None] * size
        dist.all_gather_object(found, (_host(), name, os.getpid()), group=group)
        if any(n is None for _, n, _ in found) or len({host for host, _, _ in found}) > 1:
            if listener is not None:
                listener.close()
            return None
        sockets: dict[int, socket.socket] = {}
        reached = True
        for peer in range(rank):  # each connects to those before it, and tells them who it is
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                s.settimeout(timeout.total_seconds())
                s.connect(found[peer][1])
                s.sendall(rank.to_bytes(8, "little"))
            except OSError:
                s.close()
                reached = False
                break
            sockets[peer] = s
        everyone: list = [None] * size
        dist.all_gather_object(everyone, reached, group=group)
        assert listener is not None
        try:
            if not all(everyone):
                for s in sockets.values():
                    s.close()
                return None
            listener.settimeout(timeout.total_seconds())
            for _ in range(size - 1 - rank):  # and accepts those after it
                s, _ = listener.accept()
                s.settimeout(timeout.total_seconds())
                peer = int.from_bytes(_read_exactly(s, 8), "little")
                pid = struct.unpack("3i", s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))[0]
                # (pid 0: a process of another pid namespace, which cannot be told apart)
                if not rank < peer < size or peer in sockets or pid not in (found[peer][2], 0):
                    s.close()
                    raise ConnectionError(
                        f"[hetero] A process (pid {pid}) that is not global rank {peer} of this run connected to"
                        " the run's sockets while its processes were connecting."
                    )
                sockets[peer] = s
        finally:
            listener.close()
        global_ranks = dist.get_process_group_ranks(group) if group is not None else list(range(size))
        return cls(sockets, rank, global_ranks, timeout)

    def lend(self, thread: Optional[threading.Thread]) -> None:
        """Let ``thread`` alone use the mesh until it is lent again (``None``: any thread, one at a time)."""
        self._lent_to = thread

    def _check_thread(self) -> None:
        lent = self._lent_to
        if lent is not None and lent.ident != threading.get_ident():
            raise RuntimeError(
                f"[hetero] Thread {threading.current_thread().name!r} sent or received over the run's sockets while they"
                f" were lent to {lent.name!r}, the thread that sums fine mode's buckets from the backward's first"
                " gradient to its last sum (a bug: please report it, with the run's layout)."
            )

    def close(self) -> None:
        for s in self._sockets.values():
            s.close()
        self._sockets.clear()
        for shared in self._shared.values():
            if shared is not None:
                shared.close()
        self._shared.clear()

    def all_gather_object(self, obj: Any, members: Optional[Sequence[int]] = None, kind: int = OBJECTS) -> list[Any]:
        """Every member's ``obj`` (picklable; ``members``: ranks, this one among them, every rank by
        default), in the members' order: copies, this rank's too."""
        members = range(self.size) if members is None else members
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        frames = self.exchange(kind, data, [m for m in members if m != self.rank])
        return self._objects(data, frames, members)

    def gather_object(self, obj: Any, dst: int) -> Optional[list[Any]]:
        """Every rank's ``obj``, by rank, on rank ``dst``; ``None`` on the others."""
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        if self.rank != dst:
            self.send(OBJECTS, data, [dst])
            return None
        return self._objects(data, self._transfer(OBJECTS, b"", [], self._others), range(self.size))

    def _objects(self, mine: bytes, frames: dict[int, bytes], members: Iterable[int]) -> list[Any]:
        return [pickle.loads(mine if m == self.rank else frames[m]) for m in members]

    def broadcast_object(self, obj: Any, src: int) -> Any:
        """Rank ``src``'s ``obj`` on every rank (itself on ``src``, a copy elsewhere)."""
        if self.rank == src:
            self.send(OBJECTS, pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), self._others)
            return obj
        return pickle.loads(self.receive(OBJECTS, src))

    def ranks_of(self, group: Optional[dist.ProcessGroup]) -> Optional[list[int]]:
        """The mesh's ranks of ``group``'s processes (all of this mesh's where ``None``), in the group's
        order; ``None`` where one of them is not in the mesh."""
        if group is None:
            return list(range(self.size))
        ranks = dist.get_process_group_ranks(group)
        if not set(ranks) <= set(self._global):
            return None
        return [self._global.index(r) for r in ranks]

    def all_reduce_sum(self, tensor: Tensor, members: Sequence[int]) -> None:
        """Sum a contiguous CPU ``tensor`` over ``members`` (ranks, this one among them), in place, as
        gloo's ``all_reduce`` does, and alike on every member to the last bit. The members cut it into
        as many parts: each member receives its part from every other, sums it in the members' order,
        and sends the sum back to every other (a reduce-scatter, then an all-gather: each sends and
        receives ``(n - 1) / n`` of the tensor twice), the bytes straight between the sockets and the
        tensor's memory; from ``SHARED_FROM`` bytes on, through memory the members share instead
        (``_sum_shared``)."""
        assert tensor.device.type == "cpu" and tensor.is_contiguous(), "a contiguous CPU tensor"
        self._check_thread()
        flat = tensor.view(-1)
        members = list(members)
        count = len(members)
        if count < 2:
            return
        me = members.index(self.rank)
        cuts = [flat.numel() * i // count for i in range(count + 1)]
        part = [flat[cuts[i] : cuts[i + 1]] for i in range(count)]
        peers = [m for m in members if m != self.rank]
        nbytes = flat.numel() * flat.element_size()
        if nbytes >= SHARED_FROM:
            shared = self._shared_for(members, nbytes)
            if shared is not None:
                self._sum_shared(flat, members, part, shared)
                return
        received = {m: torch.empty_like(part[me]) for m in peers}
        self._swap(
            {m: _bytes_of(part[members.index(m)]) for m in peers},
            {m: _bytes_of(received[m]) for m in peers},
        )
        mine = part[me]
        ordered = [mine if m == self.rank else received[m] for m in members]
        total = ordered[0]
        for term in ordered[1:]:
            total.add_(term)
        if total is not mine:
            mine.copy_(total)
        self._swap({m: _bytes_of(mine) for m in peers}, {m: _bytes_of(part[members.index(m)]) for m in peers})

    def _sum_shared(self, flat: Tensor, members: list[int], part: list[Tensor], shared: "_Shared") -> None:
        """``all_reduce_sum`` in shared memory: every member copies its tensor into its segment; once
        all have, each sums its part over every segment, in the members' order, into its tensor and
        its segment; once all have, each copies the others' sums from their segments; once all have,
        the segments may be written again."""
        peers = [m for m in members if m != self.rank]
        nbytes = flat.numel() * flat.element_size()
        segment = {m: shared.segments[m][:nbytes].view(flat.dtype) for m in members}
        segment[self.rank].copy_(flat)
        self._round(peers, nbytes)
        me = members.index(self.rank)
        start = sum(p.numel() for p in part[:me])
        mine = part[me]
        terms = [segment[m][start : start + mine.numel()] for m in members]
        torch.add(terms[0], terms[1], out=mine)
        for term in terms[2:]:
            mine.add_(term)
        segment[self.rank][start : start + mine.numel()].copy_(mine)
        self._round(peers, nbytes)
        offset = 0
        for m, p in zip(members, part):
            if m != self.rank:
                p.copy_(segment[m][offset : offset + p.numel()])
            offset += p.numel()
        self._round(peers, nbytes)

    def _round(self, peers: list[int], nbytes: int) -> None:
        """A frame to and from every peer of a sum in shared memory, naming its size."""
        mark = nbytes.to_bytes(8, "little")
        for peer, got in self.exchange(SUMS, mark, peers).items():
            if got != mark:
                raise self._out_of_step(peer, f"a round of a sum of {int.from_bytes(got[:8], 'little')} bytes", f"one of {nbytes}")

    def _shared_for(self, members: list[int], nbytes: int) -> Optional["_Shared"]:
        """The members' segments, of ``nbytes`` at least: one per member and set of members, made at
        the first sum over them and made anew, larger, at the first sum that outgrows them (each a
        collective of the members, who all make the same sums); ``None`` on every member where one
        cannot share memory with the others (no ``memfd``, or no access to the others' ``/proc``: then
        the sockets carry the parts, for good)."""
        key = tuple(members)
        if key in self._shared:
            shared = self._shared[key]
            if shared is None or shared.nbytes >= nbytes:
                return shared
            shared.close()  # after the last sum's last round: nobody reads them any more
        peers = [m for m in members if m != self.rank]
        mine: Optional[_Segment] = None
        peers_segments: dict[int, Tensor] = {}
        try:
            try:
                mine = _Segment(nbytes)
                offer: Optional[tuple[int, int, bytes]] = (os.getpid(), mine.fd, mine.token)
            except (OSError, AttributeError):  # AttributeError: a platform without os.memfd_create
                offer = None
            offers = {m: pickle.loads(f) for m, f in self.exchange(SUMS, pickle.dumps(offer), peers).items()}
            ok = offer is not None and all(o is not None for o in offers.values())
            if ok:
                try:
                    peers_segments = {m: _map_peer(*offers[m], nbytes) for m in peers}
                except OSError:
                    ok = False
            agreed = self.exchange(SUMS, b"1" if ok else b"0", peers)
        except BaseException:
            if mine is not None:
                mine.close()
            raise
        shared: Optional[_Shared] = None
        if ok and all(v == b"1" for v in agreed.values()):
            assert mine is not None
            shared = _Shared(mine, peers_segments, self.rank, nbytes)
        elif mine is not None:
            mine.close()
        self._shared[key] = shared
        return shared

    def _swap(self, sends: dict[int, memoryview], receives: dict[int, memoryview]) -> None:
        """Send a frame of kind ``SUMS`` to each peer of ``sends`` and read one from each of
        ``receives`` straight into its buffer (of the frame's length exactly), both at once."""
        pending = {peer: [memoryview(_HEAD.pack(SUMS, len(data))), data] for peer, data in sends.items()}
        filled = dict.fromkeys(receives, -1)  # -1: its frame's head is still to come
        deadline = time.monotonic() + self._timeout
        while True:
            for peer in list(pending):
                pieces = pending[peer]
                while pieces:
                    sent = self._send_some(peer, pieces[0])
                    if sent < len(pieces[0]):
                        pieces[0] = pieces[0][sent:]
                        break
                    pieces.pop(0)
                if not pieces:
                    del pending[peer]
            for peer in list(filled):
                if self._fill(peer, receives[peer], filled):
                    del filled[peer]
            if not pending and not filled:
                return
            poller = select.poll()  # only for what is still due: a peer done here may already send what comes next
            for peer in set(pending) | set(filled):
                mask = (select.POLLIN if peer in filled else 0) | (select.POLLOUT if peer in pending else 0)
                poller.register(self._sockets[peer], mask)
            left = deadline - time.monotonic()
            events = poller.poll(max(0, int(left * 1000)) + 1) if left > 0 else []
            if not events:
                waiting = sorted(set(pending) | set(filled))
                raise self._timed_out(waiting)
            for fd, event in events:
                peer = self._peer_of[fd]
                if event & select.POLLNVAL:
                    raise self._gone(peer)
                if event & (select.POLLHUP | select.POLLERR) and not event & select.POLLIN:  # (only peers due something are polled)
                    raise self._gone(peer)

    def _fill(self, peer: int, into: memoryview, filled: dict[int, int]) -> bool:
        """Read what ``peer`` has sent of its next frame (of kind ``SUMS``, as long as ``into``)
        into ``into``: first what its inbox holds, then straight from the socket. True once whole."""
        inbox = self._inbox[peer]
        if filled[peer] < 0:
            while len(inbox) < _HEAD.size:
                before = len(inbox)
                if not self._read(peer, _HEAD.size - len(inbox)):
                    raise self._gone(peer)
                if len(inbox) == before:  # nothing there yet
                    return False
            kind, length = _HEAD.unpack_from(inbox)
            if kind != SUMS or length != len(into):
                raise self._out_of_step(peer, f"a message of kind {kind} and {length} bytes", f"a part of a sum of {len(into)} bytes")
            taken = min(length, len(inbox) - _HEAD.size)
            into[:taken] = inbox[_HEAD.size : _HEAD.size + taken]
            del inbox[: _HEAD.size + taken]
            filled[peer] = taken
        while filled[peer] < len(into):
            try:
                got = self._sockets[peer].recv_into(into[filled[peer] :])
            except BlockingIOError:
                return False
            except ConnectionResetError:
                got = 0
            if got == 0:
                raise self._gone(peer)
            filled[peer] += got
        return True

    def exchange(self, kind: int, data: bytes, peers: Iterable[int]) -> dict[int, bytes]:
        """Send ``data`` to every one of ``peers`` and receive a frame of ``kind`` from each."""
        peers = list(peers)
        return self._transfer(kind, data, peers, peers)

    def send(self, kind: int, data: bytes, peers: Iterable[int]) -> None:
        """Send ``data`` to every one of ``peers``, without waiting for them to read it."""
        self._transfer(kind, data, list(peers), [])

    def receive(self, kind: int, peer: int) -> bytes:
        """The next frame from ``peer``, which must be of ``kind``."""
        return self._transfer(kind, b"", [], [peer])[peer]

    def _transfer(self, kind: int, data: bytes, to: list[int], want: list[int]) -> dict[int, bytes]:
        self._check_thread()
        frame = memoryview(_HEAD.pack(kind, len(data)) + data) if to else memoryview(b"")
        sending = {}
        for peer in to:
            sent = self._send_some(peer, frame)
            if sent < len(frame):
                sending[peer] = frame[sent:]
        got = {peer: f for peer in want if (f := self._frame(kind, peer)) is not None}
        if len(sending) + len(want) - len(got) == 0:
            return got
        poller = select.poll()
        involved = set(sending) | set(want)
        for peer in involved:
            poller.register(self._sockets[peer], select.POLLIN | (select.POLLOUT if peer in sending else 0))
        deadline = time.monotonic() + self._timeout
        while sending or len(got) < len(want):
            left = deadline - time.monotonic()
            events = poller.poll(max(0, int(left * 1000)) + 1) if left > 0 else []
            if not events:
                waiting = sorted(set(sending) | (set(want) - set(got)))
                raise self._timed_out(waiting)
            for fd, event in events:
                peer = self._peer_of[fd]
                if event & select.POLLOUT and peer in sending:
                    rest = sending[peer]
                    sent = self._send_some(peer, rest)
                    if sent == len(rest):
                        del sending[peer]
                        poller.modify(self._sockets[peer], select.POLLIN)
                    else:
                        sending[peer] = rest[sent:]
                if event & select.POLLNVAL:
                    raise self._gone(peer)
                if event & (select.POLLIN | select.POLLHUP | select.POLLERR):
                    # Into the inbox, even from a peer whose frame is not due (it may be sending to us).
                    is_open = self._read(peer)
                    if peer in want and peer not in got and (f := self._frame(kind, peer)) is not None:
                        got[peer] = f
                    if not is_open:  # which matters only where more is to go to it, or come from it
                        if peer in sending or (peer in want and peer not in got):
                            raise self._gone(peer)
                        poller.unregister(self._sockets[peer])
        return got

    def _send_some(self, peer: int, data: memoryview) -> int:
        try:
            return self._sockets[peer].send(data, socket.MSG_NOSIGNAL)
        except BlockingIOError:
            return 0
        except (BrokenPipeError, ConnectionResetError) as error:
            raise self._gone(peer) from error

    def _read(self, peer: int, wanted: int = _READ) -> bool:
        """What ``peer`` sent so far (up to ``wanted`` bytes), into its inbox; ``False`` once it has
        closed its end."""
        try:
            chunk = self._sockets[peer].recv(wanted)
        except BlockingIOError:
            return True
        except ConnectionResetError:
            return False
        self._inbox[peer] += chunk
        return bool(chunk)

    def _frame(self, kind: int, peer: int) -> Optional[bytes]:
        """The next whole frame from ``peer`` in its inbox, or ``None`` while it is still arriving."""
        inbox = self._inbox[peer]
        if len(inbox) < _HEAD.size:
            return None
        found, length = _HEAD.unpack_from(inbox)
        if len(inbox) < _HEAD.size + length:
            return None
        if found != kind:
            raise self._out_of_step(peer, f"a message of kind {found}", f"one of kind {kind}")
        data = bytes(inbox[_HEAD.size : _HEAD.size + length])
        del inbox[: _HEAD.size + length]
        return data

    def _timed_out(self, waiting: Iterable[int]) -> TimeoutError:
        return TimeoutError(
            f"[hetero] Waited {self._timeout:g} s (the strategy's `timeout`) for a message to travel to or from global"
            f" rank(s) {', '.join(str(self._global[p]) for p in waiting)}, which neither answered nor ended: {NOT_ANSWERED}"
        )

    def _out_of_step(self, peer: int, sent: str, due: str) -> RuntimeError:
        return RuntimeError(
            f"[hetero] Global rank {self._global[peer]} sent {sent} where {due} was due: the ranks' steps are out of"
            " step. Where code of yours decides on some ranks only what every rank must do (`trainer.should_stop ="
            " True` in a callback on one rank: decide it from every rank's view, with"
            " `trainer.strategy.reduce_boolean_decision(...)` as EarlyStopping does; `trainer.save_checkpoint` under"
            " `if trainer.is_global_zero:`, where every rank must call it, as with DDP), that is the cause; otherwise it"
            " is a bug: please report it, with the run's layout."
        )

    def _gone(self, peer: int) -> ConnectionError:
        return ConnectionError(
            f"[hetero] Connection closed by peer: global rank {self._global[peer]} closed its connection to this"
            " process; it ended, or failed (its own error says why)."
        )


class _Segment:
    """This member's memory for sums over one set of members: a ``memfd`` that the others map
    through ``/proc``, named by a random token at its end. Its mappings (torch's, of the file) last
    as long as a tensor views them."""

    def __init__(self, nbytes: int) -> None:
        self.fd = os.memfd_create("lightning-hetero-sums", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, nbytes + _TOKEN)
            self.bytes = _mapped(f"/proc/self/fd/{self.fd}", nbytes + _TOKEN)
        except OSError:
            os.close(self.fd)
            raise
        self.token = secrets.token_bytes(_TOKEN)
        self.bytes[nbytes:] = torch.frombuffer(bytearray(self.token), dtype=torch.uint8)

    def close(self) -> None:
        os.close(self.fd)
        self.bytes = torch.empty(0, dtype=torch.uint8)


def _mapped(path: str, nbytes: int) -> Tensor:
    """The file at ``path`` mapped shared, as bytes; an ``OSError`` where it cannot be."""
    try:
        return torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
    except RuntimeError as error:
        raise OSError(str(error)) from error


def _map_peer(pid: int, fd: int, token: bytes, nbytes: int) -> Tensor:
    """A peer's segment, mapped here; an ``OSError`` where it cannot be, or where what ``/proc`` gives
    is not that segment (a process of another pid namespace)."""
    path = f"/proc/{pid}/fd/{fd}"
    if os.stat(path).st_size != nbytes + _TOKEN:
        raise OSError("not the peer's segment")
    mapped = _mapped(path, nbytes + _TOKEN)
    if mapped[nbytes:].numpy().tobytes() != token:
        raise OSError("not the peer's segment")
    return mapped


class _Shared:
    """Every member's segment of ``nbytes`` (and a token), as bytes."""

    def __init__(self, mine: _Segment, peers: dict[int, Tensor], rank: int, nbytes: int) -> None:
        self._mine, self.nbytes = mine, nbytes
        self.segments = {rank: mine.bytes, **peers}

    def close(self) -> None:
        """This process's hold on them: each mapping goes with the last tensor that views it."""
        self.segments.clear()
        self._mine.close()


def sum_over(tensor: Tensor, group: Optional[dist.ProcessGroup], mesh: Optional[LocalMesh]) -> None:
    """Sum a CPU ``tensor`` over ``group`` in place: over ``mesh`` where it joins the group's processes
    (``LocalMesh.all_reduce_sum``), else over gloo."""
    members = mesh.ranks_of(group) if mesh is not None else None
    if mesh is not None and members is not None:
        mesh.all_reduce_sum(tensor, members)
    else:
        dist.all_reduce(tensor, group=group)


def _bytes_of(tensor: Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, writable, shared with it."""
    return memoryview(tensor.view(torch.uint8).numpy()) if tensor.numel() else memoryview(bytearray())


def _host() -> str:
    return socket.gethostname()


def _read_exactly(s: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = s.recv(n - len(data))
        if not chunk:
            raise ConnectionError("[hetero] A process closed its connection while the run's processes were connecting.")
        data += chunk
    return data

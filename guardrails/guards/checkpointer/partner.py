"""Each rank's published copy (``peer.py``) sent to a rank on another node at every step
boundary; the copy of the rank that sends to this one kept here. A node lost whole (its
ranks and their memory: a dead host, a kernel panic, a pulled cable) leaves each of its
ranks' part on the next node, where the failure save writes it like a same-host copy.

* **Who**: when the launcher says how many ranks share a node (``LOCAL_WORLD_SIZE``:
  torchrun, and most launchers, whose node ranks are consecutive) and there are several
  nodes, rank ``r`` sends to ``r + L`` and keeps ``r - L``'s (modulo the world): one
  link each way, O(1) per rank at any N. One address a rank in the store at start, one
  read of its partner's at its first boundary.
* **How**: a TCP connection of its own, not a process group: no collective, nothing on
  the training group, no group that the user's code would count. Per boundary the main
  thread only wakes the sender (an ``Event``); the sender thread copies the 64 KB mapped
  copy (a copy torn by the next boundary's write is dropped: that boundary sends
  its own) and sends it, with the boundary before when it fell behind (at most two: the
  copy holds the last two boundaries). The receiver writes what comes into its
  :class:`~peer.Mirror` (``/dev/shm``).
* **Where it helps**: the failure save's committer writes the copies its own host holds;
  a partner whose kept rank is gone writes that rank's part itself, before its own part
  counts as filed (``from_peers.py``), so a lost node's parts are whole wherever the next
  node is. Two nodes lost together, a node and the one after it, lose the first's parts.
* **What it cannot hold**: the state a rank's copy cannot (``peer.py``); a boundary whose
  copy was not sent yet when the node died (the sender runs within a millisecond of the
  boundary; the step's forward takes longer): the mirror then holds the boundary before,
  which the failure save refuses as another step's.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import threading
from typing import TYPE_CHECKING, Any

from guardrails.checkpoint.common import log
from guardrails.distributed.dist import local_world_size
from guardrails.guards.checkpointer.peer import SLOT_BYTES, Mirror, PeerSlot

if TYPE_CHECKING:
    from pathlib import Path

#: A frame's length, before the frame; a link opens with the sender's token and rank.
_LENGTH = struct.Struct("<I")
_HELLO = struct.Struct("<32sq")
#: The boundaries at which the partner's address is looked for: it sets it at its start,
#: before the first step's collective, so it is there at the first one unless the
#: partner could not open a socket (then its copy is never sent; nor is this one).
_ADDRESS_READS = 10
#: How long a connection's first bytes or a connect may take (a partner not listening
#: yet, a stranger connecting that says nothing).
_CONNECT_S = 10.0


def partner_ranks(rank: int, world: int, local_world: int) -> tuple[int, int] | None:
    """``(the rank this one sends to, the rank it keeps the copy of)``, on other nodes,
    or ``None``: one node, or nodes of unequal sizes (ranks not laid out by node)."""
    if not 0 < local_world < world or world % local_world:
        return None
    return (rank + local_world) % world, (rank - local_world) % world


def _address() -> str:
    """This host's address on the route to the job's store (``MASTER_ADDR``): where the
    partner, which reaches the store, reaches this rank. No packet is sent."""
    master = os.environ.get("MASTER_ADDR", "")
    if master:
        with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((master, 9))
            return s.getsockname()[0]
    return socket.gethostbyname(socket.gethostname())


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = conn.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("closed")  # an OSError
        buf += chunk
    return bytes(buf)


class PartnerLink:
    """This rank's link to its partners (see the module docstring). Built at start with
    the checkpoint's side store (its address published), :meth:`sent` at every boundary
    after the slot's publish, :meth:`close` at the end."""

    def __init__(
        self,
        store: Any,
        slot: PeerSlot,
        directory: Path,
        token: str,
        rank: int,
        partners: tuple[int, int],
    ) -> None:
        self._store, self._slot, self._token, self._rank = store, slot, token, rank
        self.to, self.keeps = partners
        self.mirror = Mirror(directory, token, self.keeps)
        self._peer_addr: tuple[str, int] | None = None
        self._reads_left = _ADDRESS_READS
        self._wake = threading.Event()
        self._closed = False
        self._socks: list[socket.socket] = []
        #: Snapshots sent, and kept from the partner (the tests read them).
        self.frames_sent = 0
        self.frames_kept = 0
        host = _address()
        self._listener = socket.create_server((host, 0))
        self._listener.settimeout(1.0)  # close() is seen within a second
        self._socks.append(self._listener)
        store.set(self._key(rank), f"{host}:{self._listener.getsockname()[1]}")
        self._threads = [
            threading.Thread(target=self._receive, name="guardrails-partner-in", daemon=True),
            threading.Thread(target=self._send, name="guardrails-partner-out", daemon=True),
        ]
        self._threads[0].start()

    def _key(self, rank: int) -> str:
        return f"{self._token}/partner/{rank}"

    def sent(self) -> None:
        """At a boundary, after :meth:`PeerSlot.publish`: the sender sends it. The first
        boundaries read the partner's address (set at its start; a partner not started
        yet is read again at the next boundary)."""
        if self._peer_addr is None:
            if self._closed or self._reads_left <= 0:
                return
            self._reads_left -= 1
            if not self._store.check([self._key(self.to)]):
                return
            host, _, port = self._store.get(self._key(self.to)).decode().rpartition(":")
            self._peer_addr = (host, int(port))
            self._threads[1].start()
        self._wake.set()

    # ------------------------------------------------------------------ the threads

    def _send(self) -> None:
        assert self._peer_addr is not None
        try:
            conn = socket.create_connection(self._peer_addr, timeout=_CONNECT_S)
            self._socks.append(conn)
            conn.settimeout(None)  # a slow partner slows this thread only
            conn.sendall(_HELLO.pack(self._token.encode(), self._rank))
            last = 0  # the boundary count of the last half sent
            while True:
                self._wake.wait()
                self._wake.clear()
                if self._closed:
                    conn.sendall(_LENGTH.pack(0))  # goodbye: this rank is not dead
                    return
                halves = self._slot.snapshot()
                # The newest always (the copy after an update is rewritten by its
                # boundary under the same count), and one it skipped when it fell behind.
                for count, data in halves:
                    if count > last or count == halves[-1][0]:
                        conn.sendall(_LENGTH.pack(len(data)) + data)
                        self.frames_sent += 1
                last = max([last] + [count for count, _ in halves])
        except OSError as e:  # the partner is gone: its copy of this rank stops here
            if not self._closed:
                log.debug("guardrails: rank %d's copy no longer goes to rank %d: %s",
                          self._rank, self.to, e)  # fmt: skip

    def _receive(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # closed
            self._socks.append(conn)
            try:
                conn.settimeout(_CONNECT_S)
                token, rank = _HELLO.unpack(_recv_exact(conn, _HELLO.size))
                if token.rstrip(b"\0").decode(errors="replace") != self._token or (
                    rank != self.keeps
                ):
                    conn.close()  # not the partner: a stranger, or another job's
                    continue
                conn.settimeout(None)
                while True:
                    (n,) = _LENGTH.unpack(_recv_exact(conn, _LENGTH.size))
                    if n == 0:
                        return  # its goodbye
                    if n > SLOT_BYTES:
                        raise ValueError(f"a frame of {n} bytes")
                    self.mirror.write(_recv_exact(conn, n))
                    self.frames_kept += 1
            except (OSError, ValueError, struct.error) as e:
                # The partner died (the mirror keeps its last copy: the point), or this
                # rank closes.
                if not self._closed:
                    if self.frames_kept:
                        self.mirror.gone()
                    log.debug("guardrails: rank %d's copy stopped coming: %s", self.keeps, e)
                return

    def close(self, *, keep: bool = False) -> None:
        """Both threads end; the mirror is removed unless ``keep`` (a failure save that
        committed nothing here: a later committer on this host may write from it)."""
        self._closed = True
        self._wake.set()
        sender = self._threads[1]
        if sender.is_alive():  # it says goodbye first
            sender.join(timeout=2.0)
        for sock in self._socks:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                sock.close()
        for thread in self._threads:
            if thread.is_alive():
                thread.join(timeout=2.0)
        self.mirror.close(keep=keep)


def link(guard: Any, slot: PeerSlot | None, token: str) -> PartnerLink | None:
    """This rank's link when its copy is published (``slot``) and the job spans several
    nodes; ``None`` otherwise (or when no socket could be opened: said in the log)."""
    store = guard.side_store("checkpoint")
    local_world = local_world_size(guard.world_size)
    partners = partner_ranks(guard.rank, guard.world_size, local_world)
    if slot is None or store is None or partners is None:
        return None
    try:
        return PartnerLink(store, slot, slot.path.parent, token, guard.rank, partners)
    except OSError as e:
        log.warning("guardrails: rank %d's copy is not sent to another node: %s", guard.rank, e)
        return None

"""The process-events socket: subscribe, filter to the bound workers, read what is queued.

The parsing is proc_events.py's; this module only moves bytes. The socket is
non-blocking and read at the caller's pace (the reconcile pass): the kernel
queues the events in between, so an idle daemon wakes no more often than it
did without them.

When the connector cannot be had, ``ProcEventSocket.open`` raises
``DiscoveryError`` with one of ``UNAVAILABLE`` as its code:

* ``unsupported``: no such socket family or protocol (a kernel without
  ``CONFIG_PROC_EVENTS``, or one that never heard of the connector);
* ``permission``: the kernel answered the subscription with EPERM (it wants
  CAP_NET_ADMIN), or a seccomp or address-family rule refused the socket;
* ``namespace``: the connector lives in the initial network namespace only;
  from another one the subscription is refused (ECONNREFUSED);
* ``no_ack``: no answer to the subscription (the kernel ignores requests from
  a pid or user namespace other than the initial ones; some kernels, 6.18 for
  one, answer EPERM from a user namespace instead: ``permission``);
* ``error``: anything else, with the errno in the message.

Reading: ``read`` returns every datagram queued, up to ``limit`` (a worker
that spawns threads faster than one pass can read must not keep the pass
reading forever), and whether events were lost: ENOBUFS (the queue outgrew the
receive buffer and the kernel dropped events), or the limit reached.

After an overflow the kernel marks the socket congested and drops every event
for it, silently (ENOBUFS is reported once), until a read finds the queue
empty. Whatever was read before that is no proof that nothing more was lost:
``drained`` says whether the last ``read`` emptied the queue.
"""

from __future__ import annotations

import array
import errno
import os
import select
import socket
import struct
import time

from ...errors import DiscoveryError
from ..parse.proc_events import (CN_IDX_PROC, IGNORE, LISTEN, NETLINK_CONNECTOR, ack_error, listen_message, parse_events,
                          socket_filter)

__all__ = ["ProcEventSocket", "UNAVAILABLE", "BUFFER_BYTES", "READ_LIMIT"]

UNAVAILABLE = ("unsupported", "permission", "namespace", "no_ack", "error")

# The receive queue between two reads. A queued event costs the kernel about
# 1 KiB (socket buffer plus data), so 4 MiB hold some 4,000 events of the bound
# workers per pass; root may set it above net.core.rmem_max.
BUFFER_BYTES = 4 << 20
READ_LIMIT = 8192
DATAGRAM = 1024  # one event is 76 bytes

SO_ATTACH_FILTER, SO_DETACH_FILTER = 26, 27
SO_RCVBUFFORCE = getattr(socket, "SO_RCVBUFFORCE", 33)


class ProcEventSocket:
    """A subscribed process-events socket (``open``); ``close`` unsubscribes."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.filtered = False  # whether the kernel drops other processes' events
        self.drained = True  # whether the last read emptied the queue (and so ended any congestion)

    @classmethod
    def open(cls, *, timeout: float = 0.5, buffer_bytes: int = BUFFER_BYTES,
             program: bytes | None = None) -> ProcEventSocket:
        """Subscribe; ``program`` (a classic BPF filter) replaces the per-worker filter
        for a listener that wants other events (the host isolation level: process starts)."""
        try:
            sock = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC,
                                 NETLINK_CONNECTOR)
        except OSError as exc:
            code = "permission" if exc.errno in (errno.EPERM, errno.EACCES) else \
                "unsupported" if exc.errno in (errno.EAFNOSUPPORT, errno.EPROTONOSUPPORT, errno.EINVAL) else "error"
            raise DiscoveryError(f"process events: no connector socket ({exc.strerror})", code=code) from None
        src = cls(sock)
        try:
            src._subscribe(timeout, buffer_bytes, program)
        except BaseException:
            sock.close()
            raise
        return src

    def _subscribe(self, timeout: float, buffer_bytes: int, program: bytes | None = None) -> None:
        sock = self.sock
        try:
            sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, buffer_bytes)
        except OSError:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buffer_bytes)  # capped at rmem_max
        if program is None:
            self.set_filter(())  # nothing of the host's churn is queued, not even before the first pass
        elif not self._attach(program):
            raise DiscoveryError("process events: the kernel refused the socket filter", code="error")
        ack = struct.unpack("=I", os.urandom(4))[0]  # acks go to every listener: ours is ours by this
        try:
            sock.bind((0, CN_IDX_PROC))
            sock.send(listen_message(LISTEN, ack))
        except OSError as exc:
            if exc.errno == errno.ECONNREFUSED:
                raise DiscoveryError("process events: the connector answers only in the initial network "
                                     "namespace", code="namespace") from None
            code = "permission" if exc.errno in (errno.EPERM, errno.EACCES) else "error"
            raise DiscoveryError(f"process events: subscribing failed ({exc.strerror})", code=code) from None
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([sock], [], [], left)[0]:
                raise DiscoveryError("process events: the kernel did not answer the subscription (the daemon runs "
                                     "outside the initial pid or user namespace)", code="no_ack")
            try:
                data = sock.recv(DATAGRAM)
            except BlockingIOError:
                continue
            except OSError as exc:
                if exc.errno == errno.ENOBUFS:
                    continue
                raise DiscoveryError(f"process events: reading the answer failed ({exc.strerror})",
                                     code="error") from None
            err = ack_error(parse_events(data), ack)
            if err is None:
                continue
            if err == 0:
                return
            raise DiscoveryError(f"process events: the kernel refused the subscription ({os.strerror(err)}; it "
                                 "needs CAP_NET_ADMIN)", code="permission" if err == errno.EPERM else "error")

    def set_filter(self, tgids) -> bool:
        """Keep only the events of ``tgids`` in the kernel (True), or, for more tgids than a
        filter holds or a kernel that refuses it, every event (False: the reader filters)."""
        prog = socket_filter(list(tgids))
        if prog is not None and self._attach(prog):
            return True
        try:
            self.sock.setsockopt(socket.SOL_SOCKET, SO_DETACH_FILTER, 0)
        except OSError:
            pass  # none attached
        self.filtered = False
        return False

    def _attach(self, prog: bytes) -> bool:
        insns = array.array("B", prog)
        addr, _n = insns.buffer_info()  # the kernel copies the program during the call
        try:
            self.sock.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER, struct.pack("HL", len(prog) // 8, addr))
        except OSError:
            return False
        self.filtered = True
        return True

    def read(self, limit: int = READ_LIMIT) -> tuple[list[bytes], bool]:
        """The datagrams queued now (at most ``limit``), and whether events were lost."""
        out: list[bytes] = []
        lost = False
        recv = self.sock.recv
        self.drained = False
        while len(out) < limit:
            try:
                out.append(recv(DATAGRAM))
            except BlockingIOError:
                self.drained = True
                return out, lost
            except OSError as exc:
                if exc.errno != errno.ENOBUFS:
                    raise
                lost = True  # reported once; what is queued after the loss still reads
        return out, True

    def fileno(self) -> int:
        return self.sock.fileno()

    def close(self) -> None:
        """Unsubscribe (while nobody listens the kernel builds no events) and close."""
        try:
            self.sock.send(listen_message(IGNORE, 0))
        except OSError:
            pass
        self.sock.close()

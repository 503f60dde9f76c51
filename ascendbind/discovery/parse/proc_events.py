"""The kernel's process events (the proc connector) as values: bytes in, events out. No I/O.

A process-events socket (netlink ``NETLINK_CONNECTOR``, group ``CN_IDX_PROC``)
receives one datagram per event on the whole host: a netlink header, a
connector header, then a ``struct proc_event`` in host byte order::

    nlmsghdr   len u32, type u16, flags u16, seq u32, pid u32        (16 bytes)
    cn_msg     idx u32, val u32, seq u32, ack u32, len u16, flags u16 (20 bytes)
    proc_event what u32, cpu u32, timestamp_ns u64, then by ``what``:
      FORK     parent_pid, parent_tgid, child_pid, child_tgid
      EXEC     process_pid, process_tgid
      COMM     process_pid, process_tgid, comm[16]
      EXIT     process_pid, process_tgid, exit_code, exit_signal, ...
      NONE     err (the answer to a subscription: 0 or a positive errno)

A thread is a task whose pid (its tid) differs from its tgid: a new thread of
worker W arrives as FORK with child_tgid W, a rename (``prctl(PR_SET_NAME)`` or
a write to ``/proc/<pid>/task/<tid>/comm``) as COMM with its tgid, an exit as
EXIT. ``exec`` in a worker kills its other threads and renames the one left
without a COMM event, so it calls for reading the worker's threads afresh.

An event says which thread to look at, not what that thread is now: FORK is
sent before the child first runs, but EXIT only after the exiting thread's tid
was released, so a tid handed out again (after pids wrapped) could have its new
FORK queued before the old EXIT. Every thread named by an event is therefore
read again (its name through ``/proc/<pid>/task/<tid>``, which fails for a tid
that is no longer the worker's); none is forgotten on an event's word.

``socket_filter`` builds a classic BPF program for the socket that keeps only
the events of the given tgids (and the subscription's answer), so the kernel
drops every other process's events before they are queued: the daemon pays for
its workers' thread churn, not the host's. Classic BPF loads 32-bit words in
network byte order, hence the byte swap of every constant on a little-endian
host.
"""

from __future__ import annotations

import struct
import sys
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field

__all__ = [
    "ProcEvent", "ThreadChanges", "parse_events", "thread_changes", "listen_message", "ack_error",
    "socket_filter", "MAX_FILTER_TGIDS", "CN_IDX_PROC", "NETLINK_CONNECTOR", "LISTEN", "IGNORE",
    "started_processes", "process_start_filter",
]

NETLINK_CONNECTOR = 11
CN_IDX_PROC = 1
CN_VAL_PROC = 1
LISTEN, IGNORE = 1, 2  # enum proc_cn_mcast_op
NLMSG_DONE = 3

NONE, FORK, EXEC, COMM, EXIT = 0x0, 0x1, 0x2, 0x200, 0x80000000
KINDS = {NONE: "ack", FORK: "fork", EXEC: "exec", COMM: "comm", EXIT: "exit"}

_NLMSG = struct.Struct("=IHHII")
_CN = struct.Struct("=IIIIHH")
_WHAT = struct.Struct("=IIQ")
_WORDS2 = struct.Struct("=II")
_WORDS4 = struct.Struct("=IIII")
DATA = _NLMSG.size + _CN.size  # where the proc_event starts (36)
EVENT_DATA = DATA + _WHAT.size  # where its event_data starts (52)
COMM_LEN = 16

# classic BPF: 2 instructions per tgid within the kernel's 4096; more workers
# than that are filtered after reading instead
MAX_FILTER_TGIDS = 1500
_LD_W_ABS, _JEQ_K, _JA, _RET_K = 0x20, 0x15, 0x05, 0x06
_ST, _LDX_MEM, _JEQ_X = 0x02, 0x61, 0x1D
_KEEP, _DROP = 0xFFFFFFFF, 0


@dataclass(frozen=True)
class ProcEvent:
    """One process event: ``kind`` (fork, exec, comm, exit, ack, other), the task it is
    about (``tgid``, ``tid``; for fork the child), ``comm`` for a rename, ``err`` and
    ``ack`` (the connector's ack field) for an ack."""

    kind: str
    tgid: int = 0
    tid: int = 0
    comm: str | None = None
    err: int = 0
    ack: int = 0


@dataclass(frozen=True)
class ThreadChanges:
    """What a batch of events means for the bound workers: per tgid, the threads to look
    at again (born, renamed or exited); the tgids whose threads must all be read afresh
    (exec); how many events each tgid sent (what its event budget is charged); and how
    many messages were not process events at all."""

    look: dict[int, frozenset[int]] = field(default_factory=dict)
    resync: frozenset[int] = frozenset()
    events: int = 0  # events about the bound workers
    malformed: int = 0
    counts: dict[int, int] = field(default_factory=dict)

    def without(self, tgids: Collection[int]) -> ThreadChanges:
        """These changes less those of ``tgids`` (workers whose events are no longer followed)."""
        if not tgids:
            return self
        gone = set(tgids)
        counts = {k: v for k, v in self.counts.items() if k not in gone}
        return ThreadChanges({k: v for k, v in self.look.items() if k not in gone}, self.resync - gone,
                             sum(counts.values()), self.malformed, counts)


def parse_events(data: bytes) -> list[ProcEvent | None]:
    """The process events in one datagram, in order; None for a message that is too
    short or not from the proc connector (counted by the caller, never fatal)."""
    out: list[ProcEvent | None] = []
    off, end = 0, len(data)
    while off + _NLMSG.size <= end:
        nl_len = _NLMSG.unpack_from(data, off)[0]
        if nl_len < _NLMSG.size or off + nl_len > end:
            out.append(None)
            break
        out.append(_event(data, off, nl_len))
        off += (nl_len + 3) & ~3  # NLMSG_ALIGN
    return out


def _event(data: bytes, off: int, nl_len: int) -> ProcEvent | None:
    if nl_len < DATA + _WHAT.size + 4:
        return None
    idx, val, _seq, ack, length, _flags = _CN.unpack_from(data, off + _NLMSG.size)
    if (idx, val) != (CN_IDX_PROC, CN_VAL_PROC) or length < _WHAT.size + 4 or DATA + length > nl_len:
        return None
    what = _WHAT.unpack_from(data, off + DATA)[0]
    at = off + EVENT_DATA
    room = length - _WHAT.size
    kind = KINDS.get(what, "other")
    if kind == "ack":
        return ProcEvent("ack", err=struct.unpack_from("=I", data, at)[0], ack=ack)
    if kind == "fork":
        if room < 16:
            return None
        _ppid, _ptgid, child, child_tgid = _WORDS4.unpack_from(data, at)
        return ProcEvent("fork", tgid=child_tgid, tid=child)
    if room < 8:
        return None
    tid, tgid = _WORDS2.unpack_from(data, at)
    if kind == "comm":
        if room < 8 + COMM_LEN:
            return None
        raw = data[at + 8: at + 8 + COMM_LEN]
        return ProcEvent("comm", tgid=tgid, tid=tid, comm=raw.split(b"\0", 1)[0].decode("utf-8", "replace"))
    return ProcEvent(kind, tgid=tgid, tid=tid)


def thread_changes(events: Iterable[ProcEvent | None], bound: Collection[int]) -> ThreadChanges:
    """Fold ``events`` into what the bound workers' looks must cover. Only events of the
    tgids in ``bound`` count; a fork whose child is a process of its own (tid == tgid) is
    no thread of any worker."""
    look: dict[int, set[int]] = {}
    resync: set[int] = set()
    counts: dict[int, int] = {}
    malformed = 0
    for ev in events:
        if ev is None:
            malformed += 1
            continue
        if ev.tgid not in bound or ev.kind in ("ack", "other"):
            continue
        counts[ev.tgid] = counts.get(ev.tgid, 0) + 1
        if ev.kind == "exec":
            resync.add(ev.tgid)
        elif ev.kind != "fork" or ev.tid != ev.tgid:
            look.setdefault(ev.tgid, set()).add(ev.tid)
    return ThreadChanges({k: frozenset(v) for k, v in look.items()}, frozenset(resync), sum(counts.values()),
                         malformed, counts)


def listen_message(op: int, ack: int) -> bytes:
    """The datagram that subscribes (``LISTEN``) or unsubscribes (``IGNORE``) a socket.
    The kernel answers a subscription with an ack event whose ack field is ``ack + 1``.
    The 4-byte form (no event-type filter) is used: every kernel accepts it, and a
    kernel-side type filter would also swallow the ack."""
    payload = struct.pack("=I", op)
    cn = _CN.pack(CN_IDX_PROC, CN_VAL_PROC, 0, ack & 0xFFFFFFFF, len(payload), 0) + payload
    return _NLMSG.pack(_NLMSG.size + len(cn), NLMSG_DONE, 0, 0, 0) + cn


def ack_error(events: Iterable[ProcEvent | None], ack: int) -> int | None:
    """The errno the kernel answered the subscription sent with ``ack`` (0: subscribed);
    None when no answer to it is among ``events`` (acks to other listeners are not ours)."""
    want = (ack + 1) & 0xFFFFFFFF
    for ev in events:
        if ev is not None and ev.kind == "ack" and ev.ack == want:
            return ev.err
    return None


def _be(value: int) -> int:
    """``value`` as a classic BPF word load reads it from host-order bytes."""
    return int.from_bytes((value & 0xFFFFFFFF).to_bytes(4, sys.byteorder), "big")


def _insn(code: int, jt: int, jf: int, k: int) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)


def socket_filter(tgids: Sequence[int]) -> bytes | None:
    """A classic BPF program (``struct sock_filter`` array) that keeps acks and the fork,
    exec, comm and exit events of ``tgids``, and drops everything else; None when there
    are more tgids than ``MAX_FILTER_TGIDS``."""
    if len(tgids) > MAX_FILTER_TGIDS:
        return None
    prog = [
        _insn(_LD_W_ABS, 0, 0, DATA),  # 0: what
        _insn(_JEQ_K, 0, 1, _be(NONE)),  # 1: an ack ->
        _insn(_RET_K, 0, 0, _KEEP),  # 2:   keep
        _insn(_JEQ_K, 0, 2, _be(FORK)),  # 3: a fork ->
        _insn(_LD_W_ABS, 0, 0, EVENT_DATA + 12),  # 4:   child_tgid
        _insn(_JA, 0, 0, 5),  # 5:   to 11
        _insn(_JEQ_K, 3, 0, _be(COMM)),  # 6: comm, exit, exec -> 10
        _insn(_JEQ_K, 2, 0, _be(EXIT)),  # 7
        _insn(_JEQ_K, 1, 0, _be(EXEC)),  # 8
        _insn(_RET_K, 0, 0, _DROP),  # 9: any other kind
        _insn(_LD_W_ABS, 0, 0, EVENT_DATA + 4),  # 10: process_tgid
    ]
    for tgid in sorted(set(tgids)):  # 11: one test per tgid, each next to its own keep
        prog.append(_insn(_JEQ_K, 0, 1, _be(tgid)))
        prog.append(_insn(_RET_K, 0, 0, _KEEP))
    prog.append(_insn(_RET_K, 0, 0, _DROP))
    return b"".join(prog)


def started_processes(events: Iterable[ProcEvent | None]) -> tuple[list[int], int]:
    """The processes that ``events`` say started (a fork whose child is a process of its
    own) or replaced their image (exec), in order, each once; and how many messages were
    malformed. An exec is news too: its name, and the cgroup a service manager moved
    the child into before it, are only final then."""
    seen: dict[int, None] = {}
    malformed = 0
    for ev in events:
        if ev is None:
            malformed += 1
        elif (ev.kind == "fork" and ev.tid == ev.tgid) or ev.kind == "exec":
            seen[ev.tgid] = None
    return list(seen), malformed


def process_start_filter() -> bytes:
    """A classic BPF program that keeps acks, the forks that start a process (child pid
    equal to child tgid: a new thread inherits the mask of the thread that made it)
    and exec events, and drops the rest of the host's churn (new threads, renames,
    exits) in the kernel. Both words of the fork are compared as loaded (byte order
    does not change equality)."""
    prog = [
        _insn(_LD_W_ABS, 0, 0, DATA),  # 0: what
        _insn(_JEQ_K, 0, 1, _be(NONE)),  # 1: an ack ->
        _insn(_RET_K, 0, 0, _KEEP),  # 2:   keep
        _insn(_JEQ_K, 0, 5, _be(FORK)),  # 3: a fork -> 4, else 9
        _insn(_LD_W_ABS, 0, 0, EVENT_DATA + 8),  # 4:   child_pid
        _insn(_ST, 0, 0, 0),  # 5:   M[0] = child_pid
        _insn(_LDX_MEM, 0, 0, 0),  # 6:   X = M[0]
        _insn(_LD_W_ABS, 0, 0, EVENT_DATA + 12),  # 7:   child_tgid
        _insn(_JEQ_X, 2, 3, 0),  # 8:   a process -> keep (11), a thread -> drop (12)
        _insn(_JEQ_K, 1, 0, _be(EXEC)),  # 9: exec -> keep (11)
        _insn(_RET_K, 0, 0, _DROP),  # 10: any other kind
        _insn(_RET_K, 0, 0, _KEEP),  # 11
        _insn(_RET_K, 0, 0, _DROP),  # 12
    ]
    return b"".join(prog)

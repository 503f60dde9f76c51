"""Who is calling, and may they touch that pid (SPEC §6).

The caller's identity is the kernel's, from ``SO_PEERCRED`` on the connected
Unix socket: pid, uid and gid as of connect(), with the pid translated into the
daemon's pid namespace (which is why a containerised worker binds itself by
omitting ``pid``: the daemon then uses this pid).

Rules: uid 0 may act on any pid. Anyone else only on a process whose real,
effective and saved uids all equal theirs (the kernel's own ptrace-style test,
so a setuid program is out of reach) and which is the caller itself or one of
its descendants (walking ``PPid`` up from the target). Anything else is
NotPermitted, checked before any change is made.
"""

from __future__ import annotations

import os
import socket
import struct
from dataclasses import dataclass

from ..errors import NotPermitted, ProcessGone

__all__ = ["Peer", "peer_of", "authorize", "proc_status"]

_UCRED = struct.Struct("3i")


@dataclass(frozen=True)
class Peer:
    pid: int
    uid: int
    gid: int

    @property
    def is_root(self) -> bool:
        return self.uid == 0


def peer_of(sock: socket.socket) -> Peer:
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    pid, uid, gid = _UCRED.unpack(raw)
    return Peer(pid, uid, gid)


def proc_status(pid: int, proc_root: str = "/proc") -> dict[str, str] | None:
    """``/proc/<pid>/status`` as key -> value text, or None when the process is gone."""
    try:
        with open(os.path.join(proc_root, str(pid), "status"), encoding="utf-8", errors="replace") as fh:
            text = fh.read()
    except OSError:
        return None
    out: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            out[key.strip()] = value.strip()
    return out


def _uids(status: dict[str, str]) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in status.get("Uid", "").split()[:3])
    except ValueError:
        return ()


def authorize(peer: Peer, pid: int, *, proc_root: str = "/proc", max_depth: int = 4096) -> None:
    """Raise NotPermitted / ProcessGone unless ``peer`` may bind or release ``pid``."""
    status = proc_status(pid, proc_root)
    if status is None:
        raise ProcessGone(f"no process {pid}")
    if peer.is_root:
        return
    uids = _uids(status)
    if not uids or any(u != peer.uid for u in uids):
        raise NotPermitted(f"process {pid} does not belong to uid {peer.uid}")
    cur, depth = pid, 0
    while cur > 1 and depth < max_depth:
        if cur == peer.pid:
            return
        st = status if cur == pid else proc_status(cur, proc_root)
        if st is None:
            break
        try:
            cur = int(st.get("PPid", "0"))
        except ValueError:
            break
        depth += 1
    raise NotPermitted(f"process {pid} is neither the caller ({peer.pid}) nor one of its descendants")

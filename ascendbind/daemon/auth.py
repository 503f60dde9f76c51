"""Who is calling, and may they touch that pid.

The caller's identity is the kernel's, from ``SO_PEERCRED`` on the connected
Unix socket: pid, uid and gid as of connect(), with the pid translated into the
daemon's pid namespace (which is why a containerised worker binds itself by
omitting ``pid``: the daemon then uses this pid).

Rules, decided on the target's identity as read once for the request (the
same value discovery and binding later check against, so a pid recycled in
between is a ``pid_recycled`` conflict, never a bind of the newcomer):

* nobody, root included, may bind pid 1 of the daemon's pid namespace, a kernel
  thread or the daemon itself (``not_a_worker``);
* uid 0 may act on any other pid;
* anyone else only on a process whose real, effective and saved uids all equal
  theirs (the kernel's own ptrace-style test, so a setuid program is out of
  reach) and which is the caller itself or one of its descendants (walking
  ``PPid`` up from the target).

Anything else is NotPermitted, checked before any change is made.
"""

from __future__ import annotations

import os
import socket
import struct
from dataclasses import dataclass

from ..applier.identity import refuse_non_worker
from ..errors import NotPermitted
from ..model import ProcessIdentity

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


def authorize(peer: Peer, target: ProcessIdentity, *, daemon_pid: int, proc_root: str = "/proc",
              max_depth: int = 4096, binding: bool = True) -> None:
    """Raise NotPermitted unless ``peer`` may bind (``binding``) or release ``target``.

    ``daemon_pid`` is the daemon's own pid. Releasing skips the ``not_a_worker``
    rule: undoing what an older daemon did to such a process only restores it.
    """
    if binding:
        refuse_non_worker(target, daemon_pid)
    if peer.is_root:
        return
    uids = target.uids[:3]
    if len(uids) < 3 or any(u != peer.uid for u in uids):
        raise NotPermitted(f"process {target.pid} does not belong to uid {peer.uid}")
    cur, ppid, depth = target.pid, target.ppid, 0
    while cur > 1 and depth < max_depth:
        if cur == peer.pid:
            return
        if cur != target.pid:
            st = proc_status(cur, proc_root)
            if st is None:
                break
            try:
                ppid = int(st.get("PPid", "0"))
            except ValueError:
                break
        cur, depth = ppid, depth + 1
    raise NotPermitted(f"process {target.pid} is neither the caller ({peer.pid}) nor one of its descendants")

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

import socket
import struct
from collections.abc import Callable
from dataclasses import dataclass

from ...discovery.gather.identity import refuse_non_worker
from ...discovery.gather.process import parent_of
from ...errors import NotPermitted
from ...values.model import ProcessIdentity

__all__ = ["Peer", "peer_of", "authorize"]

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


def authorize(peer: Peer, target: ProcessIdentity, *, daemon_pid: int, proc_root: str = "/proc",
              max_depth: int = 4096, binding: bool = True,
              parent: Callable[[int], int | None] | None = None) -> None:
    """Raise NotPermitted unless ``peer`` may bind (``binding``) or release ``target``.

    ``daemon_pid`` is the daemon's own pid. Releasing skips the ``not_a_worker``
    rule: undoing what an older daemon did to such a process only restores it.
    ``parent`` gives an ancestor's parent pid (None: gone); by default discovery
    reads it under ``proc_root``. The target's own parent is the one in ``target``.
    """
    if parent is None:
        def parent(pid: int) -> int | None:
            return parent_of(pid, proc_root)

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
            up = parent(cur)
            if up is None:
                break
            ppid = up
        cur, depth = ppid, depth + 1
    raise NotPermitted(f"process {target.pid} is neither the caller ({peer.pid}) nor one of its descendants")

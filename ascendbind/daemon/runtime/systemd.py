"""The two systemd protocols the daemon speaks, with the socket module only.

* ``sd_notify`` (sd_notify(3)): datagrams such as ``READY=1``, ``STATUS=...``,
  ``WATCHDOG=1``, ``STOPPING=1`` to the Unix socket named by ``NOTIFY_SOCKET``
  (a leading ``@`` means the abstract namespace). Without the variable every call
  is a no-op, so ``serve`` runs the same way outside systemd.
* socket activation (sd_listen_fds(3)): when ``LISTEN_PID`` is our pid, the
  listening sockets start at fd 3 and ``LISTEN_FDS`` says how many. The variables
  are removed afterwards so that children (npu-smi) do not believe they were
  activated too.
"""

from __future__ import annotations

import os
import socket

__all__ = ["notify", "listen_fds", "watchdog_interval", "SD_LISTEN_FDS_START"]

SD_LISTEN_FDS_START = 3


def notify(*lines: str) -> bool:
    """Send ``KEY=VALUE`` lines to systemd; True when a manager received them."""
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr or not lines:
        return False
    if addr.startswith("@"):
        addr = "\0" + addr[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.sendto("\n".join(lines).encode(), addr)
    except OSError:
        # systemd gone or the socket not reachable: notifications are best effort
        return False
    return True


def listen_fds(*, unset_environment: bool = True) -> list[int]:
    """The fds systemd passed us (socket activation), or [] when not activated."""
    try:
        pid = int(os.environ.get("LISTEN_PID", ""))
        count = int(os.environ.get("LISTEN_FDS", ""))
    except ValueError:
        return []
    finally:
        if unset_environment:
            for key in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
                os.environ.pop(key, None)
    if pid != os.getpid() or count < 1:
        return []
    fds = list(range(SD_LISTEN_FDS_START, SD_LISTEN_FDS_START + count))
    for fd in fds:
        os.set_inheritable(fd, False)
    return fds


def watchdog_interval() -> float | None:
    """Seconds between WATCHDOG=1 pings (half of WatchdogSec), or None when not asked."""
    try:
        usec = int(os.environ.get("WATCHDOG_USEC", ""))
    except ValueError:
        return None
    wpid = os.environ.get("WATCHDOG_PID")
    if wpid and wpid != str(os.getpid()):
        return None
    return usec / 2e6 if usec > 0 else None

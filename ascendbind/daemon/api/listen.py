"""The listening socket: systemd's (socket activation) or one created here.

A created socket is born mode 0660 (umask set around bind(), so there is no
window in which others could connect), group ``socket_group``. A stale file
left by a crashed daemon is replaced; a live daemon's socket, or a path that is
not a socket at all, is an error rather than something to delete.

The backlog is the host's ``somaxconn`` (systemd's socket gets the same from the
listener, which calls listen() again): a burst of connections waits in the
queue for an answer instead of failing connect() with EAGAIN.
"""

from __future__ import annotations

import grp
import os
import socket
import stat

import structlog

from ...discovery.read.kernel import somaxconn
from ...errors import ConfigError
from ..runtime import systemd

__all__ = ["open_listen_socket"]

log = structlog.get_logger("ascendbind.api")


def _group_id(name: str) -> int:
    try:
        return grp.getgrnam(name).gr_gid
    except KeyError:
        if name.isdigit():
            return int(name)
        raise ConfigError(f"socket_group {name!r} is not a group on this host") from None


def open_listen_socket(path: str, group: str = "", *, backlog: int | None = None) -> tuple[socket.socket, str, bool]:
    """(listening socket, how it was obtained, whether we own the file) — systemd's if activated."""
    fds = systemd.listen_fds()
    if fds:
        sock = socket.socket(fileno=fds[0])
        if sock.family != socket.AF_UNIX or sock.type != socket.SOCK_STREAM:
            raise ConfigError("the socket systemd passed (fd 3) is not a Unix stream socket")
        return sock, "systemd", False
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, mode=0o755, exist_ok=True)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        st = None
    if st is not None:
        if not stat.S_ISSOCK(st.st_mode):
            raise ConfigError(f"socket path {path} exists and is not a socket; not replacing it")
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            probe.settimeout(1)
            try:
                probe.connect(path)
            except OSError:
                os.unlink(path)  # stale: left by a daemon that died
                log.info("removed a stale socket file", path=path)
            else:
                raise ConfigError(f"another daemon is already listening on {path}")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    old = os.umask(0o117)  # the file is born 0660: no window where others can connect
    try:
        sock.bind(path)
    finally:
        os.umask(old)
    os.chmod(path, 0o660)
    if group:
        os.chown(path, -1, _group_id(group))
    sock.listen(backlog or somaxconn())
    return sock, "created", True

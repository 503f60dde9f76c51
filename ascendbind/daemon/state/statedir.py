"""A directory root may keep its state in: one no other user can change.

The daemon runs as root and writes ``state_dir`` after every bind. A directory
that another user can write (mode 777, or owned by that user) lets them plant
names in it: a symlink where root's next temp file or rename goes makes root
overwrite any file on the host. So the directory, and every directory on the
way to it, is checked before anything is written:

* every directory traversed on the way (symlinks resolved one hop at a time, so
  the directories a link leads through are checked as well) must be owned by
  root or by us and writable by nobody else, unless its sticky bit is set
  (``/tmp``: others may add names there but not rename or remove ours);
* a symlink on the way must be owned by root or by us (in a sticky directory
  anybody may create one);
* ``state_dir`` itself must be owned by us and writable by nobody else; sticky
  does not help there, since others could still add names next to ours.

A missing ``state_dir`` (and missing parents) is created, ``state_dir`` itself
mode 0700. Anything else is a ConfigError naming the directory: the daemon
refuses to start rather than write root's state where another user can reach it.
"""

from __future__ import annotations

import os
import stat
from collections import deque

from ...errors import ConfigError

__all__ = ["trusted_state_dir", "untrusted_reason"]

_MAX_LINKS = 40  # the kernel's own limit on symlinks followed in one lookup


def untrusted_reason(path: str, st: os.stat_result, *, final: bool, euid: int | None = None) -> str | None:
    """Why directory ``path`` (lstat ``st``) cannot hold root's state, or None when it can."""
    euid = os.geteuid() if euid is None else euid
    owners = (euid,) if final else (0, euid)
    if st.st_uid not in owners:
        return f"{path} is owned by uid {st.st_uid}"
    mode = stat.S_IMODE(st.st_mode)
    if mode & (stat.S_IWGRP | stat.S_IWOTH) and (final or not mode & stat.S_ISVTX):
        return f"{path} is writable by group or others (mode {mode:o})"
    return None


def _refuse(state_dir: str, why: str) -> ConfigError:
    return ConfigError(
        f"state_dir {state_dir} is not safe for root's state: {why}; "
        "use a directory only root can write (the default /var/lib/ascendbind, mode 0700)",
        code="state_dir_untrusted",
    )


def trusted_state_dir(state_dir: str) -> str:
    """The real path of ``state_dir``, created when missing, after checking every
    directory on the way; ConfigError (``state_dir_untrusted``) when one fails."""
    parts = deque(p for p in os.path.abspath(state_dir).split("/") if p)
    cur, links = "/", 0
    why = untrusted_reason("/", os.lstat("/"), final=False)
    while why is None and parts:
        name = parts.popleft()
        if name == ".":
            continue
        if name == "..":
            cur = os.path.dirname(cur)  # cur holds no symlink, so this is the real parent
            continue
        nxt = os.path.join(cur, name)
        try:
            st = os.lstat(nxt)
        except FileNotFoundError:
            try:
                os.mkdir(nxt, 0o700 if not parts else 0o755)
            except OSError as exc:
                raise ConfigError(f"state_dir {state_dir}: cannot create {nxt}: {exc.strerror}") from None
            st = os.lstat(nxt)
        if stat.S_ISLNK(st.st_mode):
            links += 1
            if st.st_uid not in (0, os.geteuid()):
                why = f"{nxt} is a symlink owned by uid {st.st_uid}"
            elif links > _MAX_LINKS:
                why = f"more than {_MAX_LINKS} symlinks on the way"
            else:
                target = os.readlink(nxt)
                parts.extendleft(reversed([p for p in target.split("/") if p]))
                if target.startswith("/"):
                    cur = "/"
            continue
        if not stat.S_ISDIR(st.st_mode):
            raise ConfigError(f"state_dir {state_dir}: {nxt} is not a directory")
        why = untrusted_reason(nxt, st, final=False)
        cur = nxt
    if why is None:
        why = untrusted_reason(cur, os.lstat(cur), final=True)
    if why is not None:
        raise _refuse(state_dir, why)
    return cur

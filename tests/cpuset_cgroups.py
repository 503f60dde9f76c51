"""A cpuset cgroup of the test's own on whichever hierarchy this machine has.

    why = why_not()                       # None, or why no cpuset cgroup can be made here
    with cpuset_tree(["kubepods", "pod<uid>", "<id>"], "3") as leaf:
        move(leaf, pid)                   # every thread of ``pid`` moves with it
        set_cpus(leaf, "2")               # what kubelet does on a resize: the kernel moves the tasks
    EFFECTIVE                             # the file the kernel keeps the leaf's CPUs in

* cgroup v1: under the ``cpuset`` hierarchy (``/sys/fs/cgroup/cpuset``); each new
  level gets ``cpuset.mems`` and ``cpuset.cpus`` (a v1 cpuset starts empty and takes no task
  before it has both); its CPUs are in ``cpuset.effective_cpus``.
* cgroup v2: under the unified hierarchy (``/sys/fs/cgroup``); the cpuset controller is
  enabled in each parent's ``cgroup.subtree_control`` (the root's too, taken back afterwards
  if it was not enabled there before), ``cpuset.cpus`` is written at the leaf only (a v2
  cpuset with none runs on its parent's); its CPUs are in ``cpuset.cpus.effective``.

The tree is ``ascendbind-test-<pid>/<levels...>`` at the hierarchy's top (or, ``at_root``, the
levels themselves there, as the kubelet makes ``kubepods``), removed leaf first whatever
happens (its processes must have exited by then).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
from collections.abc import Iterator, Sequence

from tests.builders import write_once

__all__ = ["VERSION", "ROOT", "EFFECTIVE", "why_not", "cpuset_tree", "kubepods_lock", "move", "set_cpus", "effective"]

_V1 = "/sys/fs/cgroup/cpuset"
_V2 = "/sys/fs/cgroup"


def _detect() -> tuple[str | None, str | None]:
    if os.path.exists(os.path.join(_V1, "cpuset.cpus")):
        return "v1", _V1
    try:
        with open(os.path.join(_V2, "cgroup.controllers")) as fh:
            controllers = fh.read().split()
    except OSError:
        return None, None
    return ("v2", _V2) if "cpuset" in controllers else (None, None)


VERSION, ROOT = _detect()
EFFECTIVE = {"v1": "cpuset.effective_cpus", "v2": "cpuset.cpus.effective"}.get(VERSION or "")


def why_not() -> str | None:
    """None when a cpuset cgroup can be made here, else why not."""
    if VERSION is None:
        return f"no cpuset controller: neither a cgroup v1 cpuset hierarchy at {_V1} nor cgroup v2's at {_V2}"
    if not os.access(os.path.join(ROOT, "cgroup.procs"), os.W_OK):
        return f"the cgroup {VERSION} cpuset hierarchy at {ROOT} is not writable here"
    return None


def move(cgroup: str, pid: int) -> None:
    """Move process ``pid`` (all its threads) into ``cgroup``."""
    write_once(os.path.join(cgroup, "cgroup.procs"), str(pid))


def set_cpus(cgroup: str, cpus: str) -> None:
    """Give ``cgroup`` the CPUs ``cpus`` (a cpulist); the kernel narrows its tasks to them."""
    write_once(os.path.join(cgroup, "cpuset.cpus"), cpus)


def effective(cgroup: str) -> str:
    """The CPUs the kernel keeps ``cgroup``'s tasks on, as it prints them."""
    with open(os.path.join(cgroup, EFFECTIVE)) as fh:
        return fh.read().strip()


def _enabled(cgroup: str) -> bool:
    with open(os.path.join(cgroup, "cgroup.subtree_control")) as fh:
        return "cpuset" in fh.read().split()


@contextlib.contextmanager
def kubepods_lock() -> Iterator[None]:
    """Held while a test makes the kubelet's tree at the top of a hierarchy (``kubepods/...``),
    where every run of every checkout on this machine would share it: one at a time."""
    with open(os.path.join(tempfile.gettempdir(), "ascendbind-test-kubepods.lock"), "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        yield


@contextlib.contextmanager
def cpuset_tree(levels: Sequence[str], cpus: str, *, parents: str | None = None,
                at_root: bool = False) -> Iterator[str]:
    """``ascendbind-test-<pid>/<levels...>`` limited to ``cpus``; yields the leaf's path.
    ``parents``: the CPUs of the levels above the leaf on v1 (default ``cpus``), so that the
    leaf can later be given others of them (``set_cpus``); v2 parents set none.
    ``at_root``: the levels start at the hierarchy's top, where only root (the kubelet) makes
    cgroups, under kubepods_lock; a level that exists there already is used as found."""
    why = why_not()
    if why is not None:
        raise RuntimeError(why)
    with kubepods_lock() if at_root else contextlib.nullcontext():
        yield from _tree(levels, cpus, at_root, parents)


def _tree(levels: Sequence[str], cpus: str, at_root: bool, parents: str | None) -> Iterator[str]:
    top = ROOT if at_root else os.path.join(ROOT, f"ascendbind-test-{os.getpid()}")
    paths = [] if at_root else [top]
    for name in levels:
        paths.append(os.path.join(paths[-1] if paths else top, name))
    made: list[str] = []
    root_enabled_here = False
    try:
        if VERSION == "v1":
            with open(os.path.join(ROOT, "cpuset.mems")) as fh:
                mems = fh.read().strip()
            for path in paths:
                if at_root and os.path.isdir(path):
                    continue
                os.mkdir(path)
                made.append(path)
                write_once(os.path.join(path, "cpuset.mems"), mems)
                write_once(os.path.join(path, "cpuset.cpus"), cpus if path == paths[-1] or parents is None else parents)
        else:
            if not _enabled(ROOT):
                write_once(os.path.join(ROOT, "cgroup.subtree_control"), "+cpuset")
                root_enabled_here = True
            for path in paths:
                if at_root and os.path.isdir(path):
                    continue
                os.mkdir(path)
                made.append(path)
                if path != paths[-1]:  # a parent: no process of its own, its children get the controller
                    write_once(os.path.join(path, "cgroup.subtree_control"), "+cpuset")
            write_once(os.path.join(paths[-1], "cpuset.cpus"), cpus)
        yield paths[-1]
    finally:
        for path in reversed(made):
            os.rmdir(path)
        if root_enabled_here:
            with contextlib.suppress(OSError):  # another user of the controller keeps it enabled
                write_once(os.path.join(ROOT, "cgroup.subtree_control"), "-cpuset")

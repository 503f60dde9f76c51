"""Split one NPU's pool into roles: IRQ, main, ACL, release.

The rule, for a pool sorted ascending:

    irq = pool[0:2]   main = pool[2:-2]   acl = [pool[-2]]   release = [pool[-1]]

needs 5 CPUs (two SQ/CQ IRQs, at least one main CPU, one ACL, one release).
Without IRQ reservation ``irq = []`` and ``main = pool[:-2]`` (minimum 3).
Ascend 950 binds the whole cluster to ``main`` and nothing else.

``small_pool = "share"`` lowers the minimum to 1 for pools below the normal
minimum: roles then share CPUs (``irq = [pool[0]]``, ``main = pool[:-1]``,
``acl = release = [pool[-1]]``; a 1-CPU pool is every role). ``irq`` stays
empty whenever IRQ binding is off.

With ``cpu_bind_policy = full-pcpus`` the same shape is cut in whole cores:
the IRQ CPUs are the first core(s) up to two CPUs, ACL and release the last
core(s) up to two CPUs (on SMT-2, the last core's two siblings), and main the
cores between, so no physical core is shared by two roles.

Thread classes with a share (config ``thread_classes``) are carved from each
NPU's main afterwards (``class_cpus``; the rounding rule is threadclass.py's):
main keeps all its CPUs, the classes only say where their own threads go.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ...values.config import Config
from ...values.threadclass import ThreadClass, carve
from .layout import Layout, cl as _cl

__all__ = ["Roles", "RoleSplitError", "role_minimum", "split_roles", "class_cpus"]


@dataclass(frozen=True)
class Roles:
    irq: tuple[int, ...]
    main: tuple[int, ...]
    acl: tuple[int, ...]
    release: tuple[int, ...]


class RoleSplitError(Exception):
    """The pool cannot hold the role split; the message is the operator's sentence."""


def role_minimum(config: Config, *, ascend950: bool = False) -> int:
    """Smallest pool the role split accepts (also global_slice's size check)."""
    if ascend950:
        return 1
    if config.small_pool == "share":
        return 1
    return 5 if config.irq_binding else 3


def class_cpus(main: Sequence[int], classes: Sequence[ThreadClass]) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """(name, CPUs) of every share class, carved from ``main`` in config order."""
    return tuple((c.name, carve(main, c.share)) for c in classes if c.share is not None)


def _default_minimum(config: Config) -> int:
    return 5 if config.irq_binding else 3


def split_roles(pool: Sequence[int], config: Config, layout: Layout | None = None, *,
                ascend950: bool = False) -> Roles:
    pool = tuple(pool)
    n = len(pool)
    if ascend950:
        if not n:
            raise RoleSplitError("the cluster is empty")
        return Roles(irq=(), main=pool, acl=(), release=())
    need = _default_minimum(config)
    if n >= need:
        if layout is not None and layout.full_pcpus:
            roles = _split_whole_cores(pool, config, layout)
            if roles is not None:
                return roles
            if config.small_pool != "share":
                raise RoleSplitError(
                    f"the {n}-CPU pool {_cl(pool)} cannot keep IRQ, main and ACL/release on separate "
                    f"physical cores (cpu_bind_policy = full-pcpus)")
            return _share(pool, config)
        irq = pool[0:2] if config.irq_binding else ()
        return Roles(irq=irq, main=pool[len(irq):-2], acl=(pool[-2],), release=(pool[-1],))
    if config.small_pool == "share" and n >= 1:
        return _share(pool, config)
    why = "2 IRQ + 1 main + 1 ACL + 1 release" if config.irq_binding else "1 main + 1 ACL + 1 release"
    raise RoleSplitError(
        f"the pool {_cl(pool)} has {n} CPU{'s' if n != 1 else ''}, below the role minimum of {need} "
        f"({why}); set small_pool = \"share\" to let roles share CPUs")


def _share(pool: tuple[int, ...], config: Config) -> Roles:
    if len(pool) == 1:
        return Roles(irq=pool if config.irq_binding else (), main=pool, acl=pool, release=pool)
    return Roles(
        irq=(pool[0],) if config.irq_binding else (),
        main=pool[:-1],
        acl=(pool[-1],),
        release=(pool[-1],),
    )


def _split_whole_cores(pool: tuple[int, ...], config: Config, layout: Layout) -> Roles | None:
    units = layout.units(pool)
    head_n = 0
    head: list[int] = []
    if config.irq_binding:
        while head_n < len(units) and len(head) < 2:
            head.extend(units[head_n])
            head_n += 1
    tail_n = 0
    tail: list[int] = []
    while tail_n < len(units) - head_n and len(tail) < 2:
        tail[:0] = units[len(units) - 1 - tail_n]
        tail_n += 1
    middle = units[head_n:len(units) - tail_n]
    if len(tail) < 2 or not middle or (config.irq_binding and len(head) < 2):
        return None
    tail_sorted = sorted(tail)
    return Roles(
        irq=tuple(sorted(head)),
        main=tuple(sorted(c for u in middle for c in u)),
        # release takes the last CPU; ACL the rest of the last core(s)
        acl=tuple(tail_sorted[:-1]),
        release=(tail_sorted[-1],),
    )

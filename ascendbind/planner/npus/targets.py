"""Which NPUs a worker drives: its request and the evidence about it -> a TargetDecision. Pure.

An index local to a container never names an NPU of the host on its own: a pod the
device plugin gave physical NPU 5 sees it as device 0. So the NPU comes from what the
kernel and the driver say about the worker, converted to logical ids with the chip
map (``npu-smi info -m``'s ``Chip Phy-ID``; without that column the physical id is
taken as the logical one, and the evidence says so). The rule, in precedence order:

1. **Reach**: the NPUs the worker can open. Its container's device nodes of the
   driver's major (minor = udevid; the node's name says nothing), narrowed by its v1
   devices cgroup; without a readable device set, ``ASCEND_VISIBLE_DEVICES``; for a
   worker in the host's mount namespace, or one not known to be in a container,
   every NPU of the host. A container whose device set cannot be read has unknown
   devices: a position among them (``ASCEND_RT_VISIBLE_DEVICES``, a device index) is
   refused rather than taken among the host's.
2. **Use**: the driver's map of the process to its device contexts
   (``/proc/trs_core/proc``), else the rows of ``npu-smi info``'s process table for
   its host pid. A row outside the reach is dropped with a warning: a stale table,
   or a pid of another namespace, never outweighs the kernel's device set.
3. **The runtime's devices**: the reach in the order the driver numbers a process's
   devices (by udevid; for a process in the host's mount namespace on Ascend 950, by
   logical id), re-indexed by ``ASCEND_RT_VISIBLE_DEVICES``.
4. **The pick**, the first that applies:
   a. the request's NPUs (``request``): each must be in the reach and, when the use
      is known, in the use;
   b. the request's device index (``device_index``): that entry of the runtime's
      devices, which must be in the use when it is known;
   c. the use (``driver``, ``process_table``). Listed on NPU 0 and on others (a
      runtime that also opened a context on device 0), the worker is bound to those
      its runtime's devices hold when they single them out, else refused
      (``stray_context``, naming both); under a and b the unbound rows are a warning;
   d. the runtime's devices when something narrowed them below the host
      (``container_devices``, ``visible_devices``, ``rt_visible_devices``): all of
      them, or when there are several, those npu-smi shows busy if that leaves any;
   e. nothing: ``no_target_npu``, saying what was tried.

A request the evidence contradicts is a Conflict ``npu_mismatch`` naming both, never
a binding to the other NPU. The environment is the request's (what the worker sees
now) when it sent one, else ``/proc/<pid>/environ`` (what it was started with).
"""

from __future__ import annotations

from dataclasses import dataclass

from ...errors import Conflict, PlanImpossible, UsageError
from ...values.model import HostFacts, WorkerFacts
from ...values.targeting import (ASCEND_ENV, SOURCES, EvidenceLine, NpuEvidence, TargetDecision, TargetRequest,
                         physical_of_udevid)
from .ascend_env import is_virtual, parse_rt_visible_devices, parse_visible_devices
from ..pools.layout import cl

__all__ = ["resolve_targets"]


class _Chips:
    """The host's id conversions: udevid -> physical -> logical, and the device order."""

    def __init__(self, host: HostFacts) -> None:
        self.logic = set(host.logic_ids)
        printed = {c.phy_id: c.logic_id for c in host.chips if c.phy_id is not None}
        self.assumed = not printed
        self.by_phy = printed or {n: n for n in self.logic}
        self.phy_of = {v: k for k, v in self.by_phy.items()}
        self.ascend950 = any("950" in c.name for c in host.chips)
        self.assumed_used = False  # a physical id was converted by the assumption

    def of_phy(self, phy: int) -> int | None:
        self.assumed_used |= self.assumed and bool(self.logic)
        return self.by_phy.get(phy) if self.logic else phy

    def of_udevid(self, udevid: int) -> int | None:
        return self.of_phy(physical_of_udevid(udevid))

    def order(self, logic: int) -> int:
        return self.phy_of.get(logic, logic)


@dataclass
class _Reach:
    npus: list[int]  # in the driver's device order
    rule: str | None  # None: nothing narrowed it below the host
    why: str
    known: bool = True  # False: a container whose device set could not be read
    conflict: str | None = None  # a variable naming devices the worker cannot open


def _ids(ids) -> str:
    return ",".join(map(str, ids)) or "none"


def _env(worker: WorkerFacts, request: TargetRequest) -> tuple[dict[str, str], str]:
    if request.env is not None:
        env, where = request.env, "sent with the request"
    else:
        env, where = worker.env, "in its environment"
    return {k: env[k] for k in ASCEND_ENV if k in env and env[k].strip()}, where


class _Weigh:
    """One decision's working state: the evidence lines and warnings as they are found."""

    def __init__(self, host: HostFacts, worker: WorkerFacts, request: TargetRequest) -> None:
        self.host, self.worker, self.request = host, worker, request
        self.chips = _Chips(host)
        self.ev = worker.npu_evidence or NpuEvidence(unavailable={"device_nodes": "not read"})
        self.env, self.env_where = _env(worker, request)
        self.lines: dict[str, EvidenceLine] = {}
        self.warnings: list[str] = []
        self.steps: list[str] = []  # the runtime's devices, step by step

    def line(self, source: str, npus, detail: str) -> None:
        self.lines[source] = EvidenceLine(source, None if npus is None else tuple(sorted(npus)), detail)

    def logic_of(self, udevids, what: str) -> list[int]:
        out = []
        for u in udevids:
            n = self.chips.of_udevid(u)
            if n is None:
                self.warnings.append(f"{what} {u} (physical {physical_of_udevid(u)}) matches no NPU of npu-smi info -m")
            elif n not in out:
                out.append(n)
        return out

    # ------------------------------------------------------------ reach

    def nodes(self) -> list[int] | None:
        ev = self.ev
        if ev.host_namespace:
            self.line("device_nodes", None, "the worker is in the host's mount namespace: it reaches every NPU")
            return None
        if ev.device_nodes is None:
            self.line("device_nodes", None, ev.unavailable.get("device_nodes", "not read"))
            return None
        nodes = sorted(ev.device_nodes, key=lambda n: n.minor)
        if not nodes and ev.host_namespace is None:
            # a bare host's /dev on a machine without NPU nodes looks the same: not evidence
            self.line("device_nodes", None, f"no device node of major {ev.major} under its /dev, and its mount "
                                            "namespace could not be compared with pid 1's: nothing to go by")
            return None
        found = self.logic_of([n.minor for n in nodes], "device node udevid")
        shown = "; ".join(f"{n.text()} -> NPU {self.chips.of_udevid(n.minor)}" for n in nodes)
        self.line("device_nodes", found, shown or f"no device node of major {ev.major} under its /dev")
        return found

    def cgroup(self) -> set[int] | None:
        cg = self.ev.cgroup_devices
        if cg is None:
            self.line("devices_cgroup", None, self.ev.unavailable.get("devices_cgroup", "not read"))
            return None
        if cg.minors is None:
            self.line("devices_cgroup", None, f"{cg.path} allows every device of major {self.ev.major}")
            return None
        found = set(self.logic_of(sorted(cg.minors), "devices.list minor"))
        self.line("devices_cgroup", found, f"{cg.path} allows minors {cl(cg.minors) or 'none'} of major "
                                           f"{self.ev.major}")
        return found

    def visible(self) -> list[int] | None:
        raw = self.env.get("ASCEND_VISIBLE_DEVICES")
        if raw is None:
            self.line("visible_devices", None, f"ASCEND_VISIBLE_DEVICES unset ({self.env_where})")
            return None
        try:
            ids = parse_visible_devices(raw)
        except ValueError as exc:
            self.line("visible_devices", None, f"unusable: {exc}")
            self.warnings.append(str(exc))
            return None
        virtual = is_virtual(self.env.get("ASCEND_RUNTIME_OPTIONS")) or any(i >= 100 for i in ids)
        if virtual:
            found, kind = self.logic_of(ids, "vNPU"), "vNPU udevids"
        elif self.chips.ascend950:
            found, kind = [i for i in ids if not self.chips.logic or i in self.chips.logic], "logical ids (Ascend 950)"
        else:
            found, kind = [n for i in ids if (n := self.chips.of_phy(i)) is not None], "physical ids"
        self.line("visible_devices", found, f"ASCEND_VISIBLE_DEVICES={raw} ({kind}, {self.env_where})")
        return sorted(found, key=self.chips.order)

    def reach(self) -> _Reach:
        nodes, allowed, visible = self.nodes(), self.cgroup(), self.visible()
        if nodes is not None or allowed is not None:
            base = nodes if nodes is not None else sorted(self.chips.logic, key=self.chips.order)
            npus = [n for n in base if allowed is None or n in allowed]
            what = "its container's device nodes" if nodes is not None else "its devices cgroup"
            if nodes is not None and allowed is not None:
                what += " allowed by its devices cgroup"
            why = f"{what}: NPU {_ids(npus)}"
            if visible is None:
                return _Reach(npus, "container_devices", why)
            outside = sorted(set(visible) - set(npus))
            if outside:
                return _Reach(npus, "container_devices", why, conflict=(
                    f"{self.lines['visible_devices'].detail} names NPU {_ids(outside)}, which pid {self.worker.pid} "
                    f"cannot open ({why})"))
            # the runtime sees the devices the variable names among those it can open
            inside = [n for n in npus if n in visible]
            if inside != npus:
                why += f", of which ASCEND_VISIBLE_DEVICES names NPU {_ids(inside)}"
                self.steps.append(f"found {self.shown(npus)}; ASCEND_VISIBLE_DEVICES keeps {self.shown(inside)}")
            return _Reach(inside, "container_devices", why)
        if visible is not None:
            return _Reach(visible, "visible_devices", f"ASCEND_VISIBLE_DEVICES: NPU {_ids(visible)}")
        if self.ev.host_namespace is False:
            # a container holds the nodes its runtime mounted, not the host's: without its device
            # set, a position among "its devices" names no NPU (the host's list would be a guess)
            return _Reach([], None, f"its container's devices, which could not be read ("
                          f"{self.lines['device_nodes'].detail})", known=False)
        whole = sorted(self.chips.logic)
        if not (self.chips.ascend950 and self.ev.host_namespace is not False):
            whole.sort(key=self.chips.order)
        return _Reach(whole, None, "every NPU of the host")

    # ------------------------------------------------------------ use

    def use(self, reach: _Reach) -> tuple[list[int] | None, str | None]:
        ev, pid = self.ev, self.worker.pid
        driver = None
        if ev.driver_udevids is None:
            self.line("driver", None, ev.unavailable.get("driver", "not read"))
        else:
            driver = self.logic_of(ev.driver_udevids, "driver map udevid")
            self.line("driver", driver, f"/proc/trs_core/proc lists pid {pid} on udevid "
                                        f"{_ids(ev.driver_udevids)}: NPU {_ids(driver)}" if ev.driver_udevids else
                      f"/proc/trs_core/proc lists no device context of pid {pid}")
        table = None
        if "process_table" in ev.unavailable:
            self.line("process_table", None, ev.unavailable["process_table"])
        else:
            table = sorted({p.npu for p in self.host.processes if p.pid == pid})
            self.line("process_table", table, f"npu-smi info lists pid {pid} on NPU {_ids(table)}" if table else
                      f"npu-smi info lists no process {pid}")
        for source, found in (("driver", driver), ("process_table", table)):
            if not found:
                continue
            outside = [n for n in found if n not in reach.npus]
            if outside and reach.rule is not None:
                self.warnings.append(f"{source.replace('_', ' ')} puts pid {pid} on NPU {_ids(outside)}, outside "
                                     f"what it can reach ({reach.why}); ignored")
                found = [n for n in found if n in reach.npus]
            if found:
                return sorted(found), source
        return None, None

    # ------------------------------------------------------------ the runtime's devices

    def shown(self, npus) -> str:
        """NPUs with their physical ids where the host prints them: ``NPU 5 (physical 1)``."""
        if self.chips.assumed:
            return "NPU " + _ids(npus)
        return ", ".join(f"NPU {n} (physical {self.chips.order(n)})" for n in npus) or "none"

    def runtime(self, reach: _Reach) -> tuple[list[int] | None, str]:
        """The runtime's devices in index order, or None (and why) when they cannot be told."""
        if reach.known:
            self.steps.append(f"it can open {self.shown(reach.npus)}: {reach.why}")
        devices, why = self._rt_visible(reach)
        if devices is not None and "ASCEND_RT_VISIBLE_DEVICES" in self.env:
            self.steps.append("after ASCEND_RT_VISIBLE_DEVICES=" + self.env["ASCEND_RT_VISIBLE_DEVICES"] + ": " +
                              ", ".join(f"device {i} = NPU {n}" for i, n in enumerate(devices)))
        return devices, why

    def _rt_visible(self, reach: _Reach) -> tuple[list[int] | None, str]:
        raw = self.env.get("ASCEND_RT_VISIBLE_DEVICES")
        if raw is None:
            self.line("rt_visible_devices", None, f"ASCEND_RT_VISIBLE_DEVICES unset ({self.env_where})")
            return (list(reach.npus), "") if reach.known else (None, f"pid {self.worker.pid} sees {reach.why}")
        if not reach.known:
            why = (f"ASCEND_RT_VISIBLE_DEVICES={raw} ({self.env_where}) picks by position among {reach.why}")
            self.line("rt_visible_devices", None, f"unusable: {why}")
            return None, why
        try:
            order = parse_rt_visible_devices(raw)
        except ValueError as exc:
            self.line("rt_visible_devices", None, f"unusable: {exc}")
            return None, str(exc)
        past = [j for j in order if j >= len(reach.npus)]
        if past:
            why = (f"ASCEND_RT_VISIBLE_DEVICES={raw} ({self.env_where}) names index {_ids(past)}, but pid "
                   f"{self.worker.pid} sees {len(reach.npus)} device(s) ({reach.why})")
            self.line("rt_visible_devices", None, f"unusable: {why}")
            return None, why
        devices = [reach.npus[j] for j in order]
        self.line("rt_visible_devices", devices, f"ASCEND_RT_VISIBLE_DEVICES={raw} ({self.env_where}): device i "
                                                 f"is NPU {', '.join(map(str, devices))} in turn")
        return devices, ""

    # ------------------------------------------------------------ the pick

    def decide(self) -> TargetDecision:
        req, pid = self.request, self.worker.pid
        if req.names_npus and req.device_index is not None:
            raise UsageError("name either NPUs or a device index, not both", code="bad_request")
        self.line("request", req.npus, "NPU " + _ids(req.npus) if req.npus else
                  (f"device index {req.device_index}" if req.device_index is not None else "no NPU, no device index"))
        reach = self.reach()
        use, use_source = self.use(reach)
        devices, rt_why = self.runtime(reach)
        if reach.conflict is not None:
            raise self._mismatch(reach.conflict, steps=True)
        if req.names_npus:
            self._known(req.npus)
            self._within(req.npus, reach.npus, f"pid {pid} can reach only NPU {_ids(reach.npus)} ({reach.why})",
                         reach.rule is not None)
            if use is not None:
                self._within(req.npus, use, f"the {use_source.replace('_', ' ')} puts pid {pid} on NPU {_ids(use)}")
            self._extra_rows(use, use_source, req.npus)
            return self._decision(req.npus, "request", f"the request names NPU {_ids(req.npus)}, and the evidence "
                                  "agrees" if use or reach.rule else f"the request names NPU {_ids(req.npus)}")
        if req.device_index is not None:
            i = req.device_index
            if devices is None:
                raise self._mismatch(f"device index {i} cannot be resolved: {rt_why}", steps=True)
            if i >= len(devices):
                raise self._mismatch(f"the request names device index {i}, but pid {pid}'s runtime sees "
                                     f"{len(devices)} device(s): NPU {_ids(devices)} ({reach.why})", steps=True)
            npu = devices[i]
            self.steps.append(f"device index {i} -> {self.shown([npu])}")
            if use is not None:
                self._within((npu,), use, f"the {use_source.replace('_', ' ')} puts pid {pid} on NPU {_ids(use)}",
                             prefix=f"device index {i} is ", steps=True)
            self._extra_rows(use, use_source, (npu,))
            return self._decision((npu,), "device_index", f"device index {i} of pid {pid}'s runtime is NPU {npu} "
                                  f"({reach.why})")
        if use is not None:
            return self._by_use(use, use_source, devices, reach)
        narrowed = reach.rule if reach.rule is not None else ("rt_visible_devices" if self.env.get(
            "ASCEND_RT_VISIBLE_DEVICES") is not None else None)
        if narrowed is not None and devices:
            pick, why = devices, reach.why if narrowed == reach.rule else self.lines["rt_visible_devices"].detail
            busy = [n for n in devices if n in {p.npu for p in self.host.processes}]
            if len(devices) > 1 and busy:
                pick, why = busy, f"{why}; of those, npu-smi shows NPU {_ids(busy)} busy"
            return self._decision(tuple(sorted(pick)), narrowed, why)
        tried = "; ".join(f"{e.source}: {e.detail}" for e in self._evidence() if e.source != "request")
        if narrowed is not None and devices == []:
            raise PlanImpossible(f"no target NPU: pid {pid} can reach no NPU ({reach.why}); tried {tried}",
                                 code="no_target_npu")
        raise PlanImpossible(f"no target NPU for pid {pid}: nothing says which NPU it drives ({tried}); pass --npu "
                             f"or a device index" + (f" ({rt_why})" if rt_why else ""), code="no_target_npu")

    def _by_use(self, use: list[int], source: str, devices: list[int] | None, reach: _Reach) -> TargetDecision:
        """The NPUs the driver or npu-smi lists the worker on. A runtime may also open a context
        on device 0 (Mooncake, some launchers): listed on NPU 0 and on its own, the worker is
        bound to the one its devices single out, else refused, never to both with NPU 0's IRQs."""
        detail = self.lines[source].detail
        if 0 not in use or len(use) == 1:
            return self._decision(tuple(use), source, detail)
        narrowed = devices is not None and (reach.rule is not None or "ASCEND_RT_VISIBLE_DEVICES" in self.env)
        picked = [n for n in use if narrowed and n in devices]
        if picked and len(picked) < len(use):
            self._extra_rows(use, source, picked)
            return self._decision(tuple(picked), source, f"{detail}; its devices ({self._devices_why(reach)}) hold "
                                                         f"only NPU {_ids(picked)}")
        tried = "; ".join(f"{e.source}: {e.detail}" for e in self._evidence() if e.source != "request")
        raise PlanImpossible(f"the {source.replace('_', ' ')} lists pid {self.worker.pid} on NPU {_ids(use)}: NPU 0 "
                             f"and NPU {_ids([n for n in use if n])}, and nothing says which it drives (a runtime that "
                             f"also opened a context on NPU 0 is listed on both; tried {tried}); pass --npu or a "
                             "device index", code="stray_context")

    def _devices_why(self, reach: _Reach) -> str:
        if "ASCEND_RT_VISIBLE_DEVICES" in self.env and "rt_visible_devices" in self.lines:
            return f"{reach.why}, then {self.lines['rt_visible_devices'].detail}"
        return reach.why

    def _extra_rows(self, use: list[int] | None, source: str | None, bound) -> None:
        """Name the rows of the use that are not bound (a stray context, typically on NPU 0)."""
        extra = [n for n in use or () if n not in bound]
        if extra and source is not None:
            self.warnings.append(f"the {source.replace('_', ' ')} also lists pid {self.worker.pid} on NPU "
                                 f"{_ids(extra)}, a context its runtime opened beside NPU {_ids(sorted(bound))}; "
                                 "not bound")

    def _known(self, npus) -> None:
        known = self.chips.logic
        bad = [n for n in npus if n < 0 or (known and n not in known)]
        if bad:
            listed = f"npu-smi info -m lists {cl(known)}" if known else "ids are never negative"
            raise PlanImpossible(f"NPU {_ids(bad)} {'is' if len(bad) == 1 else 'are'} not a logical NPU of this host "
                                 f"({listed})", code="unknown_npu")

    def _within(self, npus, allowed, why: str, applies: bool = True, *, prefix: str = "", steps: bool = False) -> None:
        outside = [n for n in npus if n not in allowed]
        if applies and outside:
            raise self._mismatch(f"{prefix or 'the request names '}NPU {_ids(outside)}, but {why}", steps=steps)

    def _mismatch(self, sentence: str, *, steps: bool = False) -> Conflict:
        if steps and self.steps:
            sentence += " (the runtime's devices: " + "; ".join(self.steps) + ")"
        exc = Conflict(sentence, code="npu_mismatch")
        exc.evidence = self._evidence()  # type: ignore[attr-defined]
        return exc

    def _evidence(self) -> tuple[EvidenceLine, ...]:
        return tuple(self.lines[s] for s in SOURCES if s in self.lines)

    def _decision(self, npus, rule: str, reason: str) -> TargetDecision:
        warnings = list(self.warnings)
        if self.chips.assumed_used:
            warnings.append("npu-smi info -m prints no Chip Phy-ID: physical ids were taken as logical ids")
        return TargetDecision(tuple(npus), rule, reason, self._evidence(), tuple(warnings), tuple(self.steps))


def resolve_targets(host: HostFacts, worker: WorkerFacts, request: TargetRequest | None = None) -> TargetDecision:
    """The worker's target NPUs, the rule that picked them and the evidence, for ``request``
    (None: no NPU and no device index). Conflict ``npu_mismatch`` when the request contradicts
    the evidence, PlanImpossible ``unknown_npu`` for an id the host lacks and ``no_target_npu``
    when nothing names an NPU, UsageError when the request names both NPUs and an index."""
    return _Weigh(host, worker, request or TargetRequest()).decide()

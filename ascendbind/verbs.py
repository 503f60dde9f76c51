"""The daemon's CLI verbs: ``serve``, and the socket clients ``bind``, ``release``,
``status``, ``run``. ``register(subparsers)`` adds them to the
``ascendbind`` parser (cli.py); each handler returns the exit status or raises an
AscendbindError, which cli.main prints on one line with its exit status.

The client verbs find the socket through settings.resolve_socket, as the client
library does: ``--socket`` > ``ASCENDBIND_SOCKET`` > the ``socket`` key of the
config file (when readable) > the default path.
"""

from __future__ import annotations

import argparse
import os
import sys

from .client import Client, run_bound
from .values.config import CHOICES, DEFAULT_SOCKET
from .values.cpulist import format_cpulist
from .errors import StepFailed, UsageError
from .render import compact_json, table
from .settings import add_config_flags, config_from_args, resolve_socket

__all__ = ["register"]


def _pos_int(kind: str, minimum: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not {kind}: {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"not {kind}: {text!r}")
        return value

    return parse


_POOL_SOURCE_HELP = ("where the pool comes from: slice (the placement rules), cpuset (the worker's own cpuset) or "
                     "auto; default: the daemon's pool_source")

_pid = _pos_int("a pid", 1)
_npu = _pos_int("an NPU id", 0)


def register(subparsers) -> None:
    p = subparsers.add_parser("serve", help="run the daemon (socket API, reconcile loop, metrics)")
    add_config_flags(p, isolation_keys=True)
    p.set_defaults(func=cmd_serve)

    p = subparsers.add_parser("bind", help="ask the daemon to bind a process")
    p.add_argument("--pid", type=_pid, required=True)
    who = p.add_mutually_exclusive_group()
    who.add_argument("--npu", type=_npu, action="append", help="target logical NPU (repeatable; default: "
                     "what the evidence about the process says: its container's devices, the driver, npu-smi)")
    who.add_argument("--device-index", type=_npu, dest="device_index", metavar="I",
                     help="the process's runtime device index; the daemon resolves the NPU behind it")
    p.add_argument("--topology-policy", choices=CHOICES["topology_policy"], dest="topology_policy")
    p.add_argument("--pool-source", choices=CHOICES["pool_source"], dest="pool_source", help=_POOL_SOURCE_HELP)
    _client_flags(p)
    p.set_defaults(func=cmd_bind)

    p = subparsers.add_parser("release", help="ask the daemon to undo a binding")
    who = p.add_mutually_exclusive_group(required=True)
    who.add_argument("--pid", type=_pid)
    who.add_argument("--all", action="store_true", help="release every worker the daemon holds (root)")
    _client_flags(p)
    p.set_defaults(func=cmd_release)

    p = subparsers.add_parser("status", help="list the workers the daemon holds, and why each is as it is")
    p.add_argument("--pid", type=_pid, help="show only this bound worker")
    p.add_argument("--explain", action="store_true", help="with --pid: also print the explanation of its plan "
                   "(alignment hints, merge, decision), as `plan --explain` does")
    p.add_argument("--memory", action="store_true", help="also show each worker's pages per NUMA node "
                   "(reads /proc/<pid>/numa_maps; slow on big processes)")
    _client_flags(p)
    p.set_defaults(func=cmd_status)

    p = subparsers.add_parser("run", help="run CMD bound to an NPU's CPUs (the child binds itself, then execs)")
    p.add_argument("--npu", type=_npu, action="append", help="target logical NPU (repeatable; default: what the "
                   "evidence says, e.g. the one NPU device of its container)")
    p.add_argument("--require-binding", action="store_true", help="do not run CMD unbound if binding fails")
    p.add_argument("--topology-policy", choices=CHOICES["topology_policy"], dest="topology_policy")
    p.add_argument("--pool-source", choices=CHOICES["pool_source"], dest="pool_source", help=_POOL_SOURCE_HELP)
    p.add_argument("--socket", metavar="PATH", help=f"daemon socket (default {DEFAULT_SOCKET})")
    p.add_argument("--config", metavar="FILE", help="config file to read the socket path from")
    p.add_argument("command", nargs=argparse.REMAINDER, metavar="-- CMD ...")
    p.set_defaults(func=cmd_run)


def _client_flags(p) -> None:
    p.add_argument("--format", choices=("table", "json"), default="table")
    p.add_argument("--socket", metavar="PATH", help=f"daemon socket (default {DEFAULT_SOCKET})")
    p.add_argument("--config", metavar="FILE", help="config file to read the socket path from")


def _socket_of(args) -> str:
    return resolve_socket(getattr(args, "socket", None), config_path=getattr(args, "config", None))


# ---------------------------------------------------------------- handlers


def cmd_serve(args) -> int:
    from .daemon.runtime.logs import configure_logging
    from .daemon.runtime.serve import serve

    config = config_from_args(args)
    configure_logging()
    code = serve(config, reload=lambda: config_from_args(args))
    # serve() returned: the state is saved and every tool reaped. A thread may still be stuck in
    # the kernel (a read a worker's filesystem never answers); the interpreter's exit would join
    # some of them (executors register such joins), so leave without it: exiting interrupts
    # their waits, and nothing else is pending.
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def _cl(cpus) -> str:
    return format_cpulist(cpus) or "-"


def _npu_rows(plan: dict) -> list[str]:
    rows = []
    for npu, p in sorted(plan.get("npus", {}).items(), key=lambda kv: int(kv[0])):
        rows.append(f"NPU{npu}: pool {_cl(p['pool'])}  irq {_cl(p['irq'])}  main {_cl(p['main'])}  "
                    f"acl {_cl(p['acl'])}  release {_cl(p['release'])}  numa {','.join(map(str, p['numa_nodes']))}"
                    + "".join(f"  {name} {_cl(cpus)}" for name, cpus in p.get("classes", {}).items()))
    return rows


def _class_lines(plan: dict) -> list[str]:
    """The thread classes a worker was bound with, each with where its threads go (none: no line)."""
    parts = []
    for c in plan.get("thread_classes", ()):
        if "role" in c:
            where = c["role"]
        else:
            where = ";".join(_cl(p.get("classes", {}).get(c["name"], ())) for p in plan.get("npus", {}).values())
        parts.append(f"{c['name']} ({','.join(c['match'])}) -> {where}")
    return ["thread classes: " + "; ".join(parts)] if parts else []


def cmd_bind(args) -> int:
    result = Client(_socket_of(args)).bind(args.pid, args.npu, args.topology_policy, device_index=args.device_index,
                                           pool_source=args.pool_source)
    if args.format == "json":
        print(compact_json(result))
    else:
        print(f"bound pid {result['pid']} to NPU {','.join(map(str, result['npus']))} ({result['outcome']})")
        for line in _targets_lines(result["plan"]):
            print("  " + line)
        for line in _npu_rows(result["plan"]):
            print("  " + line)
        for s in result["steps"]:
            print(f"  {s['step']:<8} {s['outcome']:<8} {s['reason'] or '-':<22} {s['detail']}")
        proof = result.get("proof") or {}
        if proof and not proof.get("proven"):
            print(f"  unproven: {proof.get('detail', '')}")
    if result.get("status") == "partial":
        failed = next(s for s in result["steps"] if s["outcome"] == "failed")
        raise StepFailed(f"bound pid {result['pid']}, but step {failed['step']} failed: {failed['detail']}")
    return 0


def cmd_release(args) -> int:
    client = Client(_socket_of(args))
    result = client.release(all=True) if args.all else client.release(args.pid)
    if args.format == "json":
        print(compact_json(result))
    elif args.all:
        released = result.get("released", [])
        print(f"released {len(released)} workers" + (f": {', '.join(map(str, released))}" if released else ""))
    else:
        print(f"released pid {result['pid']}")
        for s in result.get("steps", []):
            print(f"  {s['step']:<8} {s['outcome']:<8} {s['reason'] or '-':<22} {s['detail']}")
    return 0


def _move(m: dict | None) -> str:
    """The memory move as a table cell: ``moving 41%``, ``pending``, ``done``, ``failed (code)``."""
    if not m or not m.get("state"):
        return "-"
    state = m["state"]
    if state == "moving" and m.get("bytes_to_move"):
        return f"moving {min(100, int(100 * m.get('bytes_moved', 0) / m['bytes_to_move']))}%"
    if state in ("failed", "skipped") and m.get("reason"):
        return f"{state} ({m['reason']})"
    return state


def cmd_status(args) -> int:
    if args.explain and args.pid is None:
        raise UsageError("status --explain needs --pid PID (the bound worker whose plan to explain)")
    client = Client(_socket_of(args))
    health = client.health()
    isolation = None
    if args.pid is not None:
        workers = [client.worker(args.pid, explain=args.explain)]
    else:
        listing = client.workers()
        workers, isolation = listing["workers"], listing.get("isolation")
    if args.memory:
        from .discovery import LiveHost
        from .discovery.gather.worker import read_numa_residency
        from .errors import AscendbindError

        for w in workers:
            try:
                residency = read_numa_residency(LiveHost(), w["pid"], start_time=w.get("start_time"))
                w["memory_pages_by_node"] = {str(k): v for k, v in residency.pages.items()}
            except AscendbindError as exc:  # unreadable numa_maps (gone, not permitted): say so per worker
                w["memory_pages_by_node"] = {"error": str(exc)[:120]}
    if args.format == "json":
        print(compact_json({"health": health, "workers": workers,
                            **({"isolation": isolation} if isolation is not None else {})}))
        return 0
    print(f"daemon: {health['status']}  discovery: {health['discovery']}  workers: {health['workers']}  "
          f"hotplug: {health.get('hotplug')}")
    for line in _isolation_lines(isolation):
        print(line)
    if not workers:
        print("no bound workers")
        return 0

    rows = []
    for w in workers:
        npus = w["plan"].get("npus", {})
        pools = ";".join(_cl(p["pool"]) for p in npus.values())
        acl = ";".join(_cl(p["acl"]) for p in npus.values())
        drift = w.get("drift", {})
        row = [str(w["pid"]), ",".join(map(str, w["npus"])), w.get("outcome", "-"), pools, acl,
               str(drift.get("events", 0)) + (f" ({drift['culprit']})" if drift.get("culprit") else ""),
               str(w.get("late_threads_pinned", 0)), _ratio(w.get("memory_local_ratio")), _move(w.get("memory"))]
        if args.memory:
            mem = w["memory_pages_by_node"]
            row.append(" ".join(f"{k}:{v}" for k, v in mem.items()) or "-")
        rows.append(row)
    headers = ["PID", "NPU", "OUTCOME", "POOL", "ACL", "DRIFT", "LATE", "MEM-LOCAL", "MEM-MOVE"] + \
        (["PAGES/NODE"] if args.memory else [])
    print(table(headers, rows))
    for w in workers:
        for line in _why_lines(w) + _class_lines(w.get("plan", {})):
            print(f"  {w['pid']}: {line}")
        for line in _contention_lines(w.get("contention")):
            print(f"  {w['pid']}: {line}")
    for w in workers:
        if w.get("explanation"):
            print(f"\nplan explanation of pid {w['pid']}:")
            print(w["explanation"])
    return 0


def _contention_lines(c: dict | None) -> list[str]:
    """Whether the worker's threads get their CPUs, since it was bound: per role the run-queue
    delay as a share of delay + CPU time, and the foreign load on its pool."""
    if not c:
        return []
    parts = []
    for role, r in c.get("roles", {}).items():
        cpu, delay = r.get("cpu_seconds", 0), r.get("run_delay_seconds", 0)
        share = f"{100 * delay / (cpu + delay):.1f}%" if cpu + delay > 0 else "-"
        parts.append(f"{role} {share} ({delay:.3f} s waited, {cpu:.3f} s ran, {r.get('involuntary_switches', 0)} "
                     f"preempted)")
    lines = ["run delay: " + "; ".join(parts)] if parts else []
    f = c.get("foreign") or {}
    lines.append(f"foreign on pool: {f.get('cpu_seconds', 0):.3f} s CPU, {f.get('interrupts', 0)} interrupts")
    pod = c.get("pod") or {}
    if pod.get("pod_name"):
        lines.append(f"pod: {pod.get('namespace') or '?'}/{pod['pod_name']} container {pod.get('container_name') or '?'}")
    return lines


def _targets_lines(plan: dict) -> list[str]:
    """Which rule picked the NPU, and why (absent for a binding made before the rule existed)."""
    t = plan.get("targets")
    if not t:
        return []
    return [f"NPU {','.join(map(str, t['npus']))} by rule {t['rule']}: {t['reason']}"] + \
        [f"warning: {w}" for w in t.get("warnings", ())]


def _why_lines(w: dict) -> list[str]:
    """Which rule picked the NPU, and why a worker is not simply bound and aligned:
    alignment, steps, drift verdicts."""
    out = _targets_lines(w.get("plan", {}))
    source = (w.get("plan") or {}).get("pool_source")
    if source:
        out.append(f"pool is its own cpuset (pool_source {source.get('requested')}): {source.get('evidence')}")
    al = w.get("alignment") or {}
    if w.get("outcome") == "unaligned":
        code = f" [{al['failure']}]" if al.get("failure") else ""
        out.append(f"not aligned{code}: {al.get('reason') or 'the plan was not evaluated for alignment'}")
    for s in w.get("steps", []):
        # "not_applicable": the step has no meaning on this host (UVB off Ascend 950): nothing to explain
        if s.get("outcome") != "applied" and s.get("reason") != "not_applicable":
            out.append(f"step {s['step']} {s['outcome']}" + (f" [{s['reason']}]" if s.get("reason") else "")
                       + f": {s.get('detail', '')}")
    proof = w.get("proof") or {}
    if proof and not proof.get("proven"):
        out.append(f"unproven, isolates nothing and holds its NPU against nobody: {proof.get('detail', '')}")
    drift = w.get("drift") or {}
    if drift.get("left_alone"):
        out.append(f"threads left alone: {drift.get('left_alone_why') or 'masks kept moving'}")
    elif drift.get("culprit"):
        out.append(f"drift blamed {drift['culprit']}: {drift.get('blame') or ''}".rstrip(": "))
    if drift.get("irqs_left_alone"):
        out.append(f"IRQs left alone: {drift.get('irqs_left_alone_why') or 'IRQ masks kept moving'}")
    return out


def _isolation_lines(iso: dict | None) -> list[str]:
    """What isolation does on this host, CPU by CPU, and what it changed (``status``)."""
    if not iso:
        return []
    changed = ", ".join(f"{k} {v}" for k, v in (iso.get("changed") or {}).items() if v) or "nothing"
    out = [f"isolation: {iso['level']}  housekeeping {iso.get('housekeeping') or '-'} "
           f"({iso.get('housekeeping_cpus')})  protected {iso.get('protected') or '-'}  changed: {changed}"]
    out += [f"  CPU {g['cpus']:<12} {g['class']:<12}  {g['role']}" for g in iso.get("cpus") or () if iso.get("protected")]
    if iso["level"] == "host" and iso.get("protected"):
        from .planner.isolate.isolation import left_to_kernel  # the planner only where it says something

        out.append(f"  {left_to_kernel(iso['protected'])}")
    threads = iso.get("daemon_threads")
    if threads:
        out.append(f"  daemon threads on CPUs {threads['cpus']} (started on {threads['started_on']}): {threads['note']}")
    for key in ("waiting", "irqbalance"):
        if iso.get(key):
            out.append(f"  {key}: {iso[key]}")
    tasks = iso.get("tasks")
    if tasks:
        events = tasks.get("events") or {}
        never = ", ".join(f"{k} {v}" for k, v in (tasks.get("never_moved") or {}).items() if v) or "none"
        how = events.get("mode") + (f" ({events['reason']})" if events.get("reason") else "")
        out.append(f"  other tasks: new ones found by {how}; moved as they started {tasks.get('moved_as_started', 0)}; "
                   f"never moved: {never}; left to their owner {tasks.get('left_to_owner', 0)}; pinned inside "
                   f"{tasks.get('pinned_inside', 0)}" + (f"; not moved, record full [too_many_tasks] "
                                                          f"{tasks['too_many_tasks']}" if tasks.get("too_many_tasks") else ""))
        out += [f"  pinned inside [{p['reason']}]: {p['detail']}" for p in (tasks.get("pinned") or ())[:8]]
    out += [f"  warning: {w}" for w in iso.get("warnings") or ()]
    if iso.get("error"):
        out.append(f"  error [{iso['error']['code']}]: {iso['error']['reason']}")
    by_reason: dict[str, list[str]] = {}
    for s in iso.get("skipped") or ():
        by_reason.setdefault(s["reason"], []).append(s["what"])
    out += [f"  skipped [{reason}]: {len(keys)} ({', '.join(keys[:8])}{', ...' if len(keys) > 8 else ''})"
            for reason, keys in sorted(by_reason.items())]
    out += [f"  left to its owner [{s['reason']}]: {s['detail']}" for s in iso.get("left_to_owner") or ()]
    return out


def _ratio(value) -> str:
    """The locality share as a percentage; "-" before the first check or with nothing resident."""
    return "-" if value is None else f"{100 * value:.0f}%"


def cmd_run(args) -> int:
    cmd = list(args.command)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        raise UsageError("run: no command given (ascendbind run [--npu N] -- CMD ...)")
    npu = None if not args.npu else (args.npu[0] if len(args.npu) == 1 else args.npu)
    sys.stdout.flush()
    return run_bound(cmd, npu, require_binding=args.require_binding, socket_path=_socket_of(args),
                     topology_policy=args.topology_policy, pool_source=args.pool_source)

"""What a move costs per mapping: a worker of many one-page mappings against one
mapping of the same bytes, on a real two-node kernel.

    .venv/bin/python bench/memory_mappings.py [--mappings 10000] [--repeat 3] [--big 100000] [--before REV]
                                              [--rate GIB] [--json PATH]

Boots the 2node guest (tests/numa_guest.py) and runs itself inside it
(``--in-guest``). Each arm starts a worker (tests/memworker.py) under
``numactl --membind=1`` holding ``--mappings`` pages of private memory in one of
four shapes: ``tiny``, one page per mapping (``--tiny``: each apart from the
next, so the kernel keeps them apart), 4 KiB pages of their own (``--no-thp``);
``one``, one mapping of as many 4 KiB pages (``--no-thp``); ``tiny-thp`` and
``one-thp``, the same with transparent huge pages allowed (the guest kernel's
default). The kernel moves a huge page 2 MiB at a time, and the tiny worker's
pages are then pieces of huge pages faulted in before its region was cut up
(half of each mapped, the other half unmapped but still part of it): moving
them copies twice their bytes. It then moves the worker's private pages to node 0 with
``PageMove`` (applier/memory.py) in a process of its own, no rate limit, and
reports that process's CPU seconds (user + system, the move only: its imports
are done before), the wall time, the bytes moved and the share of the worker's
anonymous memory on node 0 afterwards. Beside the guest's own count, the host
counts the whole guest's CPU time (QEMU's threads) over each move, read when the
move's start and end marks come off the guest's console: the guest's vCPUs are
threads of a shared host, and a vCPU the host holds off still counts as CPU time
in the guest's clock, not in the host's. The arms run ``--repeat`` times in
turn; the least and the median of each are compared: tiny against one is what a
worker's owner gains by cutting its memory into one-page mappings, tiny-thp against
one-thp what it gains by cutting huge pages up as well.

``--before REV``: the same arms against the package as it was at ``REV`` (a git
revision of this checkout, extracted on the host), first, with a move that is
still running after ``--before-timeout`` seconds cancelled and reported as such.
``--big N``: one more arm of this checkout with N one-page mappings (the guest's
``vm.max_map_count`` is raised for it and put back), against the cap a move has
on mappings. ``--rate GIB``: one more pair of arms at that rate limit, wall
time against the cost model's bound.

Software emulation makes every figure slower than on a real host; the ratios
between arms, measured in one run, are what carries over.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import machine, write_json  # noqa: E402

MAX_MAP_COUNT = "/proc/sys/vm/max_map_count"


# ------------------------------------------------------------------ one move, in a process of its own

def handshake(mark: str) -> None:
    """Tell the host this point was reached (a line on the guest's console, which the host
    reads as it comes) and stay idle a moment, so the host's count of the guest's CPU is
    read between this point and the next work."""
    if mark:
        print(f"@mark {mark}", file=sys.stderr, flush=True)
        time.sleep(0.3)


def arm(code: str, pid: int, start: int, node: int, rate: float, timeout: float, mark: str = "") -> dict:
    """Move ``pid``'s private pages to ``node`` with the package under ``code``; its CPU and wall time."""
    sys.path.insert(0, code)
    from ascendbind.applier.memory import MoveCancel, PageMove
    from ascendbind.discovery import LiveHost

    cancel = MoveCancel()
    move = PageMove(LiveHost(), pid, start, node, rate=rate * (1 << 30), cancel=cancel)
    out: dict = {}

    def run() -> None:
        t = time.thread_time()
        res = move.run()
        out.update(outcome=res.outcome.value, reason=res.reason.value if res.reason else None,
                   detail=res.detail, bytes_moved=res.data.get("bytes_moved"), thread_cpu_s=time.thread_time() - t)

    handshake(mark and f"{mark}.start")
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
    t = threading.Thread(target=run, name="memory-move", daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        moved = move.progress().bytes_moved
        cancel.set("bench timeout")
        t.join()
        out["still_moving_after_s"] = timeout
        out["bytes_moved_by_timeout"] = moved
    wall = time.monotonic() - t0
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    handshake(mark and f"{mark}.end")
    out["user_s"], out["sys_s"] = round(r1.ru_utime - r0.ru_utime, 3), round(r1.ru_stime - r0.ru_stime, 3)
    out["cpu_s"] = round((r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime), 3)
    out["wall_s"] = round(wall, 3)
    return out


# ------------------------------------------------------------------ in the guest

def _anon_kib(pid: int) -> dict[int, int]:
    out: dict[int, int] = {}
    with open(f"/proc/{pid}/numa_maps") as fh:
        for line in fh:
            if "file=" in line or "anon=" not in line:
                continue
            page = int(line.rsplit("kernelpagesize_kB=", 1)[1].split()[0])
            for word in line.split():
                key, _, value = word.partition("=")
                if key[:1] == "N" and key[1:].isdigit():
                    out[int(key[1:])] = out.get(int(key[1:]), 0) + int(value) * page
    return out


_SEQ = itertools.count()
SHAPES = {"tiny": lambda n: {"tiny": n, "no_thp": True}, "one": lambda n: {"private_pages": n, "no_thp": True},
          "tiny-thp": lambda n: {"tiny": n}, "one-thp": lambda n: {"private_pages": n}}


def one_arm(code: str, shape: str, n: int, rate: float, timeout: float) -> dict:
    from tests.memworker_client import mem_worker

    kwargs = SHAPES[shape](n)
    t0 = time.monotonic()
    with mem_worker(membind=1, **kwargs) as w:
        setup = time.monotonic() - t0
        with open(f"/proc/{w.pid}/maps") as fh:
            mappings = sum(1 for _ in fh)
        before = _anon_kib(w.pid)
        seq = next(_SEQ)
        # the arm's stderr is the guest's console: its marks reach the host as they are written
        proc = subprocess.run([sys.executable, __file__, "--arm", code, str(w.pid), str(w.start_time), "0",
                               str(rate), str(timeout), str(seq)], stdout=subprocess.PIPE, text=True,
                              timeout=timeout + 3600)
        if proc.returncode != 0:
            return {"error": f"the arm exited {proc.returncode}"}
        out = json.loads(proc.stdout.strip().splitlines()[-1])
        after = _anon_kib(w.pid)
    out.update(seq=seq, shape=shape, pages=n, mappings_in_maps=mappings, worker_setup_s=round(setup, 2),
               anon_kib_before=before, anon_kib_after=after,
               on_node0=round(after.get(0, 0) / max(1, sum(after.values())), 4))
    return out


def in_guest(args) -> None:
    results: dict = {"machine": machine(), "mappings": args.mappings, "arms": []}
    variants = ([("before", args.before_dir, args.before_timeout)] if args.before_dir else []) + \
        [("this", str(ROOT), args.timeout)]

    def record(name: str, res: dict) -> None:
        res["variant"] = name
        results["arms"].append(res)
        print(json.dumps(res), flush=True)

    for name, code, timeout in variants:
        for _ in range(args.repeat):
            for shape in SHAPES:
                record(name, one_arm(code, shape, args.mappings, 0.0, timeout))
    if args.rate:
        for shape in ("tiny", "one"):
            res = one_arm(str(ROOT), shape, args.mappings, args.rate, args.timeout)
            res["rate_gib_s"] = args.rate
            record("this", res)
    if args.big:
        with open(MAX_MAP_COUNT) as fh:
            saved = fh.read().strip()
        try:
            with open(MAX_MAP_COUNT, "w") as fh:
                fh.write(f"{2 * args.big + 1000}\n")
            record("this", one_arm(str(ROOT), "tiny", args.big, 0.0, args.timeout))
            if args.before_dir:
                record("before", one_arm(args.before_dir, "tiny", args.big, 0.0, args.before_timeout))
        finally:
            with open(MAX_MAP_COUNT, "w") as fh:
                fh.write(saved + "\n")
    with open(os.path.join(os.environ["NUMA_GUEST_OUT"], "memory_mappings.json"), "w") as fh:
        json.dump(results, fh, indent=1)


# ------------------------------------------------------------------ on the host

def _least_and_median(arms: list[dict], key: str) -> tuple[float, float] | None:
    xs = [a[key] for a in arms if a.get(key) is not None]
    return (min(xs), statistics.median(xs)) if xs else None


def report(r: dict) -> str:
    lines = [f"memory move per mapping, in a 2-node guest ({r['machine']['kernel']}, software emulation); "
             "CPU: the guest's count (the move's process), host: the host's count of the whole guest"]
    groups: dict[tuple, list[dict]] = {}
    for a in r["arms"]:
        if "error" in a:
            lines.append(f"  error: {a['error'][-400:]}")
            continue
        groups.setdefault((a["variant"], a["pages"], a.get("rate_gib_s"), a["shape"]), []).append(a)
    for (variant, pages, rate, shape), arms in groups.items():
        a = arms[-1]
        cpus = ", ".join(f"{x['cpu_s']:.2f}" for x in arms)
        hosts = ", ".join(f"{x['host_cpu_s']:.2f}" for x in arms if x.get("host_cpu_s") is not None)
        still = [x["still_moving_after_s"] for x in arms if "still_moving_after_s" in x]
        moved = (a.get("bytes_moved") or a.get("bytes_moved_by_timeout") or 0) / (1 << 20)
        wall = statistics.median(x["wall_s"] for x in arms)
        split = (f" (user {statistics.median(x['user_s'] for x in arms):.2f} + system "
                 f"{statistics.median(x['sys_s'] for x in arms):.2f} median)" if all("user_s" in x for x in arms) else "")
        lines.append(f"  [{variant:<6}] {shape:<8} {pages:>6} pages in {a['mappings_in_maps']:>6} mappings"
                     f"{f' at {rate} GiB/s' if rate else ''}: CPU s {cpus}{split}; host CPU s {hosts or '-'}; wall "
                     f"median {wall:.3f} s; {moved:.1f} MiB moved, {100 * a['on_node0']:.1f} % on node 0 "
                     f"({a.get('outcome', '-')}{' ' + a['reason'] if a.get('reason') else ''})"
                     f"{f', still moving after {still[0]:g} s in {len(still)} of {len(arms)}' if still else ''}")
    for (variant, pages, rate, shape), arms in groups.items():
        if not shape.startswith("tiny"):
            continue
        for base in ("one" + shape[4:],):  # the same kind of pages in one mapping
            other = groups.get((variant, pages, rate, base))
            if not other:
                continue
            parts = []
            for key, what in (("cpu_s", "CPU"), ("host_cpu_s", "host CPU")):
                t, o = _least_and_median(arms, key), _least_and_median(other, key)
                if t and o and o[0] and o[1]:
                    parts.append(f"{what} {t[0] / o[0]:.2f}x least, {t[1] / o[1]:.2f}x median")
            if parts:
                lines.append(f"  [{variant:<6}] {pages} pages: {shape} / {base}: " + "; ".join(parts))
    return "\n".join(lines)


class GuestCpu:
    """The host's count of the guest's CPU time (QEMU's threads: every vCPU, busy or
    waiting on another) at each point an arm marks (``handshake``), read as the mark's
    line comes off the guest's console. A vCPU the busy host holds off counts here as
    nothing, where the guest's own clock counts it as CPU time."""

    def __init__(self) -> None:
        self.seen: dict[str, float] = {}
        self._qemu = None

    def line(self, text: str) -> None:
        import psutil

        if not text.startswith("@mark "):
            return
        try:
            if self._qemu is None:
                self._qemu = next(p for p in psutil.Process().children(recursive=True)
                                  if p.name().startswith("qemu-system"))
            t = self._qemu.cpu_times()
        except (psutil.Error, StopIteration):
            return
        self.seen[text.split()[1]] = t.user + t.system

    def of(self, seq: int) -> float | None:
        a, b = self.seen.get(f"{seq}.start"), self.seen.get(f"{seq}.end")
        return None if a is None or b is None else round(b - a, 3)


def run_guest(command: list[str], out: str, on_line, timeout: float) -> tuple[int, str]:
    """tests/numa_guest.py's ``run_in_guest``, with each line of the guest's output handed to
    ``on_line`` as it comes: (exit status, the output's tail)."""
    import shlex

    from tests.numa_guest import GUEST_ENV, TOPOLOGIES, vng_argv

    topology = TOPOLOGIES["2node"]
    exports = {GUEST_ENV: topology.name, "NUMA_GUEST_OUT": out, "PYTHONDONTWRITEBYTECODE": "1",
               "PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")}
    line = " ".join(f"{k}={shlex.quote(v)}" for k, v in exports.items()) + " exec " + shlex.join(command)
    env = {**os.environ, "PATH": f"{os.path.dirname(sys.executable)}:{os.environ.get('PATH', '')}"}
    proc = subprocess.Popen(vng_argv(topology, line, out), cwd=ROOT, env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    tail: list[str] = []
    timer = threading.Timer(timeout, lambda: os.killpg(proc.pid, 9))
    timer.start()
    try:
        assert proc.stdout
        for text in proc.stdout:
            on_line(text.strip())
            tail = (tail + [text])[-200:]
        return proc.wait(), "".join(tail)
    finally:
        timer.cancel()


def extract(rev: str, into: str) -> str:
    """The package as it was at ``rev``, under ``into`` (git archive of this checkout)."""
    os.makedirs(into, exist_ok=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", rev, "ascendbind"],
                             capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", into], input=archive.stdout, check=True)
    return into


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--arm"]:
        code, pid, start, node, rate, timeout, mark = argv[1:8]
        print(json.dumps(arm(code, int(pid), int(start), int(node), float(rate), float(timeout), mark)))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mappings", type=int, default=10000, help="one-page mappings of the tiny worker")
    ap.add_argument("--repeat", type=int, default=5, help="runs of each arm, in turn (medians compared)")
    ap.add_argument("--big", type=int, default=0, help="one more arm with this many mappings (0: none)")
    ap.add_argument("--rate", type=float, default=0.0, help="one more pair of arms at this GiB/s (0: none)")
    ap.add_argument("--before", metavar="REV", help="a git revision to run the same arms against first")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds a move of this checkout may take")
    ap.add_argument("--before-timeout", type=float, default=120.0, help="seconds a move of --before may take")
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--in-guest", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--before-dir", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.in_guest:
        in_guest(args)
        return 0
    from tests.numa_guest import why_not

    why = why_not()
    if why:
        print(why, file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory(prefix="bench-mappings-") as out:
        os.chmod(out, 0o755)
        cmd = [sys.executable, str(Path(__file__).resolve()), "--in-guest", "--mappings", str(args.mappings),
               "--repeat", str(args.repeat),
               "--big", str(args.big), "--rate", str(args.rate), "--timeout", str(args.timeout),
               "--before-timeout", str(args.before_timeout)]
        if args.before:
            cmd += ["--before-dir", extract(args.before, os.path.join(out, "before"))]
        host = GuestCpu()
        rc, tail = run_guest(cmd, out, host.line, timeout=7200)
        path = os.path.join(out, "memory_mappings.json")
        if not os.path.exists(path):
            sys.stderr.write(f"the guest exited {rc}:\n{tail[-5000:]}")
            return 1
        with open(path) as fh:
            results = json.load(fh)
        for a in results["arms"]:
            if "seq" in a:
                a["host_cpu_s"] = host.of(a["seq"])
    print(report(results))
    write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())

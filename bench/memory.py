"""The memory step on a real two-node kernel: how fast it moves, what the worker feels,
and what the daemon does for other clients meanwhile.

    .venv/bin/python bench/memory.py [--mib 512] [--before DIR] [--json PATH]

Boots the 2node guest (tests/numa_guest.py: QEMU, this machine's kernel, two NUMA
nodes) and runs itself inside it (``--in-guest``). Three parts, each measured side
by side in the one run:

1. **Throughput.** One worker with ``--mib`` MiB of private memory, started on
   node 1. The same pages are moved node 1 -> 0 -> 1 ... alternately by
   ascendbind's move (applier/memory.py: pagemap selection, ``move_pages(2)`` in
   64 MiB chunks, no rate limit) and by a bare ``migrate_pages(2)`` of the whole
   process (what ``migratepages`` does), three times each: GiB/s of both and
   their ratio. The worker has no shared memory, so both move the same pages.
2. **The worker's own latency while its pages move.** The worker runs steps of
   work over its memory (each writes one byte per page of a 64 MiB window) during
   each kind of move, and with no move: step time p50 / p99 / max.
3. **The daemon under a shared segment** (the two-worker case the memory step
   once made harmful): ``ascendbind serve`` with two fixture NPUs (pools node 0
   and node 1); A with 1 GiB private + a 256 MiB ``/dev/shm`` segment, B with
   16 MiB + the same segment, both first touched on node 1. A binds to NPU 0;
   0.3 s later B binds to NPU 1 and ``/healthz`` is asked. Reported: each bind's
   answer time, ``/healthz``'s, where A's private pages and the segment are once
   the moves end, and the memory reruns over 60 s of locality checks every 3 s
   (reruns allowed every 6 s). With ``--before DIR`` the same is run against
   another checkout (say, one whose memory step ran ``migratepages`` inside the
   bind) in the same boot, first.

Software emulation makes every figure slower than on a real host; the ratios
between variants, measured in one run, are what carries over.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import machine, results_from_guest, write_json  # noqa: E402

MIB = 1 << 20
_MIGRATE_PAGES = {"x86_64": 256, "aarch64": 238}


# ------------------------------------------------------------------ in the guest

def _anon_kib(pid: int) -> dict[int, int]:
    out: dict[int, int] = {}
    with open(f"/proc/{pid}/numa_maps") as fh:
        for line in fh:
            if "file=" in line or "kernelpagesize_kB=" not in line:
                continue
            page = int(line.rsplit("kernelpagesize_kB=", 1)[1].split()[0])
            for word in line.split():
                key, _, value = word.partition("=")
                if key[:1] == "N" and key[1:].isdigit():
                    out[int(key[1:])] = out.get(int(key[1:]), 0) + int(value) * page
    return out


def _file_pages(pid: int, path: str) -> dict[int, int]:
    out: dict[int, int] = {}
    with open(f"/proc/{pid}/numa_maps") as fh:
        for line in fh:
            if f"file={path}" not in line:
                continue
            for word in line.split():
                key, _, value = word.partition("=")
                if key[:1] == "N" and key[1:].isdigit():
                    out[int(key[1:])] = out.get(int(key[1:]), 0) + int(value)
    return out


def bare_migrate_pages(pid: int, old: set[int], new: set[int]) -> int:
    """migrate_pages(2) of the whole process, as ``migratepages`` runs it (root: shared pages too)."""
    libc = ctypes.CDLL(None, use_errno=True)
    mask = lambda nodes: (ctypes.c_ulong * 2)(sum(1 << n for n in nodes), 0)  # noqa: E731
    rc = libc.syscall(_MIGRATE_PAGES[platform.machine()], pid, ctypes.c_ulong(128), mask(old), mask(new))
    if rc < 0:
        raise OSError(ctypes.get_errno(), "migrate_pages")
    return rc


def _stats(xs: list[float]) -> dict:
    xs = sorted(xs)
    if not xs:
        return {"n": 0}
    return {"n": len(xs), "p50_ms": round(1000 * statistics.median(xs), 2),
            "p99_ms": round(1000 * xs[min(len(xs) - 1, int(0.99 * len(xs)))], 2), "max_ms": round(1000 * xs[-1], 2)}


def throughput_and_latency(mib: int, rounds: int = 3) -> dict:
    from ascendbind.applier.memory import PageMove
    from ascendbind.discovery import LiveHost
    from tests.memworker_client import mem_worker

    out: dict = {"mib": mib, "ours_gib_s": [], "bare_gib_s": []}
    lat: dict[str, list[float]] = {"none": [], "ours_unlimited": [], "ours_2gib_s": [], "bare": []}
    with mem_worker(private_mib=mib, membind=1) as w:
        src = LiveHost()

        def during(kind: str, move) -> float:
            """Run ``move`` while the worker steps; the move's seconds."""
            steps: list[float] = []
            t = threading.Thread(target=lambda: steps.extend(w.steps(40)))
            t.start()
            t0 = time.monotonic()
            move()
            took = time.monotonic() - t0
            t.join()
            lat[kind] += steps
            return took

        lat["none"] += w.steps(40)
        for i in range(rounds):
            # node 1 -> 0 by ours, then 0 -> 1 by the bare call: the same pages each way
            res = None

            def ours():
                nonlocal res
                res = PageMove(src, w.pid, w.start_time, 0).run()

            took = during("ours_unlimited", ours)
            assert res is not None and res.outcome.value == "applied", res
            out["ours_gib_s"].append(res.data["bytes_moved"] / (1 << 30) / took)
            on0 = _anon_kib(w.pid).get(0, 0) * 1024
            took = during("bare", lambda: bare_migrate_pages(w.pid, {0}, {1}))
            out["bare_gib_s"].append(on0 / (1 << 30) / took)
        # the default rate limit, once (1 -> 0)
        during("ours_2gib_s", lambda: PageMove(src, w.pid, w.start_time, 0, rate=2 * (1 << 30)).run())
    out["latency"] = {k: _stats(v) for k, v in lat.items()}
    ours, bare = statistics.median(out["ours_gib_s"]), statistics.median(out["bare_gib_s"])
    out["ratio_ours_to_bare"] = round(ours / bare, 3) if bare else None
    return out


def scenario(checkout: str, watch: float = 60.0) -> dict:
    """The two-worker, one-segment case against the daemon of ``checkout``."""
    from ascendbind.client import Client
    from tests.daemon_harness import DaemonProc, base_env, free_port, metric_value, wait_for
    from tests.memworker_client import mem_worker
    from tests.numa.conftest import recorded_npu_smi

    tmp = tempfile.mkdtemp(prefix="bench-memory-")
    seg = f"/dev/shm/bench-seg-{os.getpid()}"
    env = base_env(os.path.join(tmp, "s.sock"), os.path.join(tmp, "state"), free_port(),
                   ASCENDBIND_MEMORY_CHECK_SECONDS="3", ASCENDBIND_MEMORY_RERUN_SECONDS="6",
                   ASCENDBIND_NPU_SMI=recorded_npu_smi(os.path.join(tmp, "npu-smi"), 2, "0-7"),
                   ASCENDBIND_COMMAND_TIMEOUT_SECONDS="120", PYTHONPATH=checkout)
    # the checkout's own package first (the daemon runs with the cwd of this one)
    serve = f"import sys; sys.path.insert(0, {checkout!r}); from ascendbind.cli import main; sys.exit(main(['serve']))"
    d = DaemonProc(tmp, env, argv=[sys.executable, "-c", serve])
    d.start(wait=False)
    out: dict = {"checkout": checkout}
    try:
        d.wait_ready(900)
        d.wait_discovered(900)
        with mem_worker(private_mib=1024, shared=[(seg, 256)], membind=1) as a, \
                mem_worker(private_mib=16, shared=[(seg, 256)], membind=1) as b:
            seg_before = _file_pages(a.pid, seg)
            times: dict[str, float] = {}

            def timed(name: str, method: str, path: str, body=None) -> None:
                # the stdlib client, in this process: what a worker's own request costs, with
                # no program started to make it (a curl costs seconds in the guest)
                t0 = time.monotonic()
                status, _ = Client(d.sock, timeout=600).request(method, path, body)
                times[name] = round(time.monotonic() - t0, 3)
                times[name + "_status"] = status

            ta = threading.Thread(target=timed, args=("bind_a", "POST", "/v1/bind", {"pid": a.pid, "npu": 0}))
            ta.start()
            time.sleep(0.3)  # the scenario's own spacing, not a synchronisation
            tb = threading.Thread(target=timed, args=("bind_b", "POST", "/v1/bind", {"pid": b.pid, "npu": 1}))
            tb.start()
            time.sleep(0.2)
            timed("healthz", "GET", "/healthz")
            ta.join()
            tb.join()
            out.update(times)

            def settled() -> bool:
                ws = d.client.workers()["workers"]
                return len(ws) == 2 and all(w.get("memory", {}).get("state", "done") not in ("pending", "moving")
                                            for w in ws)

            t0 = time.monotonic()
            wait_for(settled, 900)
            out["moves_done_after_s"] = round(time.monotonic() - t0 + times["bind_a"], 1)
            reruns = lambda: sum(metric_value(d.metrics_text(), "ascendbind_memory_reruns_total",  # noqa: E731
                                              outcome=o) or 0 for o in ("applied", "skipped", "failed"))
            r0 = reruns()
            seg_samples = []
            end = time.monotonic() + watch
            while time.monotonic() < end:
                seg_samples.append(_file_pages(a.pid, seg))
                time.sleep(5)
            out["reruns_in_watch"] = reruns() - r0
            out["watch_seconds"] = watch
            out["segment_before"] = seg_before
            out["segment_after"] = _file_pages(a.pid, seg)
            out["segment_changed_in_watch"] = any(s != seg_samples[0] for s in seg_samples)
            for name, w, node in (("a", a, 0), ("b", b, 1)):
                kib = _anon_kib(w.pid)
                out[f"{name}_private_on_pool_node"] = round(kib.get(node, 0) / max(1, sum(kib.values())), 4)
    finally:
        d.stop(timeout=120)
        if os.path.exists(seg):
            os.unlink(seg)
    return out


def in_guest(args) -> None:
    results = {"machine": machine(), "throughput": throughput_and_latency(args.mib)}
    variants = ([("before", os.path.abspath(args.before))] if args.before else []) + [("this", str(ROOT))]
    results["scenario"] = {name: scenario(path, args.watch) for name, path in variants}
    with open(os.path.join(os.environ["NUMA_GUEST_OUT"], "memory.json"), "w") as fh:
        json.dump(results, fh, indent=1)


# ------------------------------------------------------------------ on the host

def report(r: dict) -> str:
    t = r["throughput"]
    med = lambda xs: statistics.median(xs) if xs else float("nan")  # noqa: E731
    lines = [f"memory bench, in a 2-node guest ({r['machine']['kernel']}, software emulation)",
             f"  throughput, {t['mib']} MiB private: ascendbind {med(t['ours_gib_s']):.3f} GiB/s, bare "
             f"migrate_pages(2) {med(t['bare_gib_s']):.3f} GiB/s: ratio {t['ratio_ours_to_bare']}"]
    for kind, s in t["latency"].items():
        if s.get("n"):
            lines.append(f"  worker step while {kind:<15} p50 {s['p50_ms']:8.2f} ms  p99 {s['p99_ms']:8.2f} ms  "
                         f"max {s['max_ms']:8.2f} ms  ({s['n']} steps)")
    for name, s in r["scenario"].items():
        lines.append(f"  [{name}] A's bind {s.get('bind_a')} s, B's bind {s.get('bind_b')} s, /healthz "
                     f"{s.get('healthz')} s; A's private on node 0 {s.get('a_private_on_pool_node')}, B's on node 1 "
                     f"{s.get('b_private_on_pool_node')}; segment {s.get('segment_before')} -> "
                     f"{s.get('segment_after')}; reruns in {s.get('watch_seconds')} s: {s.get('reruns_in_watch')}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=512, help="private memory of the throughput worker")
    ap.add_argument("--watch", type=float, default=60.0, help="seconds the scenario watches for reruns")
    ap.add_argument("--before", metavar="DIR", help="another checkout to run the scenario against first")
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--in-guest", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.in_guest:
        in_guest(args)
        return 0
    results = results_from_guest(
        lambda out: [sys.executable, str(Path(__file__).resolve()), "--in-guest", "--mib", str(args.mib),
                     "--watch", str(args.watch), *(["--before", os.path.abspath(args.before)] if args.before else [])],
        "memory.json")
    if results is None:
        return 1
    print(report(results))
    write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())

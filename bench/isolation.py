"""What ``isolation = irqs`` costs a bind and a release, and what it moves on this host.

    .venv/bin/python bench/isolation.py [--rounds 20]

Starts ``ascendbind serve`` at ``isolation = irqs`` on the fake two-NPU host
(``ASCENDBIND_FAKE_NPU_AFFINITY="0;1"``, ``small_pool = share``: a worker bound on
NPU 1 protects CPU 1, CPU 0 is housekeeping) and one worker, then binds and
releases it ``--rounds`` times. For each round it reads the daemon's ``isolation``
status: the seconds isolation took after the bind (IRQ masks read, changed ones
recorded then written, the daemon's threads moved) and after the release (put
back and read back), the IRQs it moved and skipped (with their reason), and checks
that every mask is back as it was after each release. Prints a JSON summary
with the median and maximum of both, and the bind + release round trip beside a
run at ``isolation = off``. Every IRQ mask is put back at the end, whatever
happened. Needs root and a writable ``/proc/irq``; irqbalance is ``warn`` so that
no irqbalance on the machine is told anything.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tests.daemon_harness import running_daemon  # noqa: E402
from tests.irqbalance_harness import irq_masks_lock  # noqa: E402
from tests.test_isolation_daemon import host_masks, put_back  # noqa: E402
from tests.workers import start_worker  # noqa: E402

ENV = {"ASCENDBIND_FAKE_NPUS": "2", "ASCENDBIND_FAKE_NPU_AFFINITY": "0;1", "ASCENDBIND_IRQBALANCE": "warn"}


def run(level: str, rounds: int, saved: dict[str, str]) -> dict:
    out: dict = {"level": level, "bind_release_ms": [], "follow_bind_ms": [], "follow_release_ms": []}
    with tempfile.TemporaryDirectory(prefix="ascendbind-bench-iso-", dir="/tmp") as directory, \
            running_daemon(directory, ASCENDBIND_ISOLATION=level, **ENV) as d, start_worker() as w:
        d.wait_discovered()
        for _ in range(rounds):
            t0 = time.monotonic()
            d.client.bind(pid=w.pid, npu=1)
            iso = d.client.workers()["isolation"]
            t1 = time.monotonic()
            d.client.release(pid=w.pid)
            t2 = time.monotonic()
            after = d.client.workers()["isolation"]
            out["bind_release_ms"].append(1000 * ((t1 - t0) + (t2 - t1)))
            if level != "off":
                out["follow_bind_ms"].append(1000 * iso["last_change"]["seconds"])
                out["follow_release_ms"].append(1000 * after["last_change"]["seconds"])
                out["irqs_moved"], out["default_moved"] = iso["changed"]["irq"], iso["changed"]["default"]
                out["skipped"] = sorted(f"{s['what']} [{s['reason']}]" for s in iso["skipped"])
                out["housekeeping"], out["protected"] = iso["housekeeping"], iso["protected"]
            back = {k for k, v in host_masks().items() if saved.get(k) != v}
            if back:
                raise SystemExit(f"masks not put back after release: {sorted(back)}")
    for key in ("bind_release_ms", "follow_bind_ms", "follow_release_ms"):
        values = out.pop(key)
        if values:
            out[key] = {"median": round(statistics.median(values), 2), "max": round(max(values), 2)}
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    if os.geteuid() != 0 or not os.access("/proc/irq", os.W_OK):
        print("needs root and a writable /proc/irq", file=sys.stderr)
        return 2
    with irq_masks_lock():
        saved = host_masks()
        try:
            report = {"irqs_on_host": sum(1 for k in saved if k.startswith("irq:")), "load": os.getloadavg()[0],
                      "runs": [run(level, args.rounds, saved) for level in ("off", "irqs")]}
        finally:
            put_back(saved)
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

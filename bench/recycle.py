"""Pid recycling against a bind: how many strangers end up with a mask the daemon wrote.

    .venv/bin/python bench/recycle.py [--trials 1000] [--kinds pid,tid,tick,held] [--json PATH]

Runs tests/recycle_ns.py as init of a new pid namespace (``unshare --pid --fork
--mount-proc``; root), so only the namespace's own numbers are recycled. Each
``pid`` trial binds a real worker (main thread + 4 named threads) through an
in-process daemon, and between the bind's checks and its first affinity write
kills the worker and hands its pid, and its thread ids, to a stranger with 6
threads (``ns_last_pid``). ``tid`` hands one thread's id to a stranger while the
worker lives on; ``tick`` is ``pid`` with the stranger forked in the clock tick
the worker was born in (same start time); ``held`` recycles in that tick right
after a completed bind, then asks the daemon about its worker, runs a reconcile
pass or a release. See the harness's docstring for what each count means.

Prints, per kind: strangers left with any thread's mask other than the one it
was born with (*pinned*), workers held though a stranger has their pid
(*held*), the writes the daemon found on a stranger's thread and set back
(*undone*), and the daemon's answers. Exit status 1 when any stranger was left
pinned or any newcomer held. ``--trials`` applies to ``pid``; the other kinds
run a tenth as many (``tick`` and ``held`` retry until the tick holds both).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.common import write_json  # noqa: E402

HARNESS = os.path.join(ROOT, "tests", "recycle_ns.py")


def run(kind: str, trials: int) -> dict:
    unshare = shutil.which("unshare")
    if unshare is None:
        raise SystemExit("unshare is missing")
    t0 = time.monotonic()
    r = subprocess.run([unshare, "--pid", "--fork", "--mount-proc", sys.executable, HARNESS, "--trials",
                        str(trials), "--kind", kind, "--json"], capture_output=True, text=True, cwd=ROOT)
    if r.returncode != 0:
        raise SystemExit(f"the harness failed ({r.returncode}): {r.stderr.strip()[-2000:]}")
    out = json.loads(r.stdout.strip().splitlines()[-1])[0]
    out["wall_seconds"] = round(time.monotonic() - t0, 1)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=1000)
    ap.add_argument("--kinds", default="pid,tid,tick,held")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    if os.geteuid() != 0:
        raise SystemExit("a pid namespace of its own needs root")
    results = []
    for kind in args.kinds.split(","):
        n = args.trials if kind == "pid" else max(1, args.trials // 10)
        r = run(kind, n)
        results.append(r)
        print(f"{kind:5} {r['trials']:5} trials: {r['pinned']} strangers left pinned, {r['held']} newcomers held, "
              f"{r['undone']} writes undone ({r['retried']} retried, {r['wall_seconds']} s)")
        print(f"      answers: {r['answers']}")
    write_json(args.json, {"results": results})
    return 1 if any(r["pinned"] or r["held"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())

"""Fuzz a real daemon's socket API and print the figures.

    .venv/bin/python bench/fuzz_api.py [--requests 10000] [--seed 20261130]

Starts ``ascendbind serve`` on the fake one-NPU host (tests/daemon_harness.py)
and one sacrificial worker, runs the seeded fuzzer of tests/http_fuzz.py in its
own process (a body without ``pid`` binds the caller), then reads the daemon's
log and metrics. Goals: 0 replies without a status line, 0 5xx other than 503
(busy, discovery) and 505 (HTTP version), 0 replies that break the answer
format, 0 tracebacks and 0 unexpected exceptions in the daemon.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tests.daemon_harness import metric_value, running_daemon  # noqa: E402
from tests.workers import start_worker  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--seed", type=int, default=20261130)
    args = ap.parse_args()
    directory = tempfile.mkdtemp(prefix="ascendbind-fuzz-")
    try:
        with running_daemon(directory) as d, start_worker(plain=1, acl=0, release=0) as w:
            d.wait_discovered()
            r = subprocess.run([sys.executable, "-m", "tests.http_fuzz", "--socket", d.sock, "--requests",
                                str(args.requests), "--seed", str(args.seed), "--pid", str(w.pid)],
                               capture_output=True, text=True, cwd=ROOT, check=True)
            figures = json.loads(r.stdout)
            log = d.log()
            _, text = d.curl("GET", "/metrics")
            figures["daemon"] = {
                "alive": d.alive(),
                "tracebacks_in_log": log.count("Traceback"),
                "unexpected_exceptions": metric_value(text, "ascendbind_http_internal_errors_total"),
                "log_lines": log.count("\n"),
            }
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    print(json.dumps(figures, indent=2))
    bad = (figures["no_status_line"] or figures["unexpected_5xx"] or figures["problems"]
           or figures["daemon"]["tracebacks_in_log"] or figures["daemon"]["unexpected_exceptions"]
           or not figures["daemon"]["alive"])
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

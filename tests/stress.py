"""Run test files many times in a row while CPU burners keep every CPU busy.

    python tests/stress.py tests/test_applier_affinity.py            # 30 runs, 2 burners
    python tests/stress.py --runs 10 --burners 4 tests/test_a.py tests/test_b.py

A flaky test blocks every landing, so a test file is only done when it passes
many consecutive runs on a loaded machine. Each file gets its own run of
``--runs`` consecutive pytest invocations; the first failing run stops that
file and its output is printed. Run i shuffles the file's tests with random seed i
(``--in-order`` keeps them as written), so order dependence fails too. The burners are plain busy-looping processes
(no extra tool needed) and are killed whatever happens. Exit status: 0 when
every file passed every run, 1 otherwise.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_BURN = "while True: pass"


def start_burners(n: int) -> list[subprocess.Popen]:
    # Each burner runs in its own session so that a Ctrl-C aimed at the
    # runner's process group does not leave it orphaned mid-kill.
    return [subprocess.Popen([sys.executable, "-c", _BURN], start_new_session=True) for _ in range(n)]


def stop_burners(burners: list[subprocess.Popen]) -> None:
    for p in burners:
        if p.poll() is None:
            p.send_signal(signal.SIGKILL)
    for p in burners:
        p.wait()


def stress_file(path: str, runs: int, extra: list[str], shuffle: bool) -> tuple[int, str | None]:
    """(runs passed, output of the failing run or None). With ``shuffle`` run i
    orders the tests with random seed i, so a test that needs another before it shows up."""
    for i in range(runs):
        order = [f"--shuffle={i}"] if shuffle else []
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *order, *extra,
                            path], cwd=ROOT, capture_output=True, text=True)
        if r.returncode not in (0, 5):  # 5: every test in the file was deselected or skipped
            return i, r.stdout + r.stderr
    return runs, None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+", help="test files (or pytest node ids)")
    ap.add_argument("--runs", type=int, default=30, help="consecutive runs per file (default 30)")
    ap.add_argument("--burners", type=int, default=2, help="busy-looping processes (default 2)")
    ap.add_argument("--in-order", action="store_true", help="keep the file's order (default: shuffle each run)")
    ap.add_argument("--pytest-arg", action="append", default=[], help="extra pytest argument (repeatable)")
    args = ap.parse_args(argv)
    if args.runs < 1 or args.burners < 0:
        ap.error("--runs must be >= 1 and --burners >= 0")

    burners = start_burners(args.burners)
    failed = []
    try:
        for path in args.files:
            t0 = time.monotonic()
            passed, output = stress_file(path, args.runs, args.pytest_arg, not args.in_order)
            took = time.monotonic() - t0
            if output is None:
                print(f"PASS {path}: {passed}/{args.runs} runs with {args.burners} burners ({took:.0f} s)", flush=True)
            else:
                print(f"FAIL {path}: run {passed + 1} of {args.runs} failed after {passed} passes ({took:.0f} s)\n"
                      f"{output}", flush=True)
                failed.append(path)
    finally:
        stop_burners(burners)
    print(f"stress: {len(args.files) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

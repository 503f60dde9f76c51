"""A noisy neighbour for the benches: processes that keep every CPU busy.

``stress-ng --cpu N`` (Debian package stress-ng) when it is installed, else N
spinning Python processes of our own. Each runs in its own session and is
stopped through its own process group; each also ends by itself after a
budget, so a bench killed hard leaves no burner behind.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time


class Neighbour:
    """CPU burners in their own session, killed as a group (their own pgid) on stop."""

    def __init__(self, kind: str, procs: int, budget_s: float) -> None:
        self.procs = procs
        self.kind = kind
        self.members: list[subprocess.Popen] = []
        self.note = ""
        if kind == "auto":
            self.kind = "stress-ng" if shutil.which("stress-ng") else "spin"
            if self.kind == "spin":
                self.note = "stress-ng not found (Debian package stress-ng); using own spinning processes"
        if self.kind == "stress-ng" and not shutil.which("stress-ng"):
            raise SystemExit("--neighbour stress-ng: stress-ng is not installed (apt-get install stress-ng)")
        # a bench killed hard must not leave burners behind: they end by themselves
        self.budget = max(10, int(budget_s))

    def describe(self) -> str:
        if self.kind == "none" or self.procs == 0:
            return "none"
        if self.kind == "stress-ng":
            return f"stress-ng --cpu {self.procs}"
        return f"{self.procs} spinning python processes"

    def start(self) -> None:
        if self.kind == "none" or self.procs == 0:
            return
        if self.kind == "stress-ng":
            argv = ["stress-ng", "--cpu", str(self.procs), "--timeout", f"{self.budget}s", "--quiet"]
            # its temporary files go to its working directory, which must be writable
            self.members.append(subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                                 cwd=tempfile.gettempdir(), start_new_session=True))
            # stress-ng forks its workers: wait until they exist, so the first arm is loaded too
            import psutil
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                try:
                    if len(psutil.Process(self.members[0].pid).children()) >= self.procs:
                        break
                except psutil.NoSuchProcess:
                    raise SystemExit("stress-ng exited at start") from None
                time.sleep(0.05)
        else:
            code = f"import time\nend = time.monotonic() + {self.budget}\nwhile time.monotonic() < end: pass\n"
            for _ in range(self.procs):
                self.members.append(subprocess.Popen([sys.executable, "-c", code], start_new_session=True))

    def check(self) -> None:
        """Refuse to measure an arm without its load: a burner that ended skews every later arm."""
        for p in self.members:
            if p.poll() is not None:
                raise SystemExit(f"the neighbour ({self.describe()}) ended early with status {p.returncode}; "
                                 f"no figures from a half-loaded run")

    @contextlib.contextmanager
    def paused(self):
        """The burners stopped (SIGSTOP to each group) for what is set up rather than measured:
        starting a worker and binding it take a Python start and a daemon request, dozens of
        times dearer on a saturated emulated CPU, and none of it is what an arm measures."""
        self._signal(signal.SIGSTOP)
        try:
            yield
        finally:
            self._signal(signal.SIGCONT)

    def _signal(self, sig: int) -> None:
        for p in self.members:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, sig)

    def stop(self) -> None:
        for p in self.members:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for p in self.members:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=10)
        self.members.clear()

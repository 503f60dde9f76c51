"""A fake ``npu-smi`` that can hang the way a stalled driver makes the real one hang.

    fake = HangingNpuSmi(tmp_path)          # answers like fixtures/bin/npu-smi
    fake.hang("info")                        # runs whose arguments start "info" now hang
    fake.calls()                             # every invocation's arguments, in order
    fake.survivors()                         # processes a hung run left behind
    fake.answer()                            # stop hanging
    HangingNpuSmi(tmp_path, seen_at="/srv/x") # for a caller that sees tmp_path as /srv/x (a container)

A hanging run forks a grandchild (``sleep``) and waits for it, like npu-smi's
driver helpers or a shell wrapper around the real binary: killing only the
direct child would leave that grandchild running. Each hung run records its
own pid (the process-group id when the caller starts it in a new session) and
its grandchild's pid, so a test can check that nothing of the group survived.

Answers are replayed with ``cat`` from a fixture host's ``cmd/`` files
(``host_dir``), or by default from a recording of what fixtures/bin/npu-smi
says about this machine, whose process table lists the pids given to
``set_pids``. No Python starts per run, so a short timeout catches only a real
hang, however loaded the machine.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIXTURE_NPU_SMI = ROOT / "fixtures" / "bin" / "npu-smi"
_SLEEP = "300"


class HangingNpuSmi:
    def __init__(self, directory, *, host_dir: str | None = None, seen_at: str | None = None) -> None:
        self.dir = Path(directory) / "hanging-npu-smi"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / "npu-smi"
        # where the caller finds ``directory``: the paths the script itself names
        d = Path(seen_at) / "hanging-npu-smi" if seen_at else self.dir
        self.seen_path = d / "npu-smi"
        if host_dir is None:
            # record fixtures/bin/npu-smi's picture of this machine once: every run is then a
            # `cat`, quick even on a loaded machine, so short timeouts only catch real hangs
            host_dir = str(d / "host")
            self._recorded = True
            self.set_pids(())
        else:
            self._recorded = False
        self.path.write_text(
            "#!/bin/sh\n"
            f'echo "$*" >> "{d}/calls"\n'
            f'if [ -e "{d}/hang" ]; then\n'
            f'  pat=$(cat "{d}/hang")\n'
            '  case "$*" in\n'
            '    "$pat"*)\n'
            f'      echo $$ >> "{d}/groups"\n'
            f"      sleep {_SLEEP} &\n"
            f'      echo $! >> "{d}/kids"\n'
            "      wait\n"
            "      exit 1;;\n"
            "  esac\n"
            "fi\n"
            f'f="{host_dir}/cmd/$(printf %s "npu-smi $*" | tr " " _).txt"\n'
            '[ -r "$f" ] || { echo "Error: unsupported arguments: $*" >&2; exit 2; }\n'
            'exec cat "$f"\n'
        )
        self.path.chmod(0o755)

    def set_pids(self, pids) -> None:
        """Re-record this machine's tables with ``pids`` in the process table (on NPU 0)."""
        assert self._recorded, "set_pids needs the recording of this machine, not a host_dir"
        cmd = self.dir / "host" / "cmd"
        cmd.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith("ASCENDBIND_")}
        env["ASCENDBIND_FAKE_NPU_PIDS"] = ",".join(str(p) for p in pids)
        for args in (["info"], ["info", "-m"], ["info", "-t", "topo"], ["info", "-t", "board", "-i", "0"]):
            out = subprocess.run([sys.executable, str(FIXTURE_NPU_SMI), *args], env=env, capture_output=True,
                                 text=True, check=True, timeout=60).stdout
            tmp = cmd / "new.tmp"
            tmp.write_text(out)
            os.replace(tmp, cmd / ("_".join(["npu-smi", *args]) + ".txt"))

    def hang(self, prefix: str = "") -> None:
        """From now on, runs whose argument string starts with ``prefix`` hang ("" = all)."""
        tmp = self.dir / "hang.new"
        tmp.write_text(prefix)
        os.replace(tmp, self.dir / "hang")

    def answer(self) -> None:
        (self.dir / "hang").unlink(missing_ok=True)

    def _lines(self, name: str) -> list[str]:
        try:
            return (self.dir / name).read_text().splitlines()
        except FileNotFoundError:
            return []

    def calls(self) -> list[str]:
        return self._lines("calls")

    def hung_runs(self) -> int:
        """How many runs have reached the point of hanging (each forked its grandchild)."""
        return len(self._lines("kids"))

    def survivors(self, proc: str = "/proc") -> list[int]:
        """Live (non-zombie) processes of the fake's hung runs: a grandchild ``sleep``, or
        any process still in a hung run's process group running the fake or its sleep.
        ``proc``: the procfs of the pid namespace the runs recorded their pids in."""
        groups = {int(x) for x in self._lines("groups") if x.isdigit()}
        kids = {int(x) for x in self._lines("kids") if x.isdigit()}
        found = []
        for name in os.listdir(proc):
            if not name.isdigit():
                continue
            pid = int(name)
            try:
                with open(f"{proc}/{pid}/stat") as fh:
                    stat = fh.read()
                with open(f"{proc}/{pid}/cmdline", "rb") as fh:
                    argv = fh.read().split(b"\0")
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2:].split()
            state, pgrp = fields[0], int(fields[2])
            if state in ("Z", "X"):
                continue  # dead; only waiting for a parent that may never reap it
            ours = argv[:2] == [b"sleep", _SLEEP.encode()] or str(self.seen_path).encode() in argv
            if ours and (pid in kids or pgrp in groups):
                found.append(pid)
        return sorted(found)

    def wait_no_survivors(self, timeout: float = 10.0, proc: str = "/proc") -> list[int]:
        """Poll until no hung run left a process behind; returns what is still left."""
        deadline = time.monotonic() + timeout
        left = self.survivors(proc)
        while left and time.monotonic() < deadline:
            time.sleep(0.05)
            left = self.survivors(proc)
        return left

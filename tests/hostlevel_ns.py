"""The ``host`` isolation level inside a pid namespace of its own: run as its init.

    unshare --pid --fork --mount-proc --kill-child python tests/hostlevel_ns.py

Refuses to run unless it is pid 1 of a fresh pid namespace: the daemon it starts
moves every process it can see, which must only ever be this namespace's.
Before anything starts, two host-wide files are taken out of reach in this
namespace's private mounts: ``/proc/irq`` is remounted read-only (the IRQ part
of the level is skipped, ``irq_not_writable``; tests/test_isolation_daemon.py
covers it on real IRQs), ``/sys/devices/virtual/workqueue`` is covered with a
directory whose ``cpumask`` is a plain file holding the real mask's text, and
``/proc/sys/kernel/watchdog_cpumask`` with a plain file holding its text (the
real ones are changed only in the QEMU guest).

Driven over stdin/stdout, one JSON object a line each way (``{"op": ...}`` in,
the answer or ``{"error": ...}`` out):

* ``daemon`` (``env``, ``config``: the config file's text): start ``ascendbind serve`` (fixture npu-smi, two NPUs
  near the lowest two CPUs this process may use, ``NPU_CPUS``: CPU 0 and CPU 1 on most machines);
  ``restart``, ``stop`` (``sig``), ``kill`` (-9), ``log``,
  ``status`` (``GET /v1/workers``), ``cli`` (``args``: an ascendbind verb against it), ``metrics`` (its text), ``curl`` (``method``, ``path``, ``body``),
  ``state`` (the state file), ``sighup`` (``config``: the text of the config file);
* ``spawn`` (``comm``, ``threads``): a process named ``comm`` with that many more
  threads, driven over its own pipes; ``fork`` (``pid``): a child of it, same
  script; ``thread`` (``pid``): one more thread of it; ``pin`` (``pid``, ``cpus``): it sets every one of its threads to
  ``cpus`` itself; ``end`` (``pid``);
* ``masks`` (``pid``): tid -> ``Cpus_allowed_list`` from ``/proc/<pid>/task/*/status``;
  ``wait_off`` (``pid``, ``cpus``, ``timeout``): polls those until no thread of
  ``pid`` is allowed any of ``cpus``; answers the seconds from the process's start
  (its ``spawn``) or None at the deadline;
* ``starts`` (``cpus``, ``count``): the seconds from each of ``count`` forks of a
  short ``sleep`` until it is off ``cpus`` (the bench's figure);
* ``wq``: the covered workqueue ``cpumask``'s text; ``watchdog``: the covered
  ``watchdog_cpumask``'s text; ``hide_cgroups``: an empty tmpfs over
  ``/sys/fs/cgroup`` (no cpuset readable); ``exit``.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.daemon_harness import DaemonProc, base_env, free_port  # noqa: E402

WQ = "/sys/devices/virtual/workqueue"
# the fixture npu-smi's two NPUs: NPU 0 near the lowest CPU this process may use, NPU 1 near the
# next one (CPUs 0 and 1 on most machines; derived, so that a machine that gives the tests other
# CPUs, or more of them, still has NPU 1's CPU among them). tests/test_isolation_host.py agrees.
NPU_CPUS = tuple(sorted(os.sched_getaffinity(0))[:2])
WATCHDOG = "/proc/sys/kernel/watchdog_cpumask"

# a process of the host: named, with threads, acting on its own affinity when asked
CHILD = r"""
import ctypes, os, sys, threading
libc = ctypes.CDLL(None, use_errno=True)
libc.prctl(15, ctypes.c_char_p(sys.argv[1].encode()[:15]), 0, 0, 0)
ev = threading.Event()
for i in range(int(sys.argv[2])):
    threading.Thread(target=ev.wait, daemon=True).start()
print(os.getpid(), flush=True)
for line in sys.stdin:
    cmd, _, arg = line.strip().partition(" ")
    if cmd == "pin":
        cpus = {int(c) for c in arg.split(",")}
        for tid in os.listdir("/proc/self/task"):
            os.sched_setaffinity(int(tid), cpus)
        print("ok", flush=True)
    elif cmd == "thread":
        threading.Thread(target=ev.wait, daemon=True).start()
        print("ok", flush=True)
    elif cmd == "fork":
        import subprocess
        p = subprocess.Popen([sys.executable, "-c", sys.argv[3], sys.argv[1] + "_c", "1", sys.argv[3]],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        print(p.stdout.readline().strip(), flush=True)
"""


def cpus_of(text: str) -> set[int]:
    out: set[int] = set()
    for part in text.split(","):
        if part:
            lo, _, hi = part.partition("-")
            out.update(range(int(lo), int(hi or lo) + 1))
    return out


def masks(pid: int) -> dict[str, str]:
    out = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/status") as fh:
                for line in fh:
                    if line.startswith("Cpus_allowed_list:"):
                        out[tid] = line.split(":", 1)[1].strip()
        except OSError:
            pass
    return out


def cover_host_wide_files(tmp: str) -> None:
    subprocess.run(["mount", "--bind", "/proc/irq", "/proc/irq"], check=True)
    subprocess.run(["mount", "-o", "remount,bind,ro", "/proc/irq"], check=True)
    fake = os.path.join(tmp, "workqueue")
    os.mkdir(fake)
    with open(f"{WQ}/cpumask") as fh:
        real = fh.read()
    with open(os.path.join(fake, "cpumask"), "w") as fh:
        fh.write(real)
    subprocess.run(["mount", "--bind", fake, WQ], check=True)
    if os.path.exists(WATCHDOG):  # a kernel built without the lockup detector has none
        with open(WATCHDOG) as fh:
            real = fh.read()
        with open(os.path.join(tmp, "watchdog_cpumask"), "w") as fh:
            fh.write(real)
        subprocess.run(["mount", "--bind", os.path.join(tmp, "watchdog_cpumask"), WATCHDOG], check=True)


class Harness:
    def __init__(self, tmp: str) -> None:
        self.tmp = tmp
        self.daemon: DaemonProc | None = None
        self.children: dict[int, subprocess.Popen] = {}
        self.started: dict[int, float] = {}
        self.config = os.path.join(tmp, "config.toml")
        with open(self.config, "w") as fh:
            fh.write("")

    def op_daemon(self, env: dict, config: str = "") -> dict:
        with open(self.config, "w") as fh:
            fh.write(config)
        full = base_env(os.path.join(self.tmp, "ascendbind.sock"), os.path.join(self.tmp, "state"), free_port(),
                        ASCENDBIND_FAKE_NPUS="2", ASCENDBIND_FAKE_NPU_AFFINITY=";".join(map(str, NPU_CPUS)),
                        ASCENDBIND_IRQBALANCE="warn", ASCENDBIND_CONFIG=self.config, **env)
        self.daemon = DaemonProc(self.tmp, full)
        self.daemon.start()
        self.daemon.wait_discovered()
        return {"pid": self.daemon.pid}

    def op_restart(self) -> dict:
        self.daemon = DaemonProc(self.tmp, self.daemon.env)
        self.daemon.start()
        self.daemon.wait_discovered()
        return {"pid": self.daemon.pid}

    def op_stop(self, sig: int = int(signal.SIGTERM)) -> dict:
        return {"rc": self.daemon.stop(sig)}

    def op_kill(self) -> dict:
        self.daemon.proc.kill()
        self.daemon.proc.wait(10)
        return {}

    def op_log(self) -> dict:
        return {"log": self.daemon.log()}

    def op_status(self) -> dict:
        return self.daemon.client.workers()

    def op_curl(self, method: str, path: str, body=None) -> dict:
        code, out = self.daemon.curl(method, path, body)
        return {"code": code, "body": out}

    def op_cli(self, args: list[str]) -> dict:
        out = subprocess.run([sys.executable, "-m", "ascendbind", *args, "--socket", self.daemon.sock],
                             capture_output=True, text=True, env=self.daemon.env, timeout=60)
        return {"rc": out.returncode, "stdout": out.stdout, "stderr": out.stderr}

    def op_metrics(self) -> dict:
        return {"text": self.daemon.metrics_text()}

    def op_state(self) -> dict:
        with open(os.path.join(self.daemon.state_dir, "state.json")) as fh:
            return json.load(fh)

    def op_sighup(self, config: str) -> dict:
        with open(self.config, "w") as fh:
            fh.write(config)
        self.daemon.proc.send_signal(signal.SIGHUP)
        return {}

    def op_spawn(self, comm: str, threads: int = 0) -> dict:
        t0 = time.monotonic()
        p = subprocess.Popen([sys.executable, "-c", CHILD, comm, str(threads), CHILD], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
        pid = int(p.stdout.readline())
        self.children[pid], self.started[pid] = p, t0
        return {"pid": pid}

    def _ask(self, pid: int, line: str) -> str:
        p = self.children[pid]
        p.stdin.write(line + "\n")
        p.stdin.flush()
        return p.stdout.readline().strip()

    def op_fork(self, pid: int) -> dict:
        return {"pid": int(self._ask(pid, "fork"))}

    def op_thread(self, pid: int) -> dict:
        return {"answer": self._ask(pid, "thread")}

    def op_pin(self, pid: int, cpus: str) -> dict:
        return {"answer": self._ask(pid, "pin " + cpus)}

    def op_end(self, pid: int) -> dict:
        p = self.children.pop(pid)
        p.kill()
        p.wait(10)
        return {}

    def op_masks(self, pid: int) -> dict:
        return masks(pid)

    def op_wait_off(self, pid: int, cpus: str, timeout: float = 5.0) -> dict:
        off = cpus_of(cpus)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            now = masks(pid)
            if now and not any(cpus_of(m) & off for m in now.values()):
                return {"seconds": time.monotonic() - self.started.get(pid, deadline - timeout), "masks": now}
            time.sleep(0.001)  # a deadline poll of the masks, not a wait for time to pass
        return {"seconds": None, "masks": masks(pid)}

    def op_starts(self, cpus: str, count: int, timeout: float = 5.0) -> dict:
        """``count`` times: fork a child that execs ``sleep`` and poll its mask until it holds
        none of ``cpus``; the seconds from just before the fork to that read-back, each (None:
        not moved within ``timeout``). The child of init inherits init's mask, which the
        host level never changes, so each must be found and moved by the watcher."""
        off = cpus_of(cpus)
        out = []
        rng = random.Random(count)
        for _ in range(count):
            # a start at a random point of the watcher's period, not right after its last move
            gap = time.monotonic() + rng.uniform(0, 0.05)
            while time.monotonic() < gap:
                time.sleep(0.0005)
            t0 = time.monotonic()
            pid = os.fork()
            if pid == 0:
                os.execv("/bin/sleep", ["sleep", "60"])
            took = None
            while time.monotonic() - t0 < timeout:
                now = masks(pid)
                if now and not any(cpus_of(m) & off for m in now.values()):
                    took = time.monotonic() - t0
                    break
                time.sleep(0.0002)  # a deadline poll of the mask
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            out.append(took)
        return {"seconds": out}

    def op_hide_cgroups(self) -> dict:
        """An empty tmpfs over /sys/fs/cgroup in this namespace's mounts: no cpuset is readable,
        so the daemon plans a worker from its threads' Cpus_allowed_list."""
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k,mode=0755", "nocgroups", "/sys/fs/cgroup"], check=True)
        return {}

    def op_wq(self) -> dict:
        with open(f"{WQ}/cpumask") as fh:
            return {"text": fh.read().strip()}

    def op_watchdog(self) -> dict:
        with open(WATCHDOG) as fh:
            return {"text": fh.read().strip()}

    def close(self) -> None:
        for p in self.children.values():
            p.kill()
            p.wait(10)
        if self.daemon is not None and self.daemon.alive():
            self.daemon.stop()


def main() -> int:
    if os.getpid() != 1:
        print("hostlevel_ns.py must run as init of a new pid namespace (unshare --pid --fork --mount-proc)",
              file=sys.stderr)
        return 2
    tmp = tempfile.mkdtemp(prefix="ascendbind-hostns-", dir="/tmp")
    cover_host_wide_files(tmp)
    h = Harness(tmp)
    print(json.dumps({"ready": True}), flush=True)
    try:
        for line in sys.stdin:
            req = json.loads(line)
            op = req.pop("op")
            if op == "exit":
                break
            try:
                out = getattr(h, f"op_{op}")(**req)
            except Exception as exc:  # the test reads it as the answer
                out = {"error": f"{type(exc).__name__}: {exc}"}
            print(json.dumps(out), flush=True)
    finally:
        h.close()
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

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
* ``spawn`` (``comm``, ``threads``, ``uid``): a process named ``comm`` with that many more
  threads (as ``uid``, its own group and no other, when given: an unprivileged user),
  driven over its own pipes; ``run`` (``comm``, ``npu``, ``uid``): the same process started by
  ``ascendbind run --npu`` (its pid, and ``run_pid``); ``ask_bind`` (``pid``, ``body``): it posts ``body`` to
  ``/v1/bind`` itself (``{"code", "body"}``); ``open_socket``: the daemon's directory
  and socket opened to every user; ``list`` (``items``: ``PID:NPU`` ...): what the
  process table of a daemon started with ``listed`` lists; ``fork`` (``pid``): a child of it, same
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

from tests.daemon_harness import FIXTURE_BIN, DaemonProc, base_env, free_port  # noqa: E402
from tests.threadname import program  # noqa: E402

WQ = "/sys/devices/virtual/workqueue"
# the fixture npu-smi's two NPUs: NPU 0 near the lowest CPU this process may use, NPU 1 near the
# next one (CPUs 0 and 1 on most machines; derived, so that a machine that gives the tests other
# CPUs, or more of them, still has NPU 1's CPU among them). tests/test_isolation_host.py agrees.
NPU_CPUS = tuple(sorted(os.sched_getaffinity(0))[:2])
WATCHDOG = "/proc/sys/kernel/watchdog_cpumask"

# a process of the host: named, with threads, acting on its own affinity when asked
CHILD = program(r"""
import os, sys, threading
name_self(sys.argv[1])
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
    elif cmd == "bind":
        import json, socket
        path, _, body = arg.partition(" ")
        raw = body.encode()
        with socket.socket(socket.AF_UNIX) as sk:
            sk.connect(path)
            sk.sendall(b"POST /v1/bind HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                       b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(raw) + raw)
            answer = b""
            while True:
                chunk = sk.recv(65536)
                if not chunk:
                    break
                answer += chunk
        head, _, rest = answer.partition(b"\r\n\r\n")
        print(json.dumps({"code": int(head.split()[1]), "body": json.loads(rest or b"null")}), flush=True)
    elif cmd == "fork":
        import subprocess
        p = subprocess.Popen([sys.executable, "-c", sys.argv[3], sys.argv[1] + "_c", "1", sys.argv[3]],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        print(p.stdout.readline().strip(), flush=True)
""")


# what ``run`` execs the CHILD script with (stdlib only): an interpreter every user may execute,
# where this checkout's may sit under a directory only root can search
CHILD_PYTHON = next((p for p in ("/usr/bin/python3", "/usr/local/bin/python3") if os.access(p, os.X_OK)),
                    sys.executable)


def as_user(uid: int | None) -> list[str]:
    """The argv prefix that runs a command as ``uid`` with only its own group (none: as we are)."""
    return [] if uid is None else ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]


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

    def op_daemon(self, env: dict, config: str = "", listed: bool = False) -> dict:
        with open(self.config, "w") as fh:
            fh.write(config)
        if listed:
            env = {**env, "ASCENDBIND_NPU_SMI": self._listing_npu_smi()}
        full = base_env(os.path.join(self.tmp, "ascendbind.sock"), os.path.join(self.tmp, "state"), free_port(),
                        ASCENDBIND_FAKE_NPUS="2", ASCENDBIND_FAKE_NPU_AFFINITY=";".join(map(str, NPU_CPUS)),
                        ASCENDBIND_IRQBALANCE="warn", ASCENDBIND_CONFIG=self.config, **env)
        self.daemon = DaemonProc(self.tmp, full)
        self.daemon.start()
        self.daemon.wait_discovered()
        return {"pid": self.daemon.pid}

    def _listing_npu_smi(self) -> str:
        """An npu-smi wrapper whose process table lists what ``op_list`` last wrote."""
        self.op_list("")
        wrapper = os.path.join(self.tmp, "npu-smi")
        with open(wrapper, "w") as fh:
            fh.write(f"#!{sys.executable}\nimport os, sys\nwith open({self.listed!r}) as fh:\n"
                     "    os.environ['ASCENDBIND_FAKE_NPU_PIDS'] = ','.join(fh.read().split())\n"
                     f"os.execv(sys.executable, [sys.executable, {str(FIXTURE_BIN / 'npu-smi')!r}, *sys.argv[1:]])\n")
        os.chmod(wrapper, 0o755)
        return wrapper

    @property
    def listed(self) -> str:
        return os.path.join(self.tmp, "listed")

    def op_list(self, items: str) -> dict:
        with open(self.listed + ".new", "w") as fh:
            fh.write(items)
        os.replace(self.listed + ".new", self.listed)  # never a half-written table
        return {}

    def op_open_socket(self) -> dict:
        os.chmod(self.tmp, 0o755)
        os.chmod(self.daemon.sock, 0o666)
        return {}

    def op_ask_bind(self, pid: int, body: dict) -> dict:
        return json.loads(self._ask(pid, f"bind {self.daemon.sock} {json.dumps(body)}"))

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

    def op_spawn(self, comm: str, threads: int = 0, uid: int | None = None) -> dict:
        t0 = time.monotonic()
        p = subprocess.Popen([*as_user(uid), sys.executable, "-c", CHILD, comm, str(threads), CHILD],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        pid = int(p.stdout.readline())
        self.children[pid], self.started[pid] = p, t0
        return {"pid": pid}

    def op_run(self, comm: str, npu: int, uid: int | None = None) -> dict:
        """``ascendbind run --npu NPU -- <a process named comm>`` in the background (as ``uid``):
        its child binds itself, then execs the process, which answers like a ``spawn``'s
        (same pid: the exec keeps it). ``run`` itself is ``run_pid``."""
        t0 = time.monotonic()
        p = subprocess.Popen([*as_user(uid), sys.executable, "-m", "ascendbind", "run", "--npu", str(npu),
                              "--socket", self.daemon.sock, "--", CHILD_PYTHON, "-c", CHILD, comm, "0", CHILD],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=self.daemon.env)
        line = p.stdout.readline()
        if not line.strip():
            p.kill()
            raise RuntimeError(f"ascendbind run did not start its command: {p.communicate(timeout=10)[1][-2000:]}")
        pid = int(line)
        self.children[pid], self.started[pid] = p, t0
        return {"pid": pid, "run_pid": p.pid}

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

"""What a hostile local user or container costs everyone else, attack by attack.

    .venv/bin/python bench/attacks.py [--seconds 20] [--only hog,ranges,...] [--before DIR] [--json PATH]

Starts ``ascendbind serve`` from this checkout (and, with ``--before DIR``, from
that checkout too, e.g. a worktree of an older commit: each attack then runs
against both, side by side) on the fake host with two NPUs, then for each
attack, for ``--seconds``:

* ``hog``      uid 65534 keeps 8 binds waiting on npu-smi's process table, which hangs;
* ``ranges``   a uid 65534 worker whose ASCEND_VISIBLE_DEVICES is 128 KiB of
               ``0-4096`` ranges binds itself over 8 connections, again and again;
* ``environ``  a uid 65534 worker rewrites its environment (through /proc/self/mem)
               into one ASCEND_VISIBLE_DEVICES of 5.85 MB of ranges and binds
               itself over 8 connections;
* ``fuse``     root in a PID namespace of its own (as in a container) binds, over 4
               connections, a worker (its own mount and PID namespaces) whose /dev
               is a FUSE mount nobody serves.

Meanwhile a prober times, every quarter second: root's ``/healthz``; uid
65533's ``/healthz``; uid 65533's bind and release of its own process on NPU 1.
The daemon's peak RSS is sampled; at the end SIGTERM is sent while the attack
still runs, and the time to exit measured (killed after 30 s). Prints one row
per attack. Goal: every probe under 1 s, RSS under 200 MB, exit under 5 s.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.common import write_json  # noqa: E402
from tests.daemon_harness import base_env, free_port, wait_for  # noqa: E402
from tests.hanging_tool import HangingNpuSmi  # noqa: E402

PY = shutil.which("python3", path="/usr/bin:/bin") or sys.executable
NOBODY = ["setpriv", "--regid=65534", "--clear-groups", "--reuid=65534"]
OTHER = ["setpriv", "--regid=65533", "--clear-groups", "--reuid=65533"]

# stdlib only: these run as other uids from a world-readable copy
_LIB = r'''
import json, os, socket, sys, threading, time

def ask(path, method, target, body=None, timeout=120):
    data = b"" if body is None else json.dumps(body).encode()
    req = (f"{method} {target} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(data)}\r\n\r\n").encode() + data
    t0 = time.monotonic()
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect(path)
        s.sendall(req)
        raw = b""
        while chunk := s.recv(65536):
            raw += chunk
    except OSError as exc:
        return None, time.monotonic() - t0
    finally:
        s.close()
    try:
        return int(raw.split(b" ", 2)[1]), time.monotonic() - t0
    except (IndexError, ValueError):
        return None, time.monotonic() - t0

def hammer(path, n, target, body):
    def loop():
        while True:
            ask(path, "POST" if body is not None else "GET", target, body)
    for _ in range(n):
        threading.Thread(target=loop, daemon=True).start()
    print("attacking", flush=True)
    sys.stdin.read()
'''

_PROBE = r'''
import subprocess
path = sys.argv[1]
child = subprocess.Popen(["sleep", "3600"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
while True:
    line = sys.stdin.readline()
    if not line:
        break
    st, h = ask(path, "GET", "/healthz", timeout=60)
    sb, b = ask(path, "POST", "/v1/bind", {"pid": child.pid, "npu": int(sys.argv[2])}, timeout=60)
    ask(path, "POST", "/v1/release", {"pid": child.pid}, timeout=60)
    print(json.dumps({"healthz": [st, round(h, 4)], "bind": [sb, round(b, 4)]}), flush=True)
child.kill()
'''

_SELF_BIND = r'''
hammer(sys.argv[1], int(sys.argv[2]), "/v1/bind", json.loads(sys.argv[3]))
'''

_HUGE_ENVIRON = r'''
import resource
if os.environ.get("HUGE_STAGE") != "2":
    resource.setrlimit(resource.RLIMIT_STACK, (64 << 20, 64 << 20))
    env = {"HUGE_STAGE": "2"}
    for i in range(46):  # 46 strings of 127 KiB: about 5.85 MB of environment
        env[f"PAD{i:02d}"] = "x" * (127 * 1024)
    os.execve(sys.executable, [sys.executable, *sys.argv], env)
with open("/proc/self/stat") as fh:
    fields = fh.read().rpartition(")")[2].split()
start, end = int(fields[45]), int(fields[46])  # env_start, env_end
with open("/proc/self/mem", "r+b", buffering=0) as mem:
    mem.seek(start)
    head = b"ASCEND_VISIBLE_DEVICES="
    body = b"0-4096," * ((end - start - len(head) - 1) // 7)
    mem.write(head + body + b"\0" * (end - start - len(head) - len(body)))
hammer(sys.argv[1], int(sys.argv[2]), "/v1/bind", {"npu": 0})
'''


class Daemon:
    def __init__(self, checkout: str, directory: str, **env: str) -> None:
        self.dir = directory
        self.env = base_env(os.path.join(directory, "s.sock"), os.path.join(directory, "state"), free_port(),
                            PYTHONPATH=checkout, ASCENDBIND_FAKE_NPUS="2", **env)
        self.sock = self.env["ASCENDBIND_SOCKET"]
        self.checkout = checkout
        self.proc: subprocess.Popen | None = None

    def start(self) -> "Daemon":
        self.log = open(os.path.join(self.dir, "daemon.log"), "a")
        self.proc = subprocess.Popen([sys.executable, "-m", "ascendbind.cli", "serve"], cwd=self.checkout,
                                     env=self.env, stdout=self.log, stderr=subprocess.STDOUT)
        ok = wait_for(lambda: os.path.exists(self.sock) and _status(self.sock, "/healthz") == 200, 30)
        assert ok, "daemon did not start"
        os.chmod(self.sock, 0o666)
        return self

    def rss_mb(self) -> float:
        with open(f"/proc/{self.proc.pid}/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        return 0.0

    def sigterm(self) -> float | None:
        """Seconds from SIGTERM to exit; None when it had to be killed after 30 s."""
        t0 = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
            took = round(time.monotonic() - t0, 2)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            took = None
        self.log.close()
        return took


def _status(sock: str, target: str) -> int | None:
    ns: dict = {}
    exec(_LIB, ns)
    return ns["ask"](sock, "GET", target, timeout=10)[0]


def _script(scratch: str, name: str, body: str) -> str:
    path = os.path.join(scratch, name)
    with open(path, "w") as fh:
        fh.write(_LIB + body)
    os.chmod(path, 0o644)
    return path


def _start_attack(name: str, scratch: str, daemon: Daemon, fake: HangingNpuSmi,
                  stack: contextlib.ExitStack) -> subprocess.Popen | None:
    def nobody(script: str, *args: str, env: dict | None = None) -> subprocess.Popen:
        return subprocess.Popen([*NOBODY, PY, script, daemon.sock, *args], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True, cwd=scratch, env=env or {"PATH": "/usr/bin:/bin"})

    if name == "hog":
        fake.hang("info")  # binds that name no NPU wait on the process table
        return nobody(_script(scratch, "hog.py", _SELF_BIND), "8", "{}")
    if name == "ranges":
        # just under execve's limit of 128 KiB for one string
        env = {"PATH": "/usr/bin:/bin", "ASCEND_VISIBLE_DEVICES": ",".join(["0-4096"] * ((128 * 1024 - 32) // 7))}
        return nobody(_script(scratch, "ranges.py", _SELF_BIND), "8", '{"npu": 0}', env=env)
    if name == "environ":
        return nobody(_script(scratch, "environ.py", _HUGE_ENVIRON), "8")
    if name == "fuse":
        from tests.hostile_workers import unserved_fuse_dev

        w = stack.enter_context(unserved_fuse_dev())
        # root in a PID namespace of its own, as in a container, binds that worker again and again
        return subprocess.Popen(["unshare", "--pid", "--fork", PY, _script(scratch, "fuse.py", _SELF_BIND),
                                 daemon.sock, "4", json.dumps({"pid": w.pid, "npu": 0})],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=scratch)
    raise SystemExit(f"unknown attack {name!r}")


def run_attack(name: str, checkout: str, seconds: float) -> dict:
    scratch = tempfile.mkdtemp(prefix=f"ascendbind-attack-{name}-", dir="/tmp")
    os.chmod(scratch, 0o755)
    fake = HangingNpuSmi(scratch)
    # the hung-table attack runs on the hanging fake (one NPU: the prober binds NPU 0, which the
    # attacker's binds never reach); the others on the fixture's two NPUs (attacker 0, prober 1)
    hog = name == "hog"
    extra = {"ASCENDBIND_NPU_SMI": str(fake.path)} if hog else {}
    daemon = Daemon(checkout, scratch, ASCENDBIND_COMMAND_TIMEOUT_SECONDS="60", **extra).start()
    attacker = probe = None
    rss = [daemon.rss_mb()]
    stack = contextlib.ExitStack()
    try:
        # one bind first, so that the host's cached lookups (the NPU's board and IRQs) are made
        # before an attack can hang npu-smi: the attacks hang only what they name
        warm = subprocess.Popen(["sleep", "60"])
        ns_warm: dict = {}
        exec(_LIB, ns_warm)
        ns_warm["ask"](daemon.sock, "POST", "/v1/bind", {"pid": warm.pid, "npu": 0}, timeout=60)
        ns_warm["ask"](daemon.sock, "POST", "/v1/release", {"pid": warm.pid}, timeout=60)
        warm.kill()
        warm.wait()
        attacker = _start_attack(name, scratch, daemon, fake, stack)
        if attacker is not None:
            assert attacker.stdout.readline().strip() == "attacking", f"{name}: the attacker did not start"
        probe = subprocess.Popen([*OTHER, PY, _script(scratch, "probe.py", _PROBE), daemon.sock, "0" if hog else "1"],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=scratch)
        root_healthz, other_healthz, other_bind = [], [], []
        ns: dict = {}
        exec(_LIB, ns)
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            st, took = ns["ask"](daemon.sock, "GET", "/healthz", timeout=60)
            root_healthz.append(took if st == 200 else float("inf"))
            probe.stdin.write("go\n")
            probe.stdin.flush()
            line = json.loads(probe.stdout.readline())
            other_healthz.append(line["healthz"][1] if line["healthz"][0] == 200 else float("inf"))
            other_bind.append(line["bind"][1] if line["bind"][0] == 200 else float("inf"))
            if line["bind"][0] != 200:
                print(f"{name}: uid 65533's bind answered {line['bind'][0]} after {line['bind'][1]} s",
                      file=sys.stderr)
            rss.append(daemon.rss_mb())
            time.sleep(0.25)  # the probe's period, not a synchronisation
        exit_s = daemon.sigterm()
    finally:
        for p in (probe, attacker):
            if p is None:
                continue
            try:
                p.stdin.close()  # the probe kills its child and exits; the attacker exits
                p.wait(10)
            except (OSError, subprocess.TimeoutExpired):
                p.kill()
                p.wait()
        stack.close()
        fake.answer()
        if daemon.proc.poll() is None:
            daemon.proc.kill()
            daemon.proc.wait()
        shutil.rmtree(scratch, ignore_errors=True)
    return {"attack": name, "probes": len(root_healthz), "root_healthz_max_s": round(max(root_healthz), 3),
            "other_healthz_max_s": round(max(other_healthz), 3), "other_bind_max_s": round(max(other_bind), 3),
            "rss_peak_mb": round(max(rss), 1), "sigterm_exit_s": exit_s}


ATTACKS = ("hog", "ranges", "environ", "fuse")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--only", default=",".join(ATTACKS))
    ap.add_argument("--before", help="another ascendbind checkout to attack the same way, first")
    ap.add_argument("--json")
    args = ap.parse_args()
    rows = []
    checkouts = [("before", os.path.abspath(args.before))] if args.before else []
    checkouts.append(("this", ROOT))
    for name in args.only.split(","):
        for which, checkout in checkouts:
            rows.append({"checkout": which, **run_attack(name, checkout, args.seconds)})
            r = rows[-1]
            print(f"{which:6s} {r['attack']:8s} probes {r['probes']:3d}  root /healthz max {r['root_healthz_max_s']:7.3f} s  "
                  f"uid 65533 /healthz max {r['other_healthz_max_s']:7.3f} s  bind max {r['other_bind_max_s']:7.3f} s  "
                  f"RSS peak {r['rss_peak_mb']:6.1f} MB  SIGTERM->exit {r['sigterm_exit_s']} s", flush=True)
    write_json(args.json, {"before": args.before, "seconds": args.seconds, "attacks": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The units under the real systemd as PID 1: activation, notify, watchdog, restart, reload, stop, hardening.

One container per module (tests/systemd_harness.py): this machine's systemd
booted over a tmpfs root. Inside it, exactly what a new user does: the units
``make install-service ASCENDBIND=/opt/ascendbind/bin/ascendbind`` writes (the
checkout installed with the distribution's Python under /opt), then
``systemctl enable --now ascendbind.socket``. The daemon's config
(/etc/ascendbind/config.toml) names the fake one-NPU npu-smi of fixtures/bin.

This machine has no NPU, so no interrupt is called ``sq_send_trigger_irq``:
``proc_root`` is a small tree whose ``interrupts`` is this machine's with two
real, writable IRQs renamed into the NPU's SQ and CQ, whose ``irq`` and ``sys``
are links to the real /proc/irq and /proc/sys, and where each worker's pid is
a link to its real /proc entry; ``sys_root`` gives the fake NPU's PCI address
those two MSI IRQs. Every mask the daemon writes is a real
/proc/irq/<n>/smp_affinity, read back here; the module puts every IRQ mask
back as it found it.

Each test starts from the socket listening and the service stopped, and waits
for what systemd reports (``systemctl show``), never for a fixed time. Only
the watchdog test shortens ``WatchdogSec=`` (60 s in the unit) with a drop-in,
which it removes again.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import runpy
import shutil
import socket
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from ascendbind.client import Client
from ascendbind.errors import PlanImpossible
from ascendbind.discovery.parse.irqs import parse_interrupts
from tests.builders import write_once
from tests.daemon_harness import free_port, metric_value
from tests.hanging_tool import HangingNpuSmi
from tests.irqbalance_harness import irq_masks, restore_irq_masks
from tests import debian_roots
from tests.deploy_tools import missing
from tests.systemd_harness import OPT, ROOT, booted, need_tools, opt_venv
from tests.test_daemon_systemd_units import MAX_EXPOSURE

SRC, TEST = "/srv/ascendbind-src", "/srv/ascendbind-test"
SOCK = "/run/ascendbind/ascendbind.sock"
STATE = "/var/lib/ascendbind"
UNIT = "ascendbind.service"
WATCHDOG_SEC = 5
CAPS = {"CAP_SYS_NICE", "CAP_SYS_PTRACE", "CAP_DAC_OVERRIDE", "CAP_NET_ADMIN"}


def _fake_npu_pci() -> str:
    """The PCI address fixtures/bin/npu-smi gives its NPU 0 (one this machine does not have)."""
    return runpy.run_path(str(ROOT / "fixtures" / "bin" / "npu-smi"), run_name="fake_npu_smi")[
        "absent_pci_address"](0).lower()


def _writable_irqs(n: int = 2) -> list[int]:
    """IRQs of this machine whose mask takes a write (managed ones refuse) and whose name is one word."""
    with open("/proc/interrupts") as fh:
        names = dict(parse_interrupts(fh.read()))
    found = []
    for irq, mask in sorted(irq_masks().items()):
        if " " in names.get(irq, " ") or irq not in names:
            continue
        try:
            write_once(f"/proc/irq/{irq}/smp_affinity", mask)
        except OSError:
            continue
        found.append(irq)
        if len(found) == n:
            return found
    pytest.fail(f"this machine has fewer than {n} IRQs whose mask can be written: {found}")


def _trees(base: Path, sq: int, cq: int) -> None:
    proc, sys_ = base / "proc", base / "sys"
    proc.mkdir(parents=True)
    (proc / "irq").symlink_to("/proc/irq")
    (proc / "sys").symlink_to("/proc/sys")
    lines = []
    with open("/proc/interrupts") as fh:
        for line in fh:
            head = line.split(":", 1)[0].strip()
            if head in (str(sq), str(cq)):
                line = line.rstrip("\n").rsplit(None, 1)[0] + ("   sq_send_trigger_irq\n" if head == str(sq)
                                                             else "   cq_update_irq\n")
            lines.append(line)
    (proc / "interrupts").write_text("".join(lines))
    names = dict(parse_interrupts((proc / "interrupts").read_text()))
    assert (names[sq], names[cq]) == ("sq_send_trigger_irq", "cq_update_irq")
    for name in ("devices", "fs"):
        (sys_ / name).parent.mkdir(parents=True, exist_ok=True)
        (sys_ / name).symlink_to(f"/sys/{name}")
    msi = sys_ / "bus" / "pci" / "devices" / _fake_npu_pci() / "msi_irqs"
    msi.mkdir(parents=True)
    for irq in (sq, cq):
        (msi / str(irq)).write_text("msi\n")


class Host:
    """The booted container, its files as the test writes them, and the two IRQs."""

    def __init__(self, c, directory: Path, irqs: list[int]) -> None:
        self.c, self.dir, self.irqs = c, directory, irqs
        self.port = free_port()
        self.config = directory / "etc" / "config.toml"
        self.client = Client(c.path(SOCK), timeout=60)

    def base_config(self, **overrides) -> str:
        keys = {"npu_smi": f"{SRC}/fixtures/bin/npu-smi", "proc_root": f"{TEST}/proc", "sys_root": f"{TEST}/sys",
                "metrics_listen": f"127.0.0.1:{self.port}", "reconcile_seconds": 1, "small_pool": "share"}
        keys.update(overrides)
        return "".join(f"{k} = {json.dumps(v)}\n" for k, v in keys.items())

    def write_config(self, text: str) -> None:
        tmp = self.config.with_suffix(".new")
        tmp.write_text(text)
        tmp.replace(self.config)

    def start(self) -> dict:
        """Connect, as the first client does (socket activation), and wait for the service."""
        assert self.client.health()["status"] in ("ok", "degraded")
        return self.c.wait_unit(UNIT, ActiveState="active", SubState="running")

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=30) as resp:
            return resp.read().decode()

    def irq_mask(self, irq: int) -> str:
        return Path(f"/proc/irq/{irq}/smp_affinity").read_text().strip()

    @contextlib.contextmanager
    def worker(self, **kw):
        with self.c.worker(**kw) as w:
            link = self.dir / "test" / "proc" / str(w.guest_pid)
            link.symlink_to(f"/proc/{w.guest_pid}")
            try:
                yield w
            finally:
                link.unlink()


@pytest.fixture(scope="module", params=[None, "bullseye"], ids=["this-systemd", "debian11-systemd247"])
def host(request):
    """This machine's systemd, then Debian 11's (247, the oldest the units are meant for) with
    its Python 3.9 and the dependencies at their lower bounds (tests/debian_roots.py)."""
    need_tools()
    os_root = None
    if request.param is None:
        venv = opt_venv()
    else:
        if shutil.which("mmdebstrap") is None:
            missing("mmdebstrap")
        os_root = debian_roots.prepare(request.param)
        venv = debian_roots.opt_venv(request.param)
    saved = irq_masks()
    irqs = _writable_irqs()
    directory = Path(tempfile.mkdtemp(prefix="ascendbind-systemd-", dir="/tmp"))
    try:
        (directory / "etc").mkdir()
        _trees(directory / "test", *irqs)
        binds = [(str(venv), OPT, True), (str(ROOT), SRC, True), (str(directory / "test"), TEST, False),
                 (str(directory / "etc"), "/etc/ascendbind", False)]
        with booted(directory, binds, os_root) as c:
            h = Host(c, directory, irqs)
            h.saved = {irq: saved[irq] for irq in irqs}
            h.write_config(h.base_config())
            c.run(["make", "-s", "-C", SRC, "install-service", f"ASCENDBIND={OPT}/bin/ascendbind",
                   "DOCDIR=/run/ascendbind-doc"])
            c.run(["systemctl", "enable", "--now", "ascendbind.socket"])
            yield h
    finally:
        restore_irq_masks(saved)
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(autouse=True)
def stopped(host):
    """Each test: the socket listening, the service stopped, the shipped config, no drop-in."""
    c = host.c
    dropin = Path(c.path(f"/etc/systemd/system/{UNIT}.d"))
    if dropin.exists():
        shutil.rmtree(dropin)
        c.run(["systemctl", "daemon-reload"])
    host.write_config(host.base_config())
    c.run(["systemctl", "stop", UNIT])
    c.run(["systemctl", "reset-failed", UNIT], check=False)
    restore_irq_masks(host.saved)  # the host's own masks, whatever a test before left
    c.wait_unit("ascendbind.socket", ActiveState="active", SubState="listening")
    c.wait_unit(UNIT, ActiveState="inactive")
    yield
    if host.c.show(UNIT, "ActiveState")["ActiveState"] == "active":
        host.client.release(all=True)


def _bind(host, w) -> dict:
    body = host.client.bind(w.guest_pid, 0)
    steps = {s["step"]: s for s in body["steps"]}
    assert steps["affinity"]["outcome"] == "applied", steps
    assert steps["irq"]["outcome"] == "applied", steps["irq"]  # real /proc/irq writes, under the unit
    return body


# ---------------------------------------------------------------- activation and notify


def test_the_first_connect_starts_the_service_which_reports_ready_and_its_status(host):
    c = host.c
    assert c.show(UNIT, "ActiveState", "MainPID") == {"ActiveState": "inactive", "MainPID": "0"}
    health = host.client.health()  # queued on systemd's socket until the daemon takes it
    assert health["workers"] == 0, health
    # Type=notify: "active" only once READY=1 came, and STATUS= is what the daemon said
    state = c.wait_unit(UNIT, ActiveState="active", SubState="running")
    assert state["StatusText"].startswith("serving"), state
    assert c.run(["systemctl", "is-active", UNIT]).stdout.strip() == "active"
    serving = [json.loads(line) for line in c.journal(UNIT).splitlines() if '"ascendbind serving"' in line]
    assert serving[-1]["via"] == "systemd" and serving[-1]["socket"] == SOCK, serving
    assert "disabled" not in serving[-1]["hotplug"], serving[-1]


# ---------------------------------------------------------------- watchdog, kill -9


def test_a_stopped_daemon_is_killed_by_the_watchdog_and_restarted(host):
    c = host.c
    dropin = Path(c.path(f"/etc/systemd/system/{UNIT}.d"))
    dropin.mkdir()
    (dropin / "watchdog.conf").write_text(f"[Service]\nWatchdogSec={WATCHDOG_SEC}s\n")
    c.run(["systemctl", "daemon-reload"])
    before = host.start()
    # a healthy daemon pings: systemd records each WATCHDOG=1
    first = c.show(UNIT, "WatchdogTimestampMonotonic")["WatchdogTimestampMonotonic"]
    c.wait_unit(UNIT, timeout=3 * WATCHDOG_SEC, WatchdogTimestampMonotonic=lambda v: v != first)
    stopped_at = time.monotonic()
    _stop(c, before["MainPID"])
    after = c.wait_unit(UNIT, timeout=60, ActiveState="active", SubState="running",
                        NRestarts=str(int(before["NRestarts"]) + 1))
    assert after["MainPID"] != before["MainPID"]
    assert time.monotonic() - stopped_at < WATCHDOG_SEC + 30
    assert f"Watchdog timeout (limit {WATCHDOG_SEC}s)!" in c.journal(UNIT)


def _stop(c, pid: str) -> None:
    """SIGSTOP the daemon and wait until every one of its threads is stopped (the signal
    arrives at each thread on its own: until then one could still accept a connection)."""
    c.run(["kill", "-STOP", pid])
    task = c.path(f"/proc/{pid}/task")

    def all_stopped() -> bool:
        states = []
        for tid in os.listdir(task):
            with contextlib.suppress(OSError):
                states.append(Path(f"{task}/{tid}/stat").read_text().rpartition(")")[2].split()[0])
        return bool(states) and all(st in ("T", "t") for st in states)

    _wait_until(all_stopped, 30, f"every thread of {pid} stopped")


def _queue_requests(path: str, n: int) -> list[socket.socket]:
    conns = []
    for _ in range(n):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(60)
        s.connect(path)
        s.sendall(b"GET /v1/workers HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        conns.append(s)
    return conns


def _answer(s: socket.socket) -> tuple[int, dict]:
    data = b""
    with s:
        while chunk := s.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def test_kill_9_restarts_the_daemon_which_answers_the_queued_connections_and_binds_nothing_twice(host):
    c = host.c
    before = host.start()
    originals = {irq: host.irq_mask(irq) for irq in host.irqs}
    with host.worker(plain=2) as w:
        body = _bind(host, w)
        bound = w.cpus_allowed()
        pinned = {irq: host.irq_mask(irq) for irq in host.irqs}
        assert pinned != originals, "the IRQ step changed no mask: the test could not fail"
        # connections made while the daemon cannot accept wait in the socket's queue
        _stop(c, before["MainPID"])
        queued = _queue_requests(c.path(SOCK), 3)
        c.run(["kill", "-KILL", before["MainPID"]])
        after = c.wait_unit(UNIT, ActiveState="active", SubState="running",
                            NRestarts=str(int(before["NRestarts"]) + 1))
        assert after["MainPID"] != before["MainPID"]
        for s in queued:
            status, answer = _answer(s)
            assert status == 200 and [x["pid"] for x in answer["workers"]] == [w.guest_pid], answer
        # restored from the state file, not bound again: no step ran, the masks are untouched
        text = host.metrics()
        assert metric_value(text, "ascendbind_bound_workers") == 1
        assert metric_value(text, "ascendbind_steps_total", step="affinity", outcome="applied") == 0
        assert w.cpus_allowed() == bound
        assert {irq: host.irq_mask(irq) for irq in host.irqs} == pinned
        assert host.client.worker(w.guest_pid)["plan"]["npus"] == body["plan"]["npus"]
        released = host.client.release(w.guest_pid)
        assert sorted(released["irqs_restored"]) == sorted(host.irqs)
    # the masks saved at the first bind were the host's own, not the pinned ones
    assert {irq: host.irq_mask(irq) for irq in host.irqs} == originals


# ---------------------------------------------------------------- reload


def _journal_has(host, text: str, after: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if text in host.c.journal(UNIT)[after:]:
            return
        time.sleep(0.1)
    raise AssertionError(f"no {text!r} in the journal:\n{host.c.journal(UNIT)[after:][-3000:]}")


def test_reload_applies_a_good_config_and_keeps_the_running_one_on_a_bad_file(host):
    c = host.c
    pid = host.start()["MainPID"]
    with host.worker(plain=1, acl=0, release=0) as w:
        host.client.bind(w.guest_pid, 0)  # small_pool = "share": roles share this machine's CPUs
        host.client.release(w.guest_pid)
        mark = len(c.journal(UNIT))
        host.write_config(host.base_config(small_pool="fail"))
        c.run(["systemctl", "reload", UNIT])
        _journal_has(host, "SIGHUP: config reloaded", mark)
        with pytest.raises(PlanImpossible) as refused:  # a pool below the role minimum, now an error
            host.client.bind(w.guest_pid, 0)
        assert refused.value.code == "pool_too_small"

        mark = len(c.journal(UNIT))
        host.write_config(host.base_config(small_pool="share") + "no_such_key = 1\n")
        c.run(["systemctl", "reload", UNIT])
        _journal_has(host, "config not reloaded; keeping the running one", mark)
        assert c.show(UNIT, "ActiveState", "MainPID") == {"ActiveState": "active", "MainPID": pid}
        with pytest.raises(PlanImpossible) as refused:  # the running config: still "fail"
            host.client.bind(w.guest_pid, 0)
        assert refused.value.code == "pool_too_small"


# ---------------------------------------------------------------- stop


def test_stop_kills_a_hanging_tool_leaves_no_process_and_the_bindings_in_place(host):
    c = host.c
    # the fake records its runs next to itself: in the one directory the unit lets the daemon
    # (and so its tools) write, the state directory
    Path(c.path(STATE)).mkdir(mode=0o700, exist_ok=True)
    fake = HangingNpuSmi(c.path(STATE), seen_at=STATE)
    host.write_config(host.base_config(npu_smi=str(fake.seen_path), command_timeout_seconds=120))
    host.start()
    with host.worker(plain=1) as w, host.worker(plain=1, acl=0, release=0) as other:
        _bind(host, w)
        bound, pinned = w.cpus_allowed(), {irq: host.irq_mask(irq) for irq in host.irqs}
        cgroup = c.show(UNIT, "ControlGroup")["ControlGroup"]
        fake.hang("info")  # the process table: asked for by a bind that names no NPU
        asking = threading.Thread(target=_try, args=(lambda: Client(c.path(SOCK), timeout=60).bind(other.guest_pid),))
        asking.start()
        try:
            _wait_until(lambda: fake.hung_runs() == 1, 30, "the hung npu-smi")
            assert fake.survivors(c.path("/proc")), "the hung run is not visible: the test could not fail"
            mark = len(c.journal(UNIT))
            started = time.monotonic()
            c.run(["systemctl", "stop", UNIT], timeout=60)
            took = time.monotonic() - started
        finally:
            asking.join(60)
        state = c.show(UNIT, "ActiveState", "Result", "MainPID")
        assert state == {"ActiveState": "inactive", "Result": "success", "MainPID": "0"}, state
        assert took < 20, f"stop took {took:.1f}s: TimeoutStopSec, not the daemon, ended it"
        # the unit's cgroup is gone or empty, wherever the container's systemd keeps it: the named
        # v1 hierarchy (a cgroup v1 host), the unified one beside it (hybrid), or cgroup v2's own
        for top in ("/sys/fs/cgroup/systemd", "/sys/fs/cgroup/unified", "/sys/fs/cgroup"):
            try:
                left = Path(c.path(f"{top}{cgroup}/cgroup.procs")).read_text()
            except FileNotFoundError:
                left = ""  # no such hierarchy there, or the cgroup already removed
            assert left == "", (top, left)
        assert fake.survivors(c.path("/proc")) == []
        log = c.journal(UNIT)[mark:]
        # the daemon reaped its tool itself: systemd found nothing left to SIGKILL
        assert "Killing process" not in log and "ascendbind stopped; bindings left in place" in log, log[-3000:]
        # documented: SIGTERM leaves every binding in place, IRQ masks included
        assert w.cpus_allowed() == bound
        assert {irq: host.irq_mask(irq) for irq in host.irqs} == pinned
        fake.answer()
        host.start()  # the state file brings the worker back, and release puts the IRQs back
        host.client.release(w.guest_pid)
    shutil.rmtree(fake.dir)


def _try(fn) -> None:
    with contextlib.suppress(Exception):
        fn()


def _wait_until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} after {timeout}s")
        time.sleep(0.05)


# ---------------------------------------------------------------- hardening


_PROBE = r"""
import json, os, sys
out = {}
for path in sys.argv[1:]:
    try:
        if "/proc/irq/" in path:
            with open(path) as fh:
                mask = fh.read().strip()
            fd = os.open(path, os.O_WRONLY)
            try:
                os.write(fd, mask.encode())
            finally:
                os.close(fd)
        else:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            os.close(fd)
            os.unlink(path)
        out[path] = "ok"
    except OSError as exc:
        out[path] = os.strerror(exc.errno)
print(json.dumps(out))
"""


def test_the_hardening_lets_the_daemon_write_irq_masks_and_its_state_and_nothing_else(host):
    c = host.c
    pid = int(host.start()["MainPID"])
    with host.worker(plain=1) as w:
        _bind(host, w)  # the IRQ step wrote real masks and the state file was written, by the daemon
        assert Path(c.path("/var/lib/ascendbind/state.json")).stat().st_mode & 0o777 == 0o600
    hp = c.host_pid(pid)
    irq = host.irqs[0]
    writable = [f"/proc/irq/{irq}/smp_affinity", "/var/lib/ascendbind/probe"]
    read_only = ["/etc/probe", "/etc/ascendbind/probe", "/opt/ascendbind/probe", f"{TEST}/probe", "/srv/probe",
                 "/var/lib/probe", "/var/probe", "/run/probe", "/run/ascendbind/probe", "/usr/probe"]
    hidden = ["/root/probe", "/home/probe"]
    # the probe runs with the daemon's file system view (its mount namespace), as root
    r = c.run(["nsenter", f"--target={pid}", "--mount", "--", "/usr/bin/python3", "-c", _PROBE,
               *writable, *read_only, *hidden])
    seen = json.loads(r.stdout)
    assert {p: seen[p] for p in writable} == {p: "ok" for p in writable}, seen
    assert {p: seen[p] for p in read_only} == {p: "Read-only file system" for p in read_only}, seen
    assert all(seen[p] in ("Permission denied", "No such file or directory", "Read-only file system")
               for p in hidden), seen
    # and the container's own view of those places is writable: the unit made the difference
    assert json.loads(c.run(["/usr/bin/python3", "-c", _PROBE, f"{TEST}/probe", "/run/probe"]).stdout) == \
        {f"{TEST}/probe": "ok", "/run/probe": "ok"}

    status = Path(f"/proc/{hp}/status").read_text()
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    assert _caps(fields["CapBnd"]) == CAPS and _caps(fields["CapEff"]) == CAPS, fields["CapBnd"]
    assert fields["NoNewPrivs"].strip() == "1" and fields["Seccomp"].strip() == "2"

    security = c.run(["systemd-analyze", "security", "--no-pager", UNIT], check=False).stdout
    m = re.search(r"Overall exposure level for ascendbind\.service:\s*([0-9.]+)", security)
    assert m, security
    print(f"\nsystemd-analyze security {UNIT} (live, systemd as PID 1): exposure {m.group(1)}")
    assert float(m.group(1)) <= MAX_EXPOSURE


_CAP_NAMES = {23: "CAP_SYS_NICE", 19: "CAP_SYS_PTRACE", 1: "CAP_DAC_OVERRIDE", 12: "CAP_NET_ADMIN"}


def _caps(hexmask: str) -> set[str]:
    bits = int(hexmask.strip(), 16)
    return {_CAP_NAMES.get(b, f"cap{b}") for b in range(64) if bits >> b & 1}


def test_state_directory_and_fd_limit_are_what_the_daemon_sees(host):
    c = host.c
    pid = int(host.start()["MainPID"])
    hp = c.host_pid(pid)
    limits = Path(f"/proc/{hp}/limits").read_text()
    assert re.search(r"^Max open files\s+4096\s+4096\s+files", limits, re.M), limits
    environ = dict(e.split("=", 1) for e in Path(f"/proc/{hp}/environ").read_bytes().decode().split("\0") if "=" in e)
    assert environ["STATE_DIRECTORY"] == "/var/lib/ascendbind"
    st = os.stat(c.path("/var/lib/ascendbind"))
    assert (st.st_uid, st.st_mode & 0o777) == (0, 0o700)
    serving = [json.loads(line) for line in c.journal(UNIT).splitlines() if '"ascendbind serving"' in line]
    assert serving[-1]["state_dir"] == "/var/lib/ascendbind"
    # the daemon's own fd check found its limit enough: no warning to raise LimitNOFILE
    assert "raise LimitNOFILE" not in c.journal(UNIT)


# ---------------------------------------------------------------- older systemd

# The [Service] keys of the unit that systemd 240 did not know yet, with the version that
# brought each (systemd's NEWS); every other key of the unit is older (OLDER_KEYS). A systemd
# older than a key logs "Unknown key name" for it, ignores it and runs the unit: on Debian 11's
# 247 that is PrivateIPC= alone (the service then shares the host's System V IPC namespace).
KEY_SINCE = {"ProtectHostname": 242, "RestrictSUIDSGID": 242, "ProtectKernelLogs": 244, "PrivateIPC": 248}
OLDER_KEYS = {"Type", "NotifyAccess", "ExecStart", "ExecReload", "Restart", "RestartSec", "WatchdogSec",
              "TimeoutStopSec", "KillMode", "StateDirectory", "StateDirectoryMode", "UMask", "LimitNOFILE",
              "CapabilityBoundingSet", "NoNewPrivileges", "ProtectSystem", "ReadOnlyPaths", "ProtectHome",
              "PrivateTmp", "ProtectKernelModules", "ProtectControlGroups", "RestrictNamespaces", "RestrictRealtime",
              "LockPersonality", "MemoryDenyWriteExecute", "RemoveIPC", "KeyringMode", "RestrictAddressFamilies",
              "IPAddressDeny", "IPAddressAllow", "SystemCallArchitectures", "SystemCallFilter",
              "SystemCallErrorNumber"}


def test_every_key_of_the_unit_has_a_known_first_systemd():
    text = (ROOT / "systemd" / UNIT).read_text()
    service = text.split("[Service]", 1)[1].split("\n[", 1)[0]
    keys = set(re.findall(r"^([A-Za-z]+)=", service, re.M))
    assert keys == OLDER_KEYS | set(KEY_SINCE), (keys - OLDER_KEYS - set(KEY_SINCE), OLDER_KEYS | set(KEY_SINCE) - keys)


def test_a_key_this_systemd_does_not_know_is_logged_and_the_unit_runs(host, record_property):
    c = host.c
    version = int(c.run(["systemctl", "--version"]).stdout.split()[1])
    record_property("systemd", version)
    host.start()  # active, running: whatever this systemd did not know stopped nothing
    verify = c.run(["systemd-analyze", "verify", f"/etc/systemd/system/{UNIT}"], check=False)
    unknown = set(re.findall(rf"{re.escape(UNIT)}:\d+: Unknown key name '(\w+)'", verify.stdout + verify.stderr))
    assert unknown == {k for k, since in KEY_SINCE.items() if since > version}, (version, verify.stderr)
    print(f"\nsystemd {version}: keys logged as unknown and ignored: {sorted(unknown) or 'none'}")

"""A real Prometheus server (Debian's ``prometheus`` binary) for the alert tests.

    rules = compressed_rules(RULES, tmp / "rules.yml")      # the shipped rules, time compressed
    with running_prometheus(tmp, rules, {"ascendbind": ["127.0.0.1:9464"]}) as prom:
        prom.wait_alert("AscendbindDaemonDown", "firing")
        prom.wait_alert("AscendbindDaemonDown", None)       # resolved: no longer active
        prom.set_targets({"ascendbind": []})                # reload: that job has no target now

Time compression: the shipped rules think in minutes (``for: 5m``,
``increase(...[30m])``), which a test cannot wait out. ``compressed_rules``
writes a test-only copy in which every duration (each ``for:`` and every range
in an expression) is divided by ``SCALE``, and the server scrapes and evaluates
every ``INTERVAL_MS``: the same expressions over the same number of samples,
120 times faster. The shipped file is read, never written.

The server listens on a free loopback port, keeps its data in a temp
directory, and is killed and reaped on the way out, whatever happened.
"""

from __future__ import annotations

import contextlib
import http.server
import json
import re
import shutil
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import yaml

from tests.daemon_harness import free_port
from tests.deploy_tools import missing, running

SCALE = 120
# one scrape and one evaluation per "shipped" minute / SCALE (60 s / 120)
INTERVAL_MS = 500
_UNITS_MS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000, "w": 604_800_000,
             "y": 31_536_000_000}
_DURATION = re.compile(r"(\d+)(ms|s|m|h|d|w|y)")
_RANGE = re.compile(r"\[([0-9a-z:]+)\]")


def prometheus_binary() -> str:
    path = shutil.which("prometheus") or shutil.which("prometheus", path="/usr/bin")
    if path is None:
        missing("prometheus (Debian package prometheus)")
    return path  # type: ignore[return-value]


def prometheus_version(binary: str) -> str:
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30)
    return (out.stdout or out.stderr).splitlines()[0].strip()


def compress_duration(text: str) -> str:
    """A Prometheus duration divided by SCALE, in milliseconds ('5m' -> '1500ms')."""
    parts = _DURATION.findall(text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise ValueError(f"not a Prometheus duration: {text!r}")
    total = sum(int(n) * _UNITS_MS[u] for n, u in parts)
    return f"{max(1, total // SCALE)}ms"


def _compress_ranges(expr: str) -> str:
    # a range [10m] or a subquery [10m:1m]: every duration in the brackets
    return _RANGE.sub(lambda m: "[" + ":".join(compress_duration(p) if p else p for p in m.group(1).split(":"))
                      + "]", expr)


def compressed_rules(shipped: Path, out: Path) -> dict[str, dict]:
    """Write the time-compressed copy of ``shipped`` to ``out``; returns its alerts by name."""
    doc = yaml.safe_load(shipped.read_text())
    alerts = {}
    for group in doc["groups"]:
        if "interval" in group:
            group["interval"] = compress_duration(group["interval"])
        for rule in group["rules"]:
            rule["expr"] = _compress_ranges(rule["expr"])
            if "for" in rule:
                rule["for"] = compress_duration(rule["for"])
            if "alert" in rule:
                alerts[rule["alert"]] = rule
    out.write_text(yaml.safe_dump(doc, sort_keys=False))
    return alerts


class FakeNpuExporter:
    """What Ascend's NPU-Exporter says about the NPUs' processes (this machine has no NPU):
    ``npu_chip_info_process_info_num`` of one NPU, set by the test."""

    def __init__(self) -> None:
        self.processes = 0
        exporter = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                body = ("# TYPE npu_chip_info_process_info_num gauge\n"
                        f'npu_chip_info_process_info_num{{id="0"}} {exporter.processes}\n').encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.address = f"127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, name="fake-npu-exporter", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(10)


class Prometheus:
    def __init__(self, directory: Path, rules: Path, targets: dict[str, list[str]]) -> None:
        self.dir = directory
        self.binary = prometheus_binary()
        self.version = prometheus_version(self.binary)
        self.rules = rules
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.config = directory / "prometheus.yml"
        self._write_config(targets)
        self.log_path = directory / "prometheus.log"
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [self.binary, f"--config.file={self.config}", f"--storage.tsdb.path={directory / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--web.enable-lifecycle", "--log.level=warn"],
            stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT, cwd=str(directory))

    def _write_config(self, targets: dict[str, list[str]]) -> None:
        interval = f"{INTERVAL_MS}ms"
        config = {
            "global": {"scrape_interval": interval, "scrape_timeout": f"{INTERVAL_MS - 50}ms",
                       "evaluation_interval": interval},
            "rule_files": [str(self.rules)],
            # the node label the rules group by: the PodMonitor sets it in a cluster
            "scrape_configs": [{"job_name": job, "static_configs": [{"targets": addrs, "labels": {"node": "ci"}}]}
                               for job, addrs in targets.items()],
        }
        tmp = self.config.with_suffix(".tmp")
        tmp.write_text(yaml.safe_dump(config))
        tmp.replace(self.config)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def _get(self, path: str) -> dict:
        with urllib.request.urlopen(self.url + path, timeout=10) as resp:
            return json.loads(resp.read())

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited {self.proc.returncode}:\n{self.log()}")
            try:
                with urllib.request.urlopen(self.url + "/-/ready", timeout=5) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"prometheus not ready within {timeout}s:\n{self.log()}")

    def set_targets(self, targets: dict[str, list[str]]) -> None:
        """Scrape exactly these targets from now on (the lifecycle API reloads synchronously).

        To take a target away, keep its job with no address, as a PodMonitor that
        selects no pod does: Prometheus then marks the target's series stale. Dropping
        the whole job would not (2.42 stops that pool without staleness markers, so
        its ``up`` would linger for the 5-minute lookback)."""
        self._write_config(targets)
        req = urllib.request.Request(self.url + "/-/reload", method="POST")
        with urllib.request.urlopen(req, timeout=30) as resp:
            assert resp.status == 200

    def alerts(self) -> dict[str, str]:
        """Active alerts of the ascendbind rules: name -> 'pending' | 'firing'."""
        return {a["labels"]["alertname"]: a["state"] for a in self._get("/api/v1/alerts")["data"]["alerts"]}

    def rule_states(self) -> dict[str, str]:
        """Every alerting rule loaded: name -> 'inactive' | 'pending' | 'firing'."""
        return {r["name"]: r["state"] for g in self._get("/api/v1/rules")["data"]["groups"]
                for r in g["rules"] if r["type"] == "alerting"}

    def query(self, expr: str) -> list[dict]:
        return self._get("/api/v1/query?" + urllib.parse.urlencode({"query": expr}))["data"]["result"]

    def wait_alert(self, name: str, state: str | None, timeout: float = 60.0) -> float:
        """Poll /api/v1/alerts until ``name`` is in ``state`` (None: no longer active, i.e.
        resolved or never raised); returns the seconds it took."""
        started = time.monotonic()
        deadline = started + timeout
        seen = None
        while time.monotonic() < deadline:
            seen = self.alerts().get(name)
            if seen == state:
                return time.monotonic() - started
            time.sleep(0.05)
        raise AssertionError(f"{name} is {seen or 'inactive'}, not {state or 'resolved'}, after {timeout}s; "
                             f"active: {self.alerts()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._log.close()


@contextlib.contextmanager
def running_prometheus(directory: Path, rules: Path, targets: dict[str, list[str]]) -> Iterator[Prometheus]:
    prom = Prometheus(directory, rules, targets)
    with running(prom, prom.wait_ready, prom.stop):
        yield prom

"""A seeded fuzzer of the daemon's socket API: malformed and valid requests, checked replies.

    python -m tests.http_fuzz --socket S --requests 2000 --seed 7 --pid WORKER_PID

prints one JSON object of figures (requests, statuses, problems). Each request
is one connection: the bytes are sent, the write side is shut (so a truncated
request ends in EOF at once, never in a deadline), and the reply is read to
EOF. A reply is a *problem* when it has no status line, a 5xx other than 503
(busy, discovery) and 505 (HTTP version), a ``Content-Length`` that disagrees
with the body, no ``Connection: close``, or a body that is not JSON (``GET
/metrics`` answered 200, and bodiless answers to ``HEAD``, excepted).

Requests come from templates of every endpoint, then mutated: methods (unknown,
lower-case, garbage), targets (absolute-form, non-ASCII, spaces, very long,
query strings), versions (HTTP/1.0, 2.0, 0.9, malformed), line endings, header
sets (duplicate or bad ``Content-Length``, chunked, ``Expect``, folding, no
colon, too many, too large), bodies (random JSON with nulls, huge numbers,
floats, strings, nesting thousands deep; invalid UTF-8; non-JSON), and
truncation at a random byte. Pids in bodies are only ``--pid`` (a sacrificial
worker), pids that cannot exist, or absent (the fuzzer binds itself, which is
why it runs as its own process): a fuzzer must never bind a real process.
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import re
import socket
import sys
import time

ROUTES = ["/v1/bind", "/v1/release", "/v1/workers", "/v1/plan", "/healthz", "/metrics"]
METHODS = ["GET", "POST", "HEAD", "PUT", "DELETE", "PATCH", "OPTIONS", "TRACE", "CONNECT", "get", "post",
           "Get", "FOO", "G@T", "", "GET GET", "\x00", "\xffGET"]
VERSIONS = ["HTTP/1.1"] * 30 + ["HTTP/1.0"] * 5 + ["HTTP/1.0", "HTTP/2.0", "HTTP/0.9", "HTTP/3", "HTTP/1.2", "http/1.1", "HTTP/1",
                               "HTTP/11", "HTTP/1.1 extra", "", "HTTPS/1.1", "HTTP/1.1\x00", "HTTP/\xff.1"]
_STATUS_LINE = re.compile(rb"HTTP/1\.1 ([0-9]{3}) [^\r\n]*")


class Fuzz:
    def __init__(self, rng: random.Random, pid: int) -> None:
        self.rng, self.pid = rng, pid

    # ------------------------------------------------------------ JSON values

    def int_value(self) -> object:
        r = self.rng
        return r.choice([0, 1, -1, 3, 7, 63, 64, 65536, 2**31, 2**63, 10**30, -(10**20), True, False, None,
                         1.5, "0", "", [], {}, r.randrange(-5, 100)])

    def pid_value(self) -> object:
        # never a live pid other than the sacrificial worker's
        return self.rng.choice([self.pid] * 8 + [4194303, 4194304, 0, -1, 2**40, None, "self", 1.0, True,
                                [self.pid], {"pid": self.pid}])

    def json_value(self, depth: int = 0) -> object:
        r = self.rng
        kind = r.randrange(9 if depth < 4 else 5)
        if kind == 0:
            return None
        if kind == 1:
            return self.int_value()
        if kind == 2:
            return r.choice(["", "none", "best-effort", "single-numa-node", "x" * r.randrange(200), "\u00e9\u2603",
                             "\ud800" if r.random() < 0.1 else "ok"])
        if kind == 3:
            return r.choice([True, False, 0.0, -0.0, 1e308, float("inf"), float("nan")])
        if kind == 4:
            return r.randrange(-(2**70), 2**70)
        if kind in (5, 6):
            return [self.json_value(depth + 1) for _ in range(r.randrange(5))]
        return {self.key(): self.json_value(depth + 1) for _ in range(r.randrange(4))}

    def key(self) -> str:
        return self.rng.choice(["pid", "npu", "topology_policy", "all", "colour", "", "PID", "npu "])

    def body(self) -> bytes:
        r = self.rng
        roll = r.random()
        if roll < 0.5:  # a plausible bind/release body
            doc: dict = {}
            if r.random() < 0.8:
                doc["pid"] = self.pid_value()
            if r.random() < 0.95:  # without one the daemon runs npu-smi for the process table: slow
                doc["npu"] = r.choice([0, 0, 0, 0, 0, 1, [0], [0], [0, 1, None], [None], [], [0] * 70, self.int_value(),
                                       [self.int_value() for _ in range(3)]])
            if r.random() < 0.3:
                doc["topology_policy"] = r.choice(["none", "restricted", "fastest", None, 3, ["none"], {"a": 1}])
            if r.random() < 0.2:
                doc["all"] = r.choice([True, False, 1, "yes", None])
            if r.random() < 0.1:
                doc[self.key()] = self.json_value()
            return json.dumps(doc).encode()
        if roll < 0.55:
            return json.dumps(self.json_value()).encode()
        if roll < 0.65:  # nesting far deeper than any request needs
            n = r.choice([10, 64, 999, 5000, 20000])
            opener, closer = r.choice([("[", "]"), ('{"a":', "}")])
            return (opener * n + r.choice(["0", "null", ""]) + closer * r.choice([n, n // 2, 0])).encode()
        if roll < 0.75:
            return r.choice([b"\xff\xfe\x00", b"{\"pid\": \xc3\x28}", b"\xed\xa0\x80", b"\x00" * 10])
        if roll < 0.85:
            return r.choice([b"{not json", b"{\"pid\": 1e999999}", b"{\"pid\": " + b"9" * 5000 + b"}",
                             b"[" * 3 + b"]" * 5, b"\"\\", b"{\"a\":\"" + b"[" * 3000 + b"\"}", b"NaN",
                             b"{\"npu\": -Infinity}", b"  ", b""])
        return bytes(r.randrange(256) for _ in range(r.randrange(64)))

    # ------------------------------------------------------------ the request

    def target(self) -> str:
        r = self.rng
        path = r.choice(ROUTES + ["/", "/v1", "/v1/bind/", "/V1/BIND", "/v1/%62ind", "//healthz", "*",
                                  "http://localhost/healthz", "healthz", "/\u00e9", "/a b", "/" + "a" * 9000,
                                  "/v1/plan#frag", ""])
        if r.random() < 0.4:
            parts = []
            for _ in range(r.randrange(4)):
                k = r.choice(["pid", "npu", "topology_policy", "colour", "", "pid[]"])
                v = r.choice([str(self.pid), "0", "-1", "x", "", "4194303", "9" * 30, "%zz", "\u0663",
                              "none", "1&&", "%00"])
                parts.append(f"{k}={v}")
            sep = r.choice(["&", ";", "&&"])
            path += "?" + sep.join(parts)
        return path

    def request(self) -> bytes:
        r = self.rng
        route = r.choice(ROUTES)
        method = r.choice(["POST" if route in ("/v1/bind", "/v1/release") else "GET"] * 30 + METHODS)
        target = route if r.random() < 0.6 else self.target()
        if target == "/v1/plan" and r.random() < 0.9:  # with no npu the daemon runs npu-smi: slow
            target += f"?pid={self.pid}&npu={r.choice([0, 0, 1, 99])}"
        version = r.choice(VERSIONS)
        eol = r.choice(["\r\n"] * 20 + ["\n"] * 4 + ["\r", "\n\r"])
        body = self.body() if method in ("POST", "PUT", "post") or r.random() < 0.1 else b""
        headers = [("Host", "localhost")] if r.random() < 0.9 else []
        if body or r.random() < 0.3:
            headers.append(("Content-Type", "application/json"))
            headers += self.length_headers(len(body))
        headers += self.extra_headers()
        r.shuffle(headers)
        if r.random() < 0.05:
            line = r.choice([f"{method} {target}", f"{method}  {target} {version}", f"{method} {target} {version} x",
                             method, "", " " + method + " " + target + " " + version])
        else:
            line = f"{method} {target} {version}"
        head = eol.join([line, *(f"{k}: {v}" if k else v for k, v in headers)]) + eol + eol
        data = head.encode("utf-8", "surrogatepass") + body
        if r.random() < 0.1:  # cut anywhere: EOF before the end of the request
            data = data[:r.randrange(len(data) + 1)]
        return data

    def length_headers(self, n: int) -> list[tuple[str, str]]:
        r = self.rng
        roll = r.random()
        if roll < 0.85:
            return [("Content-Length", str(n))]
        return r.choice([[], [("Content-Length", str(n + r.randrange(1, 50)))],
                         [("Content-Length", str(max(0, n - 1)))], [("Content-Length", "-1")],
                         [("Content-Length", "1" * 30)], [("Content-Length", "0x10")],
                         [("Content-Length", str(n)), ("Content-Length", str(n + 1))],
                         [("Content-Length", str(n)), ("Content-Length", str(n))],
                         [("Transfer-Encoding", "chunked")],
                         [("Transfer-Encoding", "chunked"), ("Content-Length", str(n))],
                         [("Content-Length", "70000")], [("content-length", f" {n} ")]])

    def extra_headers(self) -> list[tuple[str, str]]:
        r = self.rng
        out = []
        for _ in range(r.choice([0] * 8 + [1, 2, 3])):
            out.append(r.choice([
                ("X-Request-Id", r.choice(["fuzz-1", "bad id!", "x" * 100, ""])),
                ("Expect", r.choice(["100-continue", "200-ok", ""])),
                ("Connection", r.choice(["keep-alive", "close", "upgrade"])),
                ("Upgrade", "h2c"),
                ("X-Junk", "\x01\x7f"),
                ("Bad Name", "v"),
                ("", "NoColon"),  # an empty name renders the value alone: a line without a colon
                ("", " folded continuation"),
                ("X-Big", "y" * r.choice([100, 9000, 20000])),
                ("X-Latin", "caf\u00e9"),
            ]))
        if r.random() < 0.02:
            out += [(f"X-H{i}", "v") for i in range(100)]
        return out


def exchange(sock_path: str, data: bytes, timeout: float = 20.0) -> bytes:
    """Send ``data`` on a fresh connection, shut the write side, read the reply to EOF."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(sock_path)
        try:
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the daemon answered early (413, 400) and closed; its answer is still queued
        chunks = []
        while True:
            try:
                chunk = s.recv(65536)
            except ConnectionResetError:
                break
            if not chunk:
                break
            chunks.append(chunk)
        return b"".join(chunks)


def check_reply(raw: bytes, data: bytes) -> tuple[int | None, str | None, str | None]:
    """(status or None, the problem with this reply or None, the error code of a JSON error)."""
    raw = raw.removeprefix(b"HTTP/1.1 100 Continue\r\n\r\n")  # the interim answer to "Expect: 100-continue"
    head, sep, body = raw.partition(b"\r\n\r\n")
    first = head.split(b"\r\n", 1)[0]
    m = _STATUS_LINE.fullmatch(first)
    if m is None:
        return None, "no status line", None
    status = int(m.group(1))
    if 500 <= status <= 599 and status not in (503, 505):
        return status, f"status {status}", None
    headers = {}
    for line in head.split(b"\r\n")[1:]:
        k, _, v = line.partition(b":")
        headers[k.strip().lower()] = v.strip()
    if headers.get(b"connection") != b"close":
        return status, "no Connection: close", None
    if data.startswith(b"HEAD ") and body == b"":
        return status, None, None  # HEAD: the head alone
    if headers.get(b"content-length") != str(len(body)).encode():
        return status, "Content-Length differs from the body", None
    if status == 200 and headers.get(b"content-type", b"").startswith(b"text/plain"):
        return status, None, None  # /metrics
    try:
        doc = json.loads(body)
    except ValueError:
        return status, "body is not JSON", None
    if status >= 400:
        if not (isinstance(doc, dict) and isinstance(doc.get("error"), str) and "detail" in doc):
            return status, "error body without error/detail", None
        return status, None, doc["error"]
    return status, None, None


def run(sock_path: str, requests: int, seed: int, pid: int) -> dict:
    rng = random.Random(seed)
    fuzz = Fuzz(rng, pid)
    statuses: collections.Counter = collections.Counter()
    problems: collections.Counter = collections.Counter()
    errors: collections.Counter = collections.Counter()
    examples: list[dict] = []
    t0 = time.monotonic()
    for _ in range(requests):
        data = fuzz.request()
        raw = exchange(sock_path, data)
        status, problem, error = check_reply(raw, data)
        statuses[str(status)] += 1
        if error:
            errors[error] += 1
        if problem:
            problems[problem] += 1
            if len(examples) < 5:
                examples.append({"problem": problem, "request": data[:300].decode("latin-1"),
                                 "reply": raw[:300].decode("latin-1")})
    elapsed = time.monotonic() - t0
    return {
        "requests": requests, "seed": seed, "seconds": round(elapsed, 2),
        "requests_per_second": round(requests / elapsed, 1),
        "statuses": dict(sorted(statuses.items())),
        "no_status_line": statuses.get("None", 0),
        "unexpected_5xx": sum(n for s, n in statuses.items() if s.startswith("5") and s not in ("503", "505")),
        "errors": dict(errors.most_common()), "problems": dict(problems), "examples": examples,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--socket", required=True)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=20261130)
    ap.add_argument("--pid", type=int, required=True, help="the one live pid requests may name")
    args = ap.parse_args(argv)
    json.dump(run(args.socket, args.requests, args.seed, args.pid), sys.stdout)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())

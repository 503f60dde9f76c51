"""A hostile local client of a Unix-socket server, for the starvation tests.

    setpriv --reuid=65534 ... python3 tests/http_abuse.py SOCKET --idle 200 --trickle 4

Standard library only (it runs as an unprivileged uid, outside the venv). It
keeps ``--idle`` connections open that never send a byte, reconnecting each as
soon as the server closes it, and ``--trickle`` connections that send a bind
request one byte a second. Connects are non-blocking, so a full listen backlog
shows up as EAGAIN instead of a hang. It prints ``ready`` once every connection
has been tried, and on stdin EOF one JSON line of counts: ``connects``,
``eagain`` (connects refused for a full backlog), ``replies`` by status code,
``no_status_line``.
"""

from __future__ import annotations

import argparse
import collections
import errno
import json
import os
import re
import selectors
import socket
import sys
import time

_TRICKLE = b"POST /v1/bind HTTP/1.1\r\nHost: x\r\nContent-Length: 11\r\n\r\n{\"npu\": 0}\n"
_STATUS = re.compile(rb"HTTP/1\.1 ([0-9]{3}) ")


class Abuser:
    def __init__(self, path: str, idle: int, trickle: int) -> None:
        self.path = path
        self.sel = selectors.DefaultSelector()
        self.want = {"idle": idle, "trickle": trickle}
        self.have: collections.Counter = collections.Counter()
        self.connects = self.eagain = self.no_status = 0
        self.replies: collections.Counter = collections.Counter()
        self.stop = False

    def connect(self, kind: str) -> bool:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.setblocking(False)
        try:
            s.connect(self.path)
        except BlockingIOError:
            self.eagain += 1
            s.close()
            return False
        except OSError as exc:
            s.close()
            if exc.errno == errno.EAGAIN:
                self.eagain += 1
                return False
            raise
        self.connects += 1
        self.have[kind] += 1
        self.sel.register(s, selectors.EVENT_READ, {"kind": kind, "sent": 0, "next": time.monotonic(), "got": b""})
        return True

    def fill(self) -> None:
        for kind, n in self.want.items():
            while self.have[kind] < n:
                if not self.connect(kind):
                    return

    def readable(self, key) -> None:
        s, state = key.fileobj, key.data
        try:
            data = s.recv(4096)
        except OSError:
            data = b""
        if data and not state["got"]:
            m = _STATUS.match(data)
            if m:
                self.replies[m.group(1).decode()] += 1
            else:
                self.no_status += 1
        state["got"] += data[:64]
        if not data:
            self.sel.unregister(s)
            s.close()
            self.have[state["kind"]] -= 1

    def trickle(self, now: float) -> None:
        for key in list(self.sel.get_map().values()):
            st = key.data
            if st and st["kind"] == "trickle" and now >= st["next"] and st["sent"] < len(_TRICKLE):
                try:
                    key.fileobj.send(_TRICKLE[st["sent"]:st["sent"] + 1])
                    st["sent"] += 1
                except OSError:
                    pass
                st["next"] = now + 1.0

    def run(self) -> dict:
        self.sel.register(sys.stdin, selectors.EVENT_READ, None)
        self.fill()
        print("ready", flush=True)
        while not self.stop:
            for key, _ in self.sel.select(0.2):
                if key.data is None:
                    if not os.read(sys.stdin.fileno(), 64):
                        self.stop = True
                else:
                    self.readable(key)
            self.trickle(time.monotonic())
            self.fill()
        return {"connects": self.connects, "eagain": self.eagain, "replies": dict(self.replies),
                "no_status_line": self.no_status}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("socket")
    ap.add_argument("--idle", type=int, default=200)
    ap.add_argument("--trickle", type=int, default=4)
    args = ap.parse_args()
    print(json.dumps(Abuser(args.socket, args.idle, args.trickle).run()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

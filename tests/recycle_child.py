"""A process with named threads, for tests/recycle_ns.py: started there with posix_spawn.

    python -I -S tests/recycle_child.py REPORT_FD CMD_FD NAME [NAME ...]

The main thread takes the first name, and one thread per further name starts, one at a
time, so their ids follow the pid in order. Each thread reads its own CPU mask at birth;
then one JSON line ``{tid: [name, [cpu, ...]]}`` goes to REPORT_FD. Each line read from
CMD_FD names a thread to end: it ends, its id is free again, and ``ok`` is written back.
Once CMD_FD closes, the process waits to be killed.

Standard library only, and nothing that starts a thread of its own: its thread ids are
exactly the ones the harness counts on.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tests/, for threadname (also under python -I)
from threadname import name_self  # noqa: E402


def main(report_w: int, cmd_r: int, names: list[str]) -> None:
    name_self(names[0])
    births = {os.getpid(): (names[0], sorted(os.sched_getaffinity(0)))}
    gates: dict[int, tuple[threading.Event, threading.Thread]] = {}
    lock = threading.Lock()
    ready = threading.Semaphore(0)

    def run(name: str, gate: threading.Event) -> None:
        name_self(name)
        with lock:
            births[threading.get_native_id()] = (name, sorted(os.sched_getaffinity(0)))
        ready.release()
        gate.wait()

    for name in names[1:]:
        gate = threading.Event()
        t = threading.Thread(target=run, args=(name, gate), daemon=True)
        t.start()
        ready.acquire()
        gates[t.native_id] = (gate, t)
    os.write(report_w, (json.dumps(births) + "\n").encode())
    with os.fdopen(cmd_r) as cmds:
        for line in cmds:
            gate, t = gates.pop(int(line))
            gate.set()
            t.join()
            deadline = time.monotonic() + 10
            while os.path.exists(f"/proc/self/task/{int(line)}") and time.monotonic() < deadline:
                time.sleep(0.0005)  # the kernel releases a joined thread's id a moment after the join
            os.write(report_w, b"ok\n")
    while True:
        signal.pause()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:])

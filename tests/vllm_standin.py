"""A stand-in for one process of a vLLM server (vLLM is not installed here).

    python tests/vllm_standin.py        # then one command per line on stdin:
      drive N      become a worker on device index N: what a vLLM worker does once it
                   has set its device (vLLM's world group appears, with local_rank N)
      fork N       fork a child that does `drive N`, print its pid; the child waits
                   for its binding thread, then sleeps until it is killed
      join         wait (bounded) for this process's binding thread; print "done" or "running"
      watchers     print how many binding threads this process runs
      quit

Start-up does what vLLM's plugin loader does in every process it starts: find
the ``vllm.general_plugins`` entry points with importlib.metadata, keep those
that VLLM_PLUGINS allows (all when unset), load each and call it — twice, as
vLLM may. It imports nothing from ascendbind itself. It also starts the named
threads a real worker has, so a test sees every thread bound. Prints "ready".
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import types
from importlib.metadata import entry_points

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tests/, for threadname
from threadname import name_self  # noqa: E402

BIND_THREAD = "ascendbind-bind"  # the name integrations.THREAD_NAME gives its thread


def load_general_plugins() -> int:
    allowed = os.environ.get("VLLM_PLUGINS")
    names = None if allowed is None else [n.strip() for n in allowed.split(",") if n.strip()]
    called = 0
    for plugin in entry_points(group="vllm.general_plugins"):
        if names is None or plugin.name in names:
            plugin.load()()
            called += 1
    return called


class GroupCoordinator:
    """The one attribute of vLLM's world group that a worker's device can be read from."""

    def __init__(self, local_rank: int) -> None:
        self.local_rank = local_rank


def drive(index: int) -> None:
    state = types.ModuleType("vllm.distributed.parallel_state")
    state._WORLD = GroupCoordinator(index)
    sys.modules["vllm.distributed.parallel_state"] = state


def bind_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == BIND_THREAD]


def join(timeout: float = 60.0) -> str:
    for t in bind_threads():
        t.join(timeout)
    return "running" if any(t.is_alive() for t in bind_threads()) else "done"


def named_thread(name: str) -> None:
    name_self(name)
    threading.Event().wait()


def main() -> int:
    for name in ("acl_thread", "release_thread", "worker_0"):
        threading.Thread(target=named_thread, args=(name,), daemon=True).start()
    load_general_plugins()
    load_general_plugins()
    out = sys.stdout
    out.write("ready\n")
    out.flush()
    children: list[int] = []
    for line in sys.stdin:
        cmd, _, arg = line.strip().partition(" ")
        if cmd == "drive":
            drive(int(arg))
            out.write("ok\n")
        elif cmd == "fork":
            child = os.fork()
            if child == 0:
                drive(int(arg))
                join()
                signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGTERM])
                threading.Event().wait()
                os._exit(0)
            children.append(child)
            out.write(f"{child}\n")
        elif cmd == "join":
            out.write(join() + "\n")
        elif cmd == "watchers":
            out.write(f"{len(bind_threads())}\n")
        elif cmd == "quit":
            break
        else:
            out.write("?\n")
        out.flush()
    for child in children:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
    return 0


if __name__ == "__main__":
    sys.exit(main())

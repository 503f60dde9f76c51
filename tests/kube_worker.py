"""A worker pod's program (stdlib only, run by the image's python3 after ``ascendbind run``
bound the process): the named threads a vLLM-Ascend worker has beside its main thread
(torch_npu's ``acl_thread`` and ``release_thread``, a vLLM worker thread), then it waits
until the kubelet stops it. Prints ``ready`` once every thread runs."""

import os
import signal
import sys
import threading

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # beside it in the pod: threadname.py
from threadname import name_self  # noqa: E402

started = threading.Barrier(4)


def named(name: str) -> None:
    name_self(name)
    started.wait()
    threading.Event().wait()


for name in ("acl_thread", "release_thread", "worker_0"):
    threading.Thread(target=named, args=(name,), daemon=True).start()
started.wait()
print("ready", flush=True)
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
while True:
    signal.pause()

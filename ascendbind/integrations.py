"""Bind an inference server's worker from inside it, once it drives its NPU.

Standard library plus ``ascendbind.client`` only (which finds the daemon's socket
the way the CLI does, through ``ascendbind.settings``): this module is imported
into every process of the server (vLLM loads it through an entry point), so it
must not drag the daemon's dependencies into them. Nothing here ever raises into the
server or blocks it: a binding that cannot be made costs one warning on the
``ascendbind.integrations`` logger (stderr when the server configured no
logging) and the worker runs unbound, exactly as it would without ascendbind.

Two ways in:

* ``bind_current_process(device_index=i)`` for a server that knows which device
  its runtime gave the calling process (call it right after the process set its
  device). One request to the daemon; the daemon takes the pid from the socket's
  peer credentials, so it works from inside a container's pid namespace, and
  resolves the index to the host's NPU from what it sees of the process (its
  container's device nodes, the driver's process map, npu-smi) and the
  ``ASCEND_*`` variables sent with the request.

* ``vllm_plugin()``, the ``vllm.general_plugins`` entry point. vLLM calls every
  general plugin in every process it starts (API server, engine core, each
  worker), and calls it before the worker has picked its device. Binding there
  would pin the wrong processes, so the plugin only starts one short-lived
  daemon thread per process that watches for the moment the process becomes a
  worker with a device, binds it once, and ends. A process that never becomes a
  worker (the API server, a multi-process engine core) is left alone and its
  thread ends at the deadline without a word.

How the watcher learns the device, without touching the NPU runtime: a vLLM
worker sets its device (``torch.npu.set_device("npu:<local_rank>")`` in
vLLM-Ascend) and right after initialises vLLM's distributed state, whose world
group (``vllm.distributed.parallel_state._WORLD``) carries that same
``local_rank``. The watcher reads it from ``sys.modules`` — it never imports
vLLM, and never asks torch_npu for the current device, which from another thread
would create a runtime context on device 0. The index is local to what the
process sees (in a pod the device plugin gave physical NPU 5, device 0 is NPU 5),
so the watcher sends the index and the ``ASCEND_*`` variables it sees, and the
daemon, which can see the process's devices, names the NPU.

vLLM's default multiprocessing start method is fork, and a forked worker does
not run the plugins again (they count as loaded in its parent). Threads do not
survive fork, so a child forked while its parent was still watching starts its
own watcher. A child forked after its parent was bound inherits the parent's
CPU mask and is not bound again.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence

from . import errors
from .client import Client
from .values.targeting import ASCEND_ENV

__all__ = [
    "bind_current_process",
    "ascend_env",
    "vllm_local_rank",
    "watch_and_bind",
    "vllm_plugin",
    "WAIT_ENV",
    "THREAD_NAME",
]

log = logging.getLogger("ascendbind.integrations")

# how long a process's watcher waits for it to become a worker with a device
WAIT_ENV = "ASCENDBIND_PLUGIN_WAIT_SECONDS"
DEFAULT_WAIT_SECONDS = 600.0
POLL_SECONDS = 0.2
THREAD_NAME = "ascendbind-bind"

# transient daemon answers (503: discovery unavailable or busy) are retried this often
_RETRY_DELAYS = (1.0, 2.0, 4.0)


def _warn(target: str, reason: str) -> None:
    log.warning("ascendbind: pid %d not bound%s: %s; it runs unbound", os.getpid(), target, reason)


def _target_text(npu, device_index) -> str:
    if npu is not None:
        return f" to NPU {npu}"
    return "" if device_index is None else f" (device index {device_index})"


def ascend_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The ``ASCEND_*`` variables the daemon weighs, as this process sees them now."""
    env = os.environ if env is None else env
    return {k: env[k] for k in ASCEND_ENV if k in env}


def bind_current_process(npu: int | Sequence[int] | None = None, *, device_index: int | None = None,
                         env: Mapping[str, str] | None = None, socket_path: str | None = None,
                         topology_policy: str | None = None, timeout: float = 60.0,
                         retry_delays: Sequence[float] = _RETRY_DELAYS) -> dict | None:
    """Ask the daemon to bind the calling process (all its threads).

    ``device_index``: the device the process's runtime uses (``torch.npu.set_device(i)``);
    the daemon resolves the NPU behind it, with ``env`` (default: this process's
    ``ASCEND_*`` variables). ``npu``: a logical NPU of the host, when you know it; the
    daemon refuses it (409 ``npu_mismatch``) when what it sees of the process says
    otherwise. Neither: the daemon decides from the evidence alone. Returns the
    daemon's answer, or None after logging exactly one warning. Never raises.
    """
    target = _target_text(npu, device_index)
    try:
        client = Client(socket_path, timeout=timeout)
        delays = list(retry_delays)
        sent_env = ascend_env(env) if npu is None else None
        while True:
            try:
                return client.bind(npu=npu, topology_policy=topology_policy, device_index=device_index,
                                   env=sent_env)
            except errors.DaemonUnreachable as exc:
                _warn(target, str(exc))
                return None
            except errors.DiscoveryError as exc:
                # 503: the daemon cannot read the host right now (npu-smi hung, rediscovery)
                if not delays:
                    _warn(target, f"{exc} (after {len(retry_delays) + 1} tries)")
                    return None
                time.sleep(delays.pop(0))
            except errors.AscendbindError as exc:
                _warn(target, f"{exc} [{exc.code}]")
                return None
    except Exception as exc:  # a bug here must never take a worker down
        _warn(target, f"unexpected {type(exc).__name__}: {exc}")
        return None


def vllm_local_rank(modules: Mapping[str, object] | None = None) -> int | None:
    """The device index of this vLLM worker, once it has set its device; else None.

    Reads the local rank of vLLM's world group, which exists only in a process
    that initialised vLLM's distributed state, i.e. a worker that has already
    picked its device. Reads attributes only: imports nothing, touches no device.
    """
    modules = sys.modules if modules is None else modules
    state = modules.get("vllm.distributed.parallel_state")
    world = getattr(state, "_WORLD", None) if state is not None else None
    rank = getattr(world, "local_rank", None) if world is not None else None
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        return None
    return rank


def watch_and_bind(device_index: Callable[[], int | None], *, wait_seconds: float,
                   poll_seconds: float = POLL_SECONDS, socket_path: str | None = None,
                   env: Mapping[str, str] | None = None) -> threading.Thread:
    """Start a daemon thread that polls ``device_index()`` until it names a device
    (then asks the daemon, once, to bind this process to the NPU behind that device, sending
    the ``ASCEND_*`` variables of ``env``, default this process's) or ``wait_seconds`` pass
    (then ends quietly: this process is not a worker). Returns the started thread."""

    def run() -> None:
        deadline = time.monotonic() + wait_seconds
        while True:
            try:
                index = device_index()
            except Exception:  # a probe that breaks on some server version: treat as "not yet"
                index = None
            if index is not None:
                break
            if time.monotonic() >= deadline:
                log.debug("ascendbind: pid %d drove no NPU within %.0fs; not bound", os.getpid(), wait_seconds)
                _mark("done")
                return
            time.sleep(poll_seconds)
        _mark("found")
        bind_current_process(device_index=index, env=env, socket_path=socket_path)
        _mark("done")

    thread = threading.Thread(target=run, name=THREAD_NAME, daemon=True)
    thread.start()
    return thread


# ------------------------------------------------------------------ vLLM

# one watcher per process: vLLM may call a plugin more than once, and a forked child
# inherits this state from its parent (with the pid telling whose it was)
_lock = threading.Lock()
_state = {"pid": 0, "phase": "idle"}  # idle -> watching -> found -> done
_fork_hook = False


def _mark(phase: str) -> None:
    with _lock:
        if _state["pid"] == os.getpid():
            _state["phase"] = phase


def _wait_seconds() -> float:
    raw = os.environ.get(WAIT_ENV, "")
    try:
        value = float(raw) if raw.strip() else DEFAULT_WAIT_SECONDS
    except ValueError:
        log.warning("ascendbind: %s=%r is not a number of seconds; using %.0f", WAIT_ENV, raw, DEFAULT_WAIT_SECONDS)
        return DEFAULT_WAIT_SECONDS
    return max(0.0, value)


def _start_watching() -> None:
    with _lock:
        if _state["pid"] == os.getpid() and _state["phase"] != "idle":
            return
        _state.update(pid=os.getpid(), phase="watching")
    watch_and_bind(vllm_local_rank, wait_seconds=_wait_seconds())


def _after_fork_in_child() -> None:
    # the parent's watcher thread did not come along; carry on its watch only if it
    # was still waiting (a bound parent's children inherit its CPU mask already).
    # Another parent thread may have held the lock at fork time: start with a fresh one.
    global _lock
    _lock = threading.Lock()
    try:
        if _state["phase"] == "watching":
            _state.update(pid=0, phase="idle")
            _start_watching()
    except Exception as exc:
        _warn("", f"unexpected {type(exc).__name__}: {exc}")


def vllm_plugin() -> None:
    """``vllm.general_plugins`` entry point: watch for this process's device, then bind it."""
    global _fork_hook
    try:
        with _lock:
            if not _fork_hook:
                os.register_at_fork(after_in_child=_after_fork_in_child)
                _fork_hook = True
        _start_watching()
    except Exception as exc:  # never fail the server's start-up
        _warn("", f"unexpected {type(exc).__name__}: {exc}")

"""Who moved a bound worker's masks: the blame rule, pure (values in, verdict out).

The reconcile loop sees only that a mask changed, never who changed it: the
kernel records no writer for ``sched_setaffinity``. So the culprit is a verdict
on *evidence*, and ``self`` needs evidence that the worker binds itself:

* torch_npu binds when ``CPU_AFFINITY_CONF`` in the worker's environment has
  mode 1 or 2 (0 or unset is off). It binds late, once the device is set, and
  so overrides any binding made from outside (taskset, ascendbind).
* vllm-ascend's binder (``additional_config`` key ``enable_cpu_binding``) is
  on by default since v0.18.0rc1 on ARM hosts and skips other architectures;
  ``--numa-bind`` turns it on, ``--additional-config '{"enable_cpu_binding":
  false}'`` off. The setting lives on the command line of the vLLM server; the
  workers are its descendants (multiprocessing's spawn gives them a bare
  ``python -c`` command line), so the worker's ancestors are read too. An
  ``LLM(additional_config=...)`` built in Python code leaves nothing to read:
  that binder's drift is ``external``.

``env``: the environment asks an OpenMP runtime inside the worker to bind its
threads (``OMP_PROC_BIND`` other than false, ``KMP_AFFINITY`` other than
disabled/none, ``GOMP_CPU_AFFINITY``). Anything else is ``external``: taskset,
another tuner, a container runtime. IRQ masks: ``irqbalance`` while it runs,
else ``external``. The verdict never changes whether a worker is left alone
after the re-assert limit, only what its status says about why.

``cpuset``: the worker's cgroup cpuset is no longer the one its plan was made
from. The kernel narrows every task of a cgroup to its new CPUs itself, so
threads found outside their plan then were moved by the kernel, not by a tool;
that is never drift to fight (a mask outside the cpuset cannot even be set):
the worker is planned again from its new CPUs (lifecycle.py's ``Replan``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = ["Evidence", "Blame", "environ_evidence", "vllm_setting", "first_vllm_setting",
           "split_cmdline",
           "blame_threads", "blame_irqs", "blame_cpuset", "left_alone_sentence", "OPENMP_ENV", "FIX"]

OPENMP_ENV = ("OMP_PROC_BIND", "KMP_AFFINITY", "GOMP_CPU_AFFINITY")
_OPENMP_OFF = {"OMP_PROC_BIND": ("false",), "KMP_AFFINITY": ("disabled", "none")}
_ADDITIONAL = ("--additional-config", "--additional_config")
_DOTTED = tuple(f"{a}.enable_cpu_binding" for a in _ADDITIONAL)
_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


@dataclass(frozen=True)
class Evidence:
    """What the worker's environment and command lines say about in-process binders."""

    torch_npu: str | None = None  # CPU_AFFINITY_CONF's value when it turns binding on
    vllm: str | None = None  # "on", "off", "default", or None when no vLLM command line was found
    vllm_pid: int | None = None  # the process whose command line said so
    openmp: tuple[str, ...] = ()  # "OMP_PROC_BIND=true", ... (only settings that bind)
    arm: bool = True  # the host is ARM (vllm-ascend's binder runs only there)


@dataclass(frozen=True)
class Blame:
    culprit: str  # one of metrics.CULPRITS, the label set of ascendbind_drift_total{culprit}
    why: str  # the evidence, or its absence, as a sentence


def environ_evidence(env: dict[str, str]) -> tuple[str | None, tuple[str, ...]]:
    """(CPU_AFFINITY_CONF when it binds, OpenMP settings that bind) from a worker's environment."""
    conf = env.get("CPU_AFFINITY_CONF", "").strip()
    mode = conf.split(",", 1)[0].strip().lower().removeprefix("mode:").strip()
    torch_npu = conf if mode in ("1", "2") else None
    openmp = []
    for key in OPENMP_ENV:
        value = env.get(key, "").strip()
        if value and value.lower() not in _OPENMP_OFF.get(key, ()):
            openmp.append(f"{key}={value[:40]}")
    return torch_npu, tuple(openmp)


def split_cmdline(raw: bytes) -> list[str]:
    """``/proc/<pid>/cmdline`` (NUL-separated) -> argv."""
    return [a.decode("utf-8", "replace") for a in raw.rstrip(b"\0").split(b"\0")] if raw else []


def _truth(value) -> bool | None:
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, str)):
        text = str(value).strip().lower()
        return True if text in _TRUE else False if text in _FALSE else None
    return None


def _from_additional(text: str) -> bool | None:
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError):
        return None
    return _truth(doc.get("enable_cpu_binding")) if isinstance(doc, dict) else None


def _is_vllm(argv: Sequence[str]) -> bool:
    # the console script runs as `python /usr/bin/vllm serve ...`; the module form
    # as `python -m vllm.entrypoints....`
    head = argv[:3]
    return any(a.rsplit("/", 1)[-1] == "vllm" or a.startswith("vllm.entrypoints") for a in head)


def vllm_setting(argv: Sequence[str]) -> str | None:
    """vllm-ascend's binder as this command line sets it: "on", "off", "default" (a vLLM
    command line that does not say), or None (not vLLM and no setting). Later flags win,
    as in argparse."""
    setting: bool | None = None
    for i, arg in enumerate(argv):
        key, eq, inline = arg.partition("=")
        value = inline if eq else (argv[i + 1] if i + 1 < len(argv) else "")
        found: bool | None = None
        if key == "--numa-bind":
            found = _truth(inline) if eq else True
        elif key in _ADDITIONAL:
            found = _from_additional(value)
        elif key in _DOTTED:
            found = _truth(value)
        if found is not None:
            setting = found
    if setting is not None:
        return "on" if setting else "off"
    return "default" if _is_vllm(argv) else None


def first_vllm_setting(cmdlines: Iterable[tuple[int, Sequence[str]]]) -> tuple[str | None, int | None]:
    """The setting of the nearest process (the worker first, then its ancestors) that has one."""
    for pid, argv in cmdlines:
        found = vllm_setting(argv)
        if found is not None:
            return found, pid
    return None, None


def blame_threads(ev: Evidence) -> Blame:
    """The culprit of a thread-mask drift, from evidence only."""
    if ev.torch_npu:
        return Blame("self", f"CPU_AFFINITY_CONF={ev.torch_npu[:60]} in the worker's environment: torch_npu binds "
                             "its threads once the device is set, over any binding made from outside")
    where = f"pid {ev.vllm_pid}'s command line" if ev.vllm_pid is not None else "the command line"
    if ev.vllm == "on" and ev.arm:
        return Blame("self", f"vllm-ascend's CPU binder is on ({where} sets enable_cpu_binding or --numa-bind)")
    if ev.vllm == "default" and ev.arm:
        return Blame("self", f"vllm-ascend's CPU binder is on by default on ARM hosts since v0.18.0rc1, and {where} "
                             "does not turn it off")
    if ev.openmp:
        return Blame("env", f"the worker's environment asks its OpenMP runtime to bind threads "
                            f"({', '.join(ev.openmp)})")
    why = ("no sign that the worker binds itself (no CPU_AFFINITY_CONF, no vllm-ascend binder, no OpenMP binding "
           "variables): something outside it moved the masks (taskset, another tuner, a container runtime)")
    if ev.vllm == "off":
        why += f"; vllm-ascend's binder is off on {where}"
    elif ev.vllm in ("on", "default"):
        why += f"; {where} is vLLM's, but vllm-ascend's binder runs only on ARM hosts"
    return Blame("external", why)


def blame_irqs(irqbalance_running: bool) -> Blame:
    if irqbalance_running:
        return Blame("irqbalance", "irqbalance runs on this host and rewrites IRQ affinity")
    return Blame("external", "irqbalance does not run: another tool wrote these IRQs' smp_affinity")


def blame_cpuset(before: str, after: str) -> Blame:
    """The verdict on threads the kernel moved when the cpuset went from ``before`` to ``after``
    (cpulists)."""
    return Blame("cpuset", f"the worker's cgroup cpuset changed from CPUs {before[:200]} to {after[:200]} "
                           "(kubelet's CPU manager, a pod update or an operator); the kernel moved its threads "
                           "into the new set, and ascendbind plans the worker again from it")


# what to do about each culprit: the end of a left-alone sentence
FIX = {
    "self": "turn the worker's own binder off (vllm-ascend: --additional-config '{\"enable_cpu_binding\": false}'; "
            "torch_npu: unset CPU_AFFINITY_CONF), or release the worker and let it bind itself",
    "env": "unset those variables in the worker's environment",
    "external": "find and stop what moves it (a taskset in a start script, a tuning daemon, the container runtime), "
                "then bind the worker again",
    "cpuset": "give the worker CPUs its NPU's plan fits in (a cpuset large enough for its roles, or "
              "small_pool = \"share\"); it is planned again whenever its cpuset changes",
    "irqbalance": "ban the NPU IRQs in irqbalance or set irqbalance = \"stop\", then bind the worker again",
}


def left_alone_sentence(what: str, blame: Blame, reasserts: int, window_s: float) -> str:
    """Why the loop gave up on ``what`` ("thread masks", "IRQ masks"): the count, the blame, the fix."""
    return (f"{what} moved again after {reasserts} re-asserts within {window_s:g} s, so ascendbind no longer "
            f"re-asserts them; blamed {blame.culprit}: {blame.why}. Fix: {FIX[blame.culprit]}")

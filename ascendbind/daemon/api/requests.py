"""Request values and the small rules around them, shared by the API and the daemon core.

Everything here is pure: validation of request bodies (400 on anything off),
the policy precedence rule (Koordinator: request > node config > default, a
mismatch is 409), how a plan's alignment becomes a bind-request outcome, which
NPU each saved IRQ mask belongs to, and when a live holder of an NPU gives way.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Collection, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from ...values.config import CHOICES, Config
from ...errors import Conflict, NotPermitted, ProcessGone, UsageError
from ...values.model import Binding, Plan
from ...planner.align.alignment import resolve_policy as planner_resolve_policy
from ...values.targeting import ASCEND_ENV, TargetRequest

__all__ = ["PlanAsk", "parse_bind_request", "decode_json_body", "alignment_of", "outcome_of_error", "resolve_policy",
           "irq_owners", "evictable", "claim_npus", "recycled_is_a_conflict", "MAX_JSON_DEPTH", "PID_MAX", "NPU_MAX"]

# json.loads recurses once per nesting level: a deep body must be refused before
# it can reach the interpreter's recursion limit. No request needs more than 2.
MAX_JSON_DEPTH = 8
PID_MAX = 1 << 22  # the kernel's PID_MAX_LIMIT: no pid is larger on any host
NPU_MAX = 1 << 16  # logical NPU ids are small; this only keeps absurd numbers out of the planner
_MAXIMUM = {"pid": PID_MAX, "npu": NPU_MAX, "device_index": NPU_MAX}
ENV_VALUE_MAX = 1024  # an ASCEND_* value is a short list of ids
_ESCAPE = re.compile(r"\\.", re.S)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_INNERMOST = re.compile(r"\[\]|\{\}")


def decode_json_body(raw: bytes) -> Any:
    """A request body -> its JSON value ({} when empty); UsageError (400 ``bad_json``) otherwise."""
    if not raw.strip():
        return {}
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UsageError(f"the body is not UTF-8 JSON: {exc.reason} at byte {exc.start}", code="bad_json") from None
    # few brackets cannot nest deep: skip the scan for every ordinary body
    if text.count("[") + text.count("{") > MAX_JSON_DEPTH and json_depth(text, MAX_JSON_DEPTH) > MAX_JSON_DEPTH:
        raise UsageError(f"the body nests deeper than {MAX_JSON_DEPTH} levels", code="bad_json")
    try:
        return json.loads(text, parse_int=_json_int)
    except (ValueError, RecursionError) as exc:
        raise UsageError(f"the body is not JSON: {str(exc)[:200]}", code="bad_json") from None


# Python 3.11 (and some distributions' 3.9 and 3.10) refuse to turn more than 4300 digits
# into an int, since the conversion is quadratic; Debian 11's 3.9.2 does not, so the
# limit is kept here, the same on every Python the daemon runs on
MAX_INT_DIGITS = 4300


def _json_int(digits: str) -> int:
    if len(digits) > MAX_INT_DIGITS + 1:  # + 1: a minus sign
        raise ValueError(f"an integer of {len(digits)} digits (at most {MAX_INT_DIGITS})")
    return int(digits)


def json_depth(text: str, stop: int | None = None) -> int:
    """The bracket nesting of ``text`` outside JSON strings: exact for JSON, an upper bound otherwise.

    Linear and in C: escapes dropped, the text between quotes dropped, then one
    pass per level deletes the innermost ``[]``/``{}`` pairs (stopping once
    ``stop`` levels are passed). A per-character Python loop costs tens of ms
    on a 64 KiB body, and a regular expression for whole strings backtracks
    quadratically on a body of unterminated quotes.
    """
    outside = "".join(_ESCAPE.sub("", text).split('"')[0::2])
    brackets = _NOT_BRACKET.sub("", outside)
    depth = 0
    while brackets:
        inner_removed = _INNERMOST.sub("", brackets)
        if len(inner_removed) == len(brackets):
            return depth + len(brackets)  # unbalanced, so not JSON: bound it by what is left
        brackets, depth = inner_removed, depth + 1
        if stop is not None and depth > stop:
            break
    return depth


def _int_field(body: dict, key: str, *, minimum: int) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    maximum = _MAXIMUM.get(key, PID_MAX)
    if isinstance(v, bool) or not isinstance(v, int) or not minimum <= v <= maximum:
        shown = repr(v) if not isinstance(v, int) or abs(v) < 10**30 else "a huge number"
        raise UsageError(f"field {key!r} must be an integer from {minimum} to {maximum}, got {shown[:60]}",
                         code="bad_request")
    return v


def _env_field(body: dict) -> dict[str, str] | None:
    env = body.get("env")
    if env is None:
        return None
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise UsageError("field 'env' must be an object of strings", code="bad_request")
    unknown = sorted(set(env) - set(ASCEND_ENV))
    if unknown:
        raise UsageError(f"field 'env' may hold only {', '.join(ASCEND_ENV)}; got {unknown[0][:40]!r}",
                         code="bad_request")
    if any(len(v) > ENV_VALUE_MAX for v in env.values()):
        raise UsageError(f"field 'env': a value is longer than {ENV_VALUE_MAX} characters", code="bad_request")
    return env


@dataclass(frozen=True)
class PlanAsk:
    """What a bind or plan request asks of its plan besides the target: a ``topology_policy``
    and a ``pool_source`` (None: the node's). ``of`` also takes a bare policy name."""

    topology_policy: str | None = None
    pool_source: str | None = None

    @classmethod
    def of(cls, value: PlanAsk | str | None) -> PlanAsk:
        return value if isinstance(value, PlanAsk) else cls(topology_policy=value or None)


def _choice_field(body: dict, key: str) -> str | None:
    value = body.get(key)
    if value is not None and (not isinstance(value, str) or value not in CHOICES[key]):
        raise UsageError(f"field {key!r} must be one of {', '.join(CHOICES[key])}, got {value!r:.60}",
                         code="bad_request")
    return value


def parse_bind_request(body: Any) -> tuple[int | None, TargetRequest, PlanAsk]:
    """Validate a /v1/bind body -> (pid, what it targets, what it asks of the plan); UsageError
    (400) otherwise."""
    if not isinstance(body, dict):
        raise UsageError("the body must be a JSON object", code="bad_request")
    unknown = sorted(set(body) - {"pid", "npu", "device_index", "env", "topology_policy", "pool_source"})
    if unknown:
        raise UsageError(f"unknown field(s): {', '.join(k[:40] for k in unknown[:8])}", code="bad_request")
    pid = _int_field(body, "pid", minimum=1)
    npu = body.get("npu")
    npus: tuple[int, ...] | None
    if npu is None:
        npus = None
    elif isinstance(npu, list):
        if not 1 <= len(npu) <= 64:
            raise UsageError("field 'npu' must list 1 to 64 NPU ids", code="bad_request")
        if any(n is None for n in npu):
            raise UsageError("field 'npu' must list integers, got null", code="bad_request")
        npus = tuple(sorted({_int_field({"npu": n}, "npu", minimum=0) for n in npu}))  # type: ignore[misc]
    else:
        npus = (_int_field(body, "npu", minimum=0),)  # type: ignore[assignment]
    index = _int_field(body, "device_index", minimum=0)
    if npus is not None and index is not None:
        raise UsageError("name either 'npu' or 'device_index', not both", code="bad_request")
    ask = PlanAsk(_choice_field(body, "topology_policy"), _choice_field(body, "pool_source"))
    return pid, TargetRequest(npus=npus, device_index=index, env=_env_field(body)), ask


def alignment_of(plan: Plan) -> tuple[bool, str | None]:
    """(aligned, failure reason code) from the planner's alignment decision.

    The planner decides it for every plan; a plan without one (a state file
    written before it existed) was never evaluated, so it does not count as aligned.
    """
    al = plan.alignment
    if al is None:
        return False, None
    return al.aligned, al.failure or None


def irq_owners(b: Binding) -> dict[int, int]:
    """IRQ number -> the NPU it was bound for, from the irq step's writes."""
    return {w.irq: w.npu for w in b.irqs}


def evictable(newcomer: int, holder: int, shared: Iterable[int], listed: Collection[tuple[int, int]]) -> bool:
    """Whether live ``holder`` gives its NPUs ``shared`` to ``newcomer``.

    ``listed`` holds the (npu, pid) pairs of npu-smi's process table: the driver's
    word on who really uses an NPU. Binding needs no proof of use, so an idle process
    bound first must not lock a real worker out; but a holder the driver lists is
    never displaced, and nobody unlisted displaces anybody.
    """
    shared = tuple(shared)
    return bool(shared) and all((n, newcomer) in listed and (n, holder) not in listed for n in shared)


def claim_npus(pid: int, targets: Iterable[int], holders: Iterable[tuple], listed: Collection[tuple[int, int]] | None,
               *, allow_shared: bool = False, proven: bool = True) -> tuple[list[int], list[int]]:
    """Who gives way when ``pid`` binds ``targets``: (dead holders to replace, live
    holders to evict). ``holders`` are (pid, npus, alive[, proven]) of the other held
    workers (proven when not said); ``listed`` the process table's (npu, pid) pairs, None
    when unread or unreadable; ``proven``: whether the newcomer's binding is
    (daemon/watch/proof.py). Only a proven binding holds an NPU against another worker:

    * a dead holder is replaced;
    * with ``allow_shared`` every live holder stays, and the newcomer shares;
    * an unproven live holder gives way to a proven newcomer (evicted), and shares
      with an unproven one: neither is believed, so neither may keep the other out;
    * a proven live holder keeps its NPU (Conflict ``npu_busy``), unless a proven
      newcomer is listed there by npu-smi and it is not (``evictable``)."""
    targets = set(targets)
    dead: list[int] = []
    evict: list[int] = []
    for other, npus, alive, *rest in holders:
        shared = set(npus) & targets
        held_proven = rest[0] if rest else True
        if other == pid or not shared:
            continue
        if not alive:
            dead.append(other)
        elif allow_shared:
            continue
        elif not held_proven:
            if proven:
                evict.append(other)
        elif proven and listed is not None and evictable(pid, other, shared, listed):
            evict.append(other)
        else:
            why = "" if listed is None else (
                "; npu-smi lists it there" if any((n, other) in listed for n in shared)
                else f"; npu-smi does not list pid {pid} there either")
            if not proven:
                why += f"; nothing proves that pid {pid} drives it"
            raise Conflict(f"NPU {min(shared)} is held by live worker {other}{why} "
                           "(set allow_shared_npu to share it)", code="npu_busy")
    return dead, evict


@contextlib.contextmanager
def recycled_is_a_conflict() -> Iterator[None]:
    """Inside a request, a pid whose start time changed since it was authorized is a
    409 (the caller meant another process), not the 404 of a pid that is simply gone."""
    try:
        yield
    except ProcessGone as exc:
        if exc.code != "pid_recycled":
            raise
        raise Conflict(str(exc), code="pid_recycled") from None


def outcome_of_error(exc: BaseException) -> str:
    """The bind-request outcome of an error: a bad or unauthorised request is
    'rejected'; everything else 'failed'. A pid that vanished or was recycled
    under the request, and a request the evidence about the worker contradicts,
    count as bad requests."""
    if isinstance(exc, (UsageError, NotPermitted, ProcessGone)):
        return "rejected"
    if isinstance(exc, Conflict) and exc.code in ("policy_mismatch", "pid_recycled", "npu_mismatch"):
        return "rejected"
    return "failed"


def resolve_policy(ask: PlanAsk | str | None, config: Config) -> Config:
    """Koordinator precedence: request > node config > default; both set and different -> 409.

    The rule is the planner's (planner/align/alignment.py) for the topology policy, and the same
    for the pool source: a node that names its ``pool_source`` decides it, and a request may
    only repeat it (409 ``policy_mismatch`` otherwise). Returns the Config to plan with
    (``config`` itself when nothing changes: no copy per request).
    """
    ask = PlanAsk.of(ask)
    policy = planner_resolve_policy(ask.topology_policy, config)
    changes: dict[str, str] = {}
    if policy != config.topology_policy:
        changes["topology_policy"] = policy
    source = ask.pool_source
    if source is not None and source != config.pool_source:
        if source not in CHOICES["pool_source"]:
            raise UsageError(f"pool_source must be one of {', '.join(CHOICES['pool_source'])}; got {source!r:.60}",
                             code="bad_request")
        if "pool_source" in config.explicit:
            raise Conflict(f"the request asks for pool_source {source} but this node is configured with "
                           f"{config.pool_source}; a request may only repeat the node's pool source (drop it from "
                           "the request or change the node config)", code="policy_mismatch")
        changes["pool_source"] = source
    return config.replace(**changes) if changes else config

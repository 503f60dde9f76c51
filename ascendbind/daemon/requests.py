"""Request values and the small rules around them, shared by the API and the daemon core.

Everything here is pure: validation of request bodies (400 on anything off),
the policy precedence rule (Koordinator: request > node config > default, a
mismatch is 409), how a plan's alignment becomes a SPEC §7 outcome, which
NPU each saved IRQ mask belongs to, and when a live holder of an NPU gives way.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import Any

from ..config import CHOICES, Config
from ..errors import Conflict, NotPermitted, ProcessGone, UsageError
from ..model import Binding, Plan, Step
from ..planner.alignment import resolve_policy as planner_resolve_policy

__all__ = ["parse_bind_request", "alignment_of", "outcome_of_error", "resolve_policy", "irq_owners", "evictable"]


def _int_field(body: dict, key: str, *, minimum: int) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise UsageError(f"field {key!r} must be an integer >= {minimum}, got {v!r}", code="bad_request")
    return v


def parse_bind_request(body: Any) -> tuple[int | None, tuple[int, ...] | None, str | None]:
    """Validate a /v1/bind body -> (pid, npus, topology_policy); UsageError (400) otherwise."""
    if not isinstance(body, dict):
        raise UsageError("the body must be a JSON object", code="bad_request")
    unknown = sorted(set(body) - {"pid", "npu", "topology_policy"})
    if unknown:
        raise UsageError(f"unknown field(s): {', '.join(map(str, unknown))}", code="bad_request")
    pid = _int_field(body, "pid", minimum=1)
    npu = body.get("npu")
    npus: tuple[int, ...] | None
    if npu is None:
        npus = None
    elif isinstance(npu, list) and npu and len(npu) <= 64:
        npus = tuple(sorted({_int_field({"npu": n}, "npu", minimum=0) for n in npu}))  # type: ignore[misc]
    else:
        npus = (_int_field(body, "npu", minimum=0),)  # type: ignore[assignment]
    policy = body.get("topology_policy")
    if policy is not None and policy not in CHOICES["topology_policy"]:
        raise UsageError(
            f"field 'topology_policy' must be one of {', '.join(CHOICES['topology_policy'])}, got {policy!r}",
            code="bad_request",
        )
    return pid, npus, policy


def alignment_of(plan: Plan) -> tuple[bool, str | None]:
    """(aligned, failure reason code) from the planner's ``alignment`` block (issue 5).

    The planner puts that block on every plan; a plan without one (a state file
    written before it existed) was never evaluated, so it does not count as aligned.
    """
    al = plan.extra.get("alignment") if plan.extra else None
    if al is None or not hasattr(al, "get"):
        return False, None
    code = al.get("failure")
    return bool(al.get("aligned")), (str(code) if code else None)


def irq_owners(b: Binding) -> dict[int, int]:
    """IRQ number -> the NPU it was bound for, from the irq step's report."""
    out: dict[int, int] = {}
    for s in b.steps:
        if s.step is Step.IRQ:
            for entry in s.data.get("npus", ()) or ():
                for w in entry.get("writes", ()) or ():
                    out[int(w["irq"])] = int(entry["npu"])
    return out


def evictable(newcomer: int, holder: int, shared: Iterable[int], listed: Collection[tuple[int, int]]) -> bool:
    """Whether live ``holder`` gives its NPUs ``shared`` to ``newcomer``.

    ``listed`` holds the (npu, pid) pairs of npu-smi's process table: the driver's
    word on who really uses an NPU. Binding needs no proof of use, so an idle process
    bound first must not lock a real worker out; but a holder the driver lists is
    never displaced, and nobody unlisted displaces anybody.
    """
    shared = tuple(shared)
    return bool(shared) and all((n, newcomer) in listed and (n, holder) not in listed for n in shared)


def outcome_of_error(exc: BaseException) -> str:
    """SPEC §7: a bad or unauthorised request is 'rejected'; everything else 'failed'.
    A pid that vanished or was recycled under the request counts as a bad request."""
    if isinstance(exc, (UsageError, NotPermitted, ProcessGone)):
        return "rejected"
    if isinstance(exc, Conflict) and exc.code in ("policy_mismatch", "pid_recycled"):
        return "rejected"
    return "failed"


def resolve_policy(request_policy: str | None, config: Config) -> Config:
    """Koordinator precedence: request > node config > default; both set and different -> 409.

    The rule is the planner's (planner/alignment.py); this returns the Config to plan with.
    """
    return config.replace(topology_policy=planner_resolve_policy(request_policy, config))

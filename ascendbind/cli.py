"""``ascendbind`` command line: argparse verbs that wire the layers together.

No logic lives here: each verb is discover -> plan -> (apply) -> print. Every
AscendbindError becomes one line on stderr and its documented exit status.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Sequence

from . import __version__
from .command import sigterm_kills_tools
from .values.config import Config
from .errors import AscendbindError, PlanImpossible, StepFailed, UsageError
from .values.model import DeviceType, Plan
from .settings import add_config_flags, config_from_args

__all__ = ["main", "build_parser"]


def _pid(text: str) -> int:
    try:
        pid = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a pid: {text!r}") from None
    if pid <= 0:
        raise argparse.ArgumentTypeError(f"not a pid: {text!r}")
    return pid


def _npu(text: str) -> int:
    try:
        npu = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an NPU id: {text!r}") from None
    if npu < 0:
        raise argparse.ArgumentTypeError(f"not an NPU id: {text!r}")
    return npu


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ascendbind", description="Bind Ascend NPU workers to nearby CPUs.")
    parser.add_argument("--version", action="version", version=f"ascendbind {__version__}")
    sub = parser.add_subparsers(dest="verb", metavar="VERB")
    sub.required = True

    p = sub.add_parser("plan", help="discover (live or from a snapshot) and print the plan; changes nothing")
    p.add_argument("--snapshot", metavar="DIR", help="plan from a snapshot directory instead of this host")
    p.add_argument("--pid", type=_pid,
                   help="the worker (default: this process; with --snapshot, the pid it was recorded for)")
    _target_flags(p)
    p.add_argument("--format", choices=("table", "json"), default="table")
    p.add_argument("--explain", action="store_true", help="print the target NPU's evidence and rule, and the "
                   "alignment hints, merge and decision, and what the isolation level does CPU by CPU")
    add_config_flags(p, isolation_keys=True)
    p.set_defaults(func=cmd_plan, runs_tools=True)

    p = sub.add_parser("snapshot", help="record every discovery input of this host into OUT_DIR")
    p.add_argument("out_dir", metavar="OUT_DIR")
    p.add_argument("--pid", type=_pid, help="also record this worker's /proc files")
    add_config_flags(p, plan_keys=False)
    p.set_defaults(func=cmd_snapshot, runs_tools=True)

    p = sub.add_parser("apply", help="one-shot, no daemon: discover, plan and bind a process now")
    p.add_argument("--pid", type=_pid, required=True)
    _target_flags(p)
    p.add_argument("--format", choices=("table", "json"), default="table")
    add_config_flags(p)
    p.set_defaults(func=cmd_apply, runs_tools=True)

    from . import verbs

    verbs.register(sub)
    from .completion import register as register_completion

    register_completion(sub, parser)
    return parser


def _target_flags(p) -> None:
    who = p.add_mutually_exclusive_group()
    who.add_argument("--npu", type=_npu, action="append", help="target logical NPU (repeatable; default: what the "
                     "evidence about the worker says)")
    who.add_argument("--device-index", type=_npu, dest="device_index", metavar="I",
                     help="the worker's runtime device index (0 is the first device it sees)")


# ---------------------------------------------------------------- verbs


def _plan_for(source, config: Config, pid: int | None, args):
    """discover -> targets (the rule, from the evidence) -> plan; shared by plan and apply.
    The plan carries the target decision; with ``args.explain``, a refusal prints its evidence."""
    from .discovery import discover_host, discover_worker
    from .errors import Conflict
    from .planner import make_plan, resolve_targets
    from .values.targeting import TargetRequest, evidence_lines

    host = discover_host(source, config)
    worker = discover_worker(source, pid, config, want_uvb=host.device_type is DeviceType.A950)
    request = TargetRequest(npus=tuple(sorted(set(args.npu))) if args.npu else None, device_index=args.device_index)
    try:
        decision = resolve_targets(host, worker, request)
    except Conflict as exc:
        if getattr(args, "explain", False):
            print(f"targets: refused [{exc.code}]")
            print("\n".join(evidence_lines(getattr(exc, "evidence", ()))))
        raise
    plan = dataclasses.replace(make_plan(host, worker, decision.npus, config), targets=decision)
    from .applier.irq import with_planned_irqs

    return host, worker, with_planned_irqs(plan, host, config, source)


def _print_plan(plan: Plan, fmt: str) -> None:
    from .render import compact_json, plan_table

    if fmt == "json":
        print(compact_json(plan.to_json()))
    else:
        print(plan_table(plan))


def _plan_errors(plan: Plan) -> PlanImpossible:
    first = plan.errors[0]
    who = f"NPU{first.npu}: " if first.npu is not None else ""
    return PlanImpossible(f"plan impossible: {who}{first.reason}", code=first.code, plan=plan)


def cmd_plan(args) -> int:
    from .discovery import LiveHost, SnapshotHost
    from .discovery.read.sources import OneTimeoutPerTool, is_snapshot_dir
    from .planner.isolate.isolation import explain_isolation, plan_isolation

    config = config_from_args(args)
    pid = args.pid
    if args.snapshot:
        if not os.path.isdir(args.snapshot):
            raise UsageError(f"snapshot directory {args.snapshot} does not exist")
        if not is_snapshot_dir(args.snapshot):
            raise UsageError(f"{args.snapshot} is not a snapshot (no meta.json, cmd/, proc/ or sys/ in it); "
                             "record one with `ascendbind snapshot DIR`")
        source = SnapshotHost(args.snapshot)
        if pid is None:
            pid = source.recorded_pid  # the worker the snapshot was taken for
    else:
        source = OneTimeoutPerTool(LiveHost.from_config(config))
    host, worker, plan = _plan_for(source, config, pid, args)
    # what the isolation level does with this worker bound (as the only one: plan has no daemon)
    isolation = plan_isolation(host, [plan], config)
    if args.explain:
        from .planner import explain_plan

        print(explain_plan(host, worker, plan, config))
        print()
        print(explain_isolation(isolation))
        print()
    _print_plan(plan, args.format)
    if plan.errors:
        for e in plan.errors:
            print(f"NPU{e.npu}: {e.reason}" if e.npu is not None else e.reason, file=sys.stderr)
        return PlanImpossible.exit_status
    if config.isolation != "off" and isolation.error is not None:
        print(f"isolation {config.isolation}: {isolation.error.reason}", file=sys.stderr)
        return PlanImpossible.exit_status
    return 0


def cmd_snapshot(args) -> int:
    from .discovery.gather.snapshot import record_snapshot

    config = config_from_args(args)
    written = record_snapshot(args.out_dir, args.pid, config)
    print(f"wrote {len(written)} files to {args.out_dir}")
    return 0


def cmd_apply(args) -> int:
    from .applier import apply_plan
    from .discovery.gather.identity import require_worker
    from .discovery import LiveHost
    from .render import compact_json, steps_table

    from .discovery.read.sources import OneTimeoutPerTool

    config = config_from_args(args)
    require_worker(args.pid, config.proc_root)  # pid 1, kernel threads: exit 7 before any planning
    source = OneTimeoutPerTool(LiveHost.from_config(config))
    host, worker, plan = _plan_for(source, config, args.pid, args)
    for w in worker.warnings:
        print(f"warning: {w}", file=sys.stderr)
    if plan.errors:
        _print_plan(plan, args.format)
        raise _plan_errors(plan)
    binding = apply_plan(plan, worker, host, config)
    if args.format == "json":
        print(compact_json({"plan": plan.to_json(), "steps": [s.to_json() for s in binding.steps]}))
    else:
        _print_plan(plan, "table")
        print()
        print(steps_table(binding.steps))
    if binding.failed:
        failed = [s for s in binding.steps if s.outcome.value == "failed"]
        raise StepFailed(f"bound pid {args.pid}, but step {failed[0].step.value} failed: {failed[0].detail}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if getattr(args, "runs_tools", False):
            with sigterm_kills_tools():
                return int(args.func(args) or 0)
        return int(args.func(args) or 0)
    except AscendbindError as err:
        print(f"ascendbind: {err}", file=sys.stderr)
        return err.exit_status
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())

"""Human-readable tables for plans and step results (what an operator reads)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from .values.cpulist import format_cpulist
from .values.model import Plan, StepResult

__all__ = ["plan_table", "steps_table", "table", "compact_json"]


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [len(h) for h in headers]
    for row in rows:
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], len(cell))
    lines = ["  ".join(h.ljust(widths[i]) for i, h in enumerate(headers)).rstrip()]
    for row in rows:
        lines.append("  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row)).rstrip())
    return "\n".join(lines)


def _cl(cpus: Sequence[int]) -> str:
    return format_cpulist(cpus) or "-"


def plan_table(plan: Plan) -> str:
    out = [
        f"mode: {plan.mode.value}   device: {plan.device_type.value}   allowed: {_cl(plan.allowed_cpus)}",
    ]
    if plan.fallback:
        out.append(f"fallback: {plan.fallback}")
    if plan.npus:
        rows = [
            [str(p.npu), _cl(p.pool), _cl(p.irq), _cl(p.main), _cl(p.acl), _cl(p.release),
             ",".join(map(str, p.numa_nodes)) or "-"]
            for p in plan.npus
        ]
        out.append(table(["NPU", "POOL", "IRQ", "MAIN", "ACL", "RELEASE", "NUMA"], rows))
    al = plan.alignment
    if al is not None:
        line = f"alignment: policy={al.policy} aligned={'yes' if al.aligned else 'no'}"
        if al.numa_nodes:
            line += f" numa={','.join(map(str, al.numa_nodes))}"
        if al.reason:
            line += f" — {al.reason}"
        out.append(line)
    for n in sorted(plan.irqs or {}):
        p = plan.irqs[n]
        if p.moves:
            moves = ", ".join(f"IRQ {irq} -> CPU {_cl(sorted(cpus))}" for irq, cpus in p.moves)
            out.append(f"irq: NPU{n} ({p.pci}): {moves}" + (" (CQ = SQ+1)" if p.cq_guessed else ""))
        else:
            out.append(f"irq: NPU{n}: nothing to move [{p.reason.value if p.reason else '-'}] {p.detail}")
    if plan.uvb_cpus or plan.uvb_tids:
        out.append(f"uvb: cpus {_cl(plan.uvb_cpus)}, threads {len(plan.uvb_tids)}")
    for w in plan.warnings:
        who = f"NPU{w.npu}: " if w.npu is not None else ""
        out.append(f"warning [{w.code}] {who}{w.reason}")
    for e in plan.errors:
        who = f"NPU{e.npu}: " if e.npu is not None else ""
        out.append(f"error [{e.code}] {who}{e.reason}")
    return "\n".join(out)


def steps_table(steps: Sequence[StepResult]) -> str:
    rows = [[s.step.value, s.outcome.value, s.reason.value if s.reason else "-", s.detail] for s in steps]
    return table(["STEP", "OUTCOME", "REASON", "DETAIL"], rows)


def compact_json(obj: Any, *, width: int = 100, indent: int = 2) -> str:
    """JSON text for people: objects indented as usual, but a value whose one-line
    form fits in ``width`` columns stays on one line, and a long array of numbers or
    strings (a CPU list) is packed several items to a line instead of one per line.
    ``json.loads`` gives back exactly what ``json.dumps(obj)`` would."""
    return _enc(obj, 0, 0, width, indent)


def _flat(o: Any) -> str:
    return json.dumps(o, separators=(", ", ": "))


def _key(k: Any) -> str:
    # json.dumps's own rules for non-string keys (ints, bools, None)
    return json.dumps({k: 0})[1:-4]


def _enc(o: Any, level: int, used: int, width: int, indent: int) -> str:
    pad, inner = " " * (indent * level), " " * (indent * (level + 1))
    flat = _flat(o)
    if not isinstance(o, (dict, list, tuple)) or not o or len(pad) + used + len(flat) <= width:
        return flat
    if isinstance(o, dict):
        items = []
        for k, v in o.items():
            key = _key(k) + ": "
            items.append(inner + key + _enc(v, level + 1, len(key), width, indent))
        return "{\n" + ",\n".join(items) + "\n" + pad + "}"
    if any(isinstance(x, (dict, list, tuple)) for x in o):
        return "[\n" + ",\n".join(inner + _enc(x, level + 1, 0, width, indent) for x in o) + "\n" + pad + "]"
    lines: list[str] = []
    line = ""
    for text in map(_flat, o):
        if line and len(inner) + len(line) + len(", ,") + len(text) > width:
            lines.append(line + ",")
            line = text
        else:
            line = f"{line}, {text}" if line else text
    lines.append(line)
    return "[\n" + "\n".join(inner + ln for ln in lines) + "\n" + pad + "]"

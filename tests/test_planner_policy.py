"""The topology policies as objects: one table of what each admits, and no name compared elsewhere."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from ascendbind.values.config import CHOICES
from ascendbind.planner.align.hints import Hint, mask_of
from ascendbind.planner.align.policy import CPU_BIND_POLICIES, TOPOLOGY_POLICIES, cpu_bind_policy, topology_policy

PLANNER = Path(__file__).resolve().parent.parent / "ascendbind" / "planner"

# device wants node 1, cpu offers nodes {1} and {0,1}, memory has no opinion
DEVICE = [Hint(mask_of([1]), True)]
CPU = [Hint(mask_of([1]), True), Hint(mask_of([0, 1]), False)]
ANY = [Hint(None, True)]
WIDE = [Hint(mask_of([0, 1]), True)]  # only a two-node preferred hint


@pytest.mark.parametrize("name, aligns, strict, single, admits_unfit, fits_two_nodes", [
    ("none", False, False, False, True, True),
    ("best-effort", True, False, False, True, True),
    ("restricted", True, True, False, False, True),
    ("single-numa-node", True, True, True, False, False),
])
def test_each_policy_decides_from_its_own_object(name, aligns, strict, single, admits_unfit, fits_two_nodes):
    p = topology_policy(name)
    assert (p.name, p.aligns, p.strict, p.prefers_single_node) == (name, aligns, strict, single)
    assert p.admit(True) is True and p.admit(False) is admits_unfit
    assert (p.kept_note is None) is strict
    machine = mask_of([0, 1])
    merged, viable = p.merge([DEVICE, CPU, ANY], machine, prefer_closest=False, distances={})
    assert viable and merged.mask == mask_of([1]) and p.fits(merged, viable)
    merged, viable = p.merge([WIDE, WIDE, ANY], machine, prefer_closest=False, distances={})
    assert p.fits(merged, viable) is fits_two_nodes


def test_every_configurable_policy_has_exactly_one_object():
    assert tuple(TOPOLOGY_POLICIES) == CHOICES["topology_policy"]
    assert tuple(CPU_BIND_POLICIES) == CHOICES["cpu_bind_policy"]
    assert cpu_bind_policy("full-pcpus").whole_cores and not cpu_bind_policy("default").whole_cores
    with pytest.raises(KeyError):
        topology_policy("strict")


def _compared_names(path: Path) -> list[str]:
    names = set(CHOICES["topology_policy"]) | set(CHOICES["cpu_bind_policy"])
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Compare):
            for side in (node.left, *node.comparators):
                consts = [side] if isinstance(side, ast.Constant) else \
                    list(side.elts) if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else []
                found += [f"line {node.lineno}: {c.value!r}" for c in consts
                          if isinstance(c, ast.Constant) and c.value in names - {"none", "default"}]
        elif isinstance(node, ast.Dict):
            found += [f"line {node.lineno}: {k.value!r} as a key" for k in node.keys
                      if isinstance(k, ast.Constant) and k.value in names]
    return found


@pytest.mark.parametrize("path", sorted(p for p in PLANNER.rglob("*.py") if p.name != "policy.py"),
                         ids=lambda p: str(p.relative_to(PLANNER)))
def test_the_planner_asks_the_policy_object_never_compares_its_name(path):
    assert _compared_names(path) == []


def test_the_name_check_catches_a_comparison(tmp_path):
    bad = tmp_path / "probe.py"
    bad.write_text('def f(policy, c):\n    return policy in ("none", "best-effort") or policy == "single-numa-node" '
                   'or c.cpu_bind_policy == "full-pcpus" or {"restricted": 1}\n')
    assert len(_compared_names(bad)) == 4, _compared_names(bad)

"""The layering, checked on the source: a pure core inside a thin shell.

* The pure modules (the planner, the text parsers, the shared values) and
  everything they import inside the package touch nothing on the host: no
  ``os``, ``subprocess``, ``psutil`` or ``tomllib`` import and no ``open()``
  call. That is what lets a 2-CPU box plan a 640-CPU host exactly.
* The applier and the daemon read ``/proc`` and ``/sys`` only through
  discovery: no path under them is spelled there (no ``"/proc…"``/``"/sys…"``
  literal, no path built from ``proc_root``/``sys_root``) and no directory is
  listed there. They may pass ``proc_root`` along; discovery turns it into paths.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "ascendbind"

# the pure roots; whatever they import inside the package must be pure too
PURE_ROOTS = [
    "model", "cpulist", "errors", "config",
    "discovery.npu_smi", "discovery.lscpu", "discovery.procfs", "discovery.sysfs", "discovery.columns",
    "discovery.cells", "discovery.numa_maps", "discovery.irqs", "discovery.irqbalance", "discovery.proc_events",
    "discovery.devices", "targeting",
    *(f"planner.{p.stem}" for p in sorted((PKG / "planner").glob("*.py")) if p.stem != "__init__"),
    "planner",
]
HOST_MODULES = {"os", "subprocess", "psutil", "tomllib", "shutil", "socket", "ctypes"}

# files still spelling host paths themselves; each entry must still violate (a fixed
# file leaves the list) and the list is meant to end empty
SHELL_EXCEPTIONS: dict[str, str] = {
}
PURE_EXCEPTIONS: dict[str, str] = {}


def _module_file(name: str) -> Path:
    base = PKG.joinpath(*name.split("."))
    return base / "__init__.py" if base.is_dir() else base.with_suffix(".py")


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), str(path))


def _package_imports(name: str, tree: ast.Module) -> set[str]:
    """Modules of the package that ``name`` imports (relative imports resolved)."""
    pkg_parts = name.split(".") if _module_file(name).name == "__init__.py" else name.split(".")[:-1]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg_parts[: len(pkg_parts) - (node.level - 1)]
            elif node.module and node.module.startswith("ascendbind"):
                base = []
                node_module = node.module.split(".")[1:]
                mod = ".".join(node_module)
                if mod:
                    out.add(mod)
                for a in node.names:
                    cand = ".".join([*node_module, a.name])
                    if _module_file(cand).exists():
                        out.add(cand)
                continue
            else:
                continue
            mod = ".".join([*base, *(node.module.split(".") if node.module else [])])
            if mod:
                out.add(mod)
            for a in node.names:
                cand = ".".join(p for p in (mod, a.name) if p)
                if _module_file(cand).exists():
                    out.add(cand)
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("ascendbind."):
                    out.add(a.name.split(".", 1)[1])
    return {m for m in out if _module_file(m).exists()}


def _host_touches(tree: ast.Module) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [f"import {a.name}" for a in node.names if a.name.split(".")[0] in HOST_MODULES]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            if node.module.split(".")[0] in HOST_MODULES:
                found.append(f"from {node.module} import …")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "open":
            found.append(f"open() at line {node.lineno}")
    return found


def _pure_closure() -> dict[str, list[str]]:
    seen: dict[str, list[str]] = {}
    todo = list(PURE_ROOTS)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        tree = _tree(_module_file(name))
        seen[name] = _host_touches(tree)
        todo += sorted(_package_imports(name, tree) - set(seen))
    return seen


def test_the_pure_modules_and_all_they_import_touch_nothing_on_the_host():
    closure = _pure_closure()
    assert "planner.plan" in closure and "discovery.npu_smi" in closure  # the walk found the roots
    dirty = {name: found for name, found in closure.items() if found and name not in PURE_EXCEPTIONS}
    stale = [name for name in PURE_EXCEPTIONS if not closure.get(name)]
    assert not stale, f"pure now, take them off PURE_EXCEPTIONS: {stale}"
    assert not dirty, f"pure modules touching the host (or importing a module that does): {dirty}"


def _docstrings(tree: ast.Module) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                ids.add(id(body[0].value))
    return ids


def _host_paths(tree: ast.Module) -> list[str]:
    """Places where a file spells a /proc or /sys path or lists a directory itself."""
    skip = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
            # a bare root ("/proc" as a default) names no file; a path does. Prose has spaces.
            v = node.value
            if v.startswith(("/proc/", "/sys/")) and " " not in v:
                found.append(f"line {node.lineno}: {v[:40]!r}")
        elif isinstance(node, ast.JoinedStr):
            names = {n.id for v in node.values if isinstance(v, ast.FormattedValue)
                     for n in ast.walk(v.value) if isinstance(n, ast.Name)}
            texts = "".join(v.value for v in node.values if isinstance(v, ast.Constant) and isinstance(v.value, str))
            if names & {"proc_root", "sys_root"} or texts.startswith(("/proc", "/sys")):
                found.append(f"line {node.lineno}: an f-string path")
        elif isinstance(node, ast.Call):
            f = node.func
            dotted = f"{f.value.id}.{f.attr}" if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) else ""
            roots = {n.id for a in node.args for n in ast.walk(a) if isinstance(n, ast.Name)} & {"proc_root", "sys_root"}
            if dotted in ("os.listdir", "os.scandir") and (roots or any(
                    isinstance(n, ast.Constant) and str(n.value).startswith(("/proc", "/sys"))
                    for a in node.args for n in ast.walk(a))):
                found.append(f"line {node.lineno}: {dotted} under {sorted(roots) or 'a host root'}")
            if roots and isinstance(f, ast.Attribute) and f.attr == "join" \
                    and isinstance(f.value, ast.Attribute) and f.value.attr == "path":
                found.append(f"line {node.lineno}: os.path.join on {sorted(roots)}")
    return found


SHELL_FILES = sorted(p for d in ("applier", "daemon") for p in (PKG / d).rglob("*.py"))


@pytest.mark.parametrize("path", SHELL_FILES, ids=lambda p: str(p.relative_to(PKG)))
def test_the_applier_and_the_daemon_read_the_host_only_through_discovery(path):
    rel = str(path.relative_to(PKG))
    found = _host_paths(_tree(path))
    if rel in SHELL_EXCEPTIONS:
        assert found, f"{rel} no longer spells host paths: take it off SHELL_EXCEPTIONS"
        pytest.xfail(f"{rel}: {SHELL_EXCEPTIONS[rel]}")
    assert not found, f"{rel} spells host paths itself (go through discovery): {found}"


def test_the_checks_catch_what_they_are_meant_to_catch():
    bad = ast.parse('import os\nopen("x")\n')
    assert _host_touches(bad) == ["import os", "open() at line 2"]
    shell = ast.parse('def f(proc_root, pid):\n    "/proc/x in a docstring is fine"\n'
                      '    a = f"{proc_root}/{pid}/task"\n    b = "/sys/devices/x"\n    os.listdir(proc_root)\n'
                      '    os.path.join(proc_root, "stat")\n    os.listdir(state_dir)\n    c = "/proc"\n')
    assert len(_host_paths(shell)) == 4, _host_paths(shell)

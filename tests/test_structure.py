"""The layering, checked on the source: a pure core inside a thin shell.

* The pure modules and everything they import inside the package touch nothing
  on the host: no ``os``, ``subprocess``, ``psutil`` or ``tomllib`` import and no
  ``open()`` call. That is what lets a 2-CPU box plan a 640-CPU host exactly.
  Purity goes by location: every module under a pure room (values/,
  discovery/parse/, planner/) is held to it, a new one the moment it is put
  there; only the daemon's rules, which live beside the shells that carry them
  out, are named one by one.
* The applier and the daemon read ``/proc`` and ``/sys`` only through
  discovery: no path under them is spelled there (no ``"/proc…"``/``"/sys…"``
  literal, no path built from ``proc_root``/``sys_root``) and no directory is
  listed there. They may pass ``proc_root`` along; discovery turns it into paths.
* Nothing outside discovery reads the host by call either: no task's affinity
  (``os.sched_getaffinity``), no listing, no file opened to be read; the
  applier's writes are its job, its reading back goes through discovery. The
  few reads of the program's own files are named by module and function.
* No function is over 60 lines; those still being split are named, and each
  must still be too long.
* The daemon's top holds only rooms (at most 8 entries: the ``Daemon`` in
  heart/, the process in runtime/serve.py); discovery's top holds only rooms, the planner's
  its entry (plan.py, codes.py, explain.py, lint.py) and rooms. Each room's
  ``__init__`` (values/ too) is a docstring whose line ``May import: from the
  daemon, …; from the rest of ascendbind, ….`` (``from discovery``, ``from the
  planner``; values/ names only the rest) is the rule every module of the room
  is held to here. Only the ``Daemon`` changes the held table.
* No folder of the package holds more than 16 modules: past that, a folder is
  several subjects, and gets rooms.
* No import runs in a circle, and every name is imported from the module that
  defines it (a package's ``__all__`` may list its modules' names: its API).
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import pytest

PKG = Path(__file__).resolve().parent.parent / "ascendbind"

# pure by location: every module under these folders, and whatever it imports inside the package
PURE_ROOMS = ("values", "discovery/parse", "planner", "daemon/isolate/rules")
# (daemon/isolate/rules: isolation's keys, records and verdicts, a pure room inside the isolation room)
# pure by name: the daemon's rules (the lifecycle and its verdicts, requests and HTTP as values, the
# state record), which live in the daemon's rooms beside the shells
# around them, and errors.py, the one value module left at the top (a worker imports it by that name)
PURE_RULES = ["daemon.heart.table", "daemon.heart.events", "daemon.heart.effects", "daemon.heart.step",
              "daemon.watch.lifecycle", "daemon.watch.blame", "daemon.watch.bans", "daemon.watch.proof",
              "daemon.api.requests",
              "daemon.api.wire", "daemon.state.staterecord", "errors"]
MAX_MODULES = 16  # per folder
HOST_MODULES = {"os", "subprocess", "psutil", "tomllib", "tomli", "shutil", "socket", "ctypes"}

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


def _modules() -> list[str]:
    rels = (p.relative_to(PKG).with_suffix("").parts for p in sorted(PKG.rglob("*.py")))
    return [".".join(r[:-1] if r[-1] == "__init__" else r) for r in rels if r != ("__init__",)]


def _in_rooms(name: str, rooms) -> bool:
    """Whether module ``name`` lies under one of ``rooms`` (folders: ``discovery/parse``)."""
    return any(name == r.replace("/", ".") or name.startswith(r.replace("/", ".") + ".") for r in rooms)


def pure_roots(modules: list[str]) -> list[str]:
    return [m for m in modules if _in_rooms(m, PURE_ROOMS)] + PURE_RULES


def _pure_closure() -> dict[str, list[str]]:
    seen: dict[str, list[str]] = {}
    todo = pure_roots(_modules())
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
    # the walk found the roots: every module of the pure rooms, wherever it sits in them
    for room in PURE_ROOMS:
        files = [p for p in (PKG / room).rglob("*.py") if p.name != "__init__.py"]
        assert files and all(".".join(p.relative_to(PKG).with_suffix("").parts) in closure for p in files), room
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
    # by location: a module new in a pure room is held pure without being named; a reader is not
    roots = pure_roots(["discovery.parse.newformat", "discovery.parse", "discovery.read.sources",
                        "planner.pools.newrule", "planner", "values.model", "daemon.watch.reconcile"])
    assert [r for r in roots if r not in PURE_RULES] == ["discovery.parse.newformat", "discovery.parse",
                                                         "planner.pools.newrule", "planner", "values.model"]


# ---------------------------------------------------------------- reads, by call

# Outside discovery nothing reads the host: no task's affinity, no listing, no file opened to be
# read. Writing is the applier's job (a mask file opened write-only); reading back what it wrote
# goes through discovery (``read_bounded``, ``task_affinity``). The calls that read files of the
# daemon's or the user's own, never /proc or /sys, are named here by module and function, with
# why; each must still read (a stale entry fails), so that a new read beside them is caught.
OWN_FILE_READS: dict[tuple[str, str], str] = {
    ("client.py", "_tty_foreground"): "the terminal, to learn the foreground group (workers import the client alone)",
    ("mempolicy.py", "prefer_nodes"): "the worker's own status, read in the worker (stdlib only, like the client)",
    ("settings.py", "_read_toml"): "the configuration file",
    ("demo.py", "_daemon_log"): "the demo daemon's own log, shown when it does not come up",
    ("daemon/state/state.py", "_open_dir"): "the state directory, held open",
    ("daemon/state/state.py", "clean"): "the state directory's entries (leftovers to remove)",
    ("daemon/state/state.py", "_load_at"): "the checkpoint",
    ("daemon/state/state.py", "_create_exclusive"): "a new checkpoint file (its flags are a variable)",
    ("daemon/state/statedir.py", "trusted_state_dir"): "the state path's links, checked for who may change them",
}
_READ_CALLS = {"os.listdir", "os.scandir", "os.walk", "os.readlink", "glob.glob", "glob.iglob"}
_READ_METHODS = {"read_text", "read_bytes", "iterdir", "glob", "rglob"}
_WRITE_FLAGS = {"O_WRONLY", "O_PATH"}  # os.open neither reads: a write, or a handle for *at() calls


def _dotted_call(f: ast.expr) -> str:
    return f"{f.value.id}.{f.attr}" if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) else ""


def _opens_to_read(node: ast.Call, name: str) -> bool:
    """Whether ``open(...)``/``os.open(...)`` may read: a mode or flags this cannot see counts as reading."""
    if name == "os.open":
        flags = node.args[1] if len(node.args) > 1 else next((k.value for k in node.keywords if k.arg == "flags"), None)
        named = {n.attr for n in ast.walk(flags) if isinstance(n, ast.Attribute)} if flags is not None else set()
        return not named & _WRITE_FLAGS
    mode = node.args[1] if len(node.args) > 1 else next((k.value for k in node.keywords if k.arg == "mode"), None)
    if mode is None:
        return True
    if not (isinstance(mode, ast.Constant) and isinstance(mode.value, str)):
        return True
    return "r" in mode.value or "+" in mode.value


def host_reads(tree: ast.Module) -> list[tuple[str, str]]:
    """(enclosing function, what) for every read of a file, a directory or a task's mask."""
    found: list[tuple[str, str]] = []

    def visit(node: ast.AST, func: str) -> None:
        for child in ast.iter_child_nodes(node):
            here = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else func
            what = None
            if isinstance(child, ast.Attribute) and child.attr == "sched_getaffinity":
                what = "sched_getaffinity"  # called or bound to a name: either reads masks
            elif isinstance(child, ast.Call):
                name = _dotted_call(child.func) or (child.func.id if isinstance(child.func, ast.Name) else "")
                if name in ("open", "io.open", "os.open") and _opens_to_read(child, name):
                    what = f"{name}() to read"
                elif name in _READ_CALLS:
                    what = name
                elif isinstance(child.func, ast.Attribute) and child.func.attr in _READ_METHODS:
                    what = f".{child.func.attr}()"
            if what:
                found.append((func, f"line {child.lineno}: {what}"))
            visit(child, here)

    visit(tree, "<module>")
    return found


OUTSIDE_DISCOVERY = sorted(p for p in PKG.rglob("*.py") if p.relative_to(PKG).parts[0] != "discovery")


@pytest.mark.parametrize("path", OUTSIDE_DISCOVERY, ids=lambda p: str(p.relative_to(PKG)))
def test_nothing_outside_discovery_reads_a_file_a_listing_or_a_tasks_mask(path):
    rel = str(path.relative_to(PKG))
    found = host_reads(_tree(path))
    kept = {func for (mod, func) in OWN_FILE_READS if mod == rel}
    for func in kept:
        assert any(f == func for f, _ in found), f"{rel}:{func} reads nothing now: take it off OWN_FILE_READS"
    bad = [f"{func}: {what}" for func, what in found if func not in kept]
    assert not bad, f"{rel} reads the host itself (go through discovery: read_bounded, task_affinity): {bad}"


def test_the_read_check_catches_each_kind_of_read_and_lets_writes_pass():
    planted = ast.parse(
        "import os\n"
        "def look(tid, path, d):\n"
        "    getaff = os.sched_getaffinity\n"  # bound for a loop: still a read
        "    os.sched_getaffinity(tid)\n"
        "    open(path).read()\n"
        "    open(path, 'r+')\n"
        "    open(path, mode)\n"
        "    os.open(path, os.O_RDONLY)\n"
        "    os.open(path, flags)\n"
        "    os.listdir(d)\n"
        "    os.scandir(d)\n"
        "    d.iterdir()\n"
        "    d.read_text()\n"
        "    d.read_bytes()\n"
        "def write(path, text):\n"
        "    fd = os.open(path, os.O_WRONLY | os.O_TRUNC | os.O_CLOEXEC)\n"
        "    os.open(path, os.O_PATH | os.O_DIRECTORY)\n"
        "    open(path, 'w').write(text)\n"
        "    open(path, mode='ab')\n"
        "    sock.open()\n")
    found = host_reads(planted)
    assert [f for f, _ in found] == ["look"] * 12, found
    assert [w.split(": ", 1)[1] for _, w in found[:3]] == ["sched_getaffinity", "sched_getaffinity", "open() to read"]


# ---------------------------------------------------------------- function length

MAX_FUNCTION_LINES = 60  # a function fits on a screen; past that it is two ideas
# functions still being split; each must still be too long (a fixed one leaves the list), and the
# list is meant to end empty
LONG_FUNCTIONS: dict[str, str] = {
}


def long_functions(tree: ast.Module, limit: int = MAX_FUNCTION_LINES) -> dict[str, int]:
    """``Class.method`` / ``function`` -> its length in lines (decorators aside), for those over ``limit``."""
    found: dict[str, int] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef) and child.end_lineno - child.lineno + 1 > limit:
                    found[name] = child.end_lineno - child.lineno + 1
                visit(child, f"{name}.")
            else:
                visit(child, prefix)

    visit(tree, "")
    return found


def test_no_function_in_the_package_is_over_60_lines():
    found = {f"{p.relative_to(PKG)}:{name}": n for p in sorted(PKG.rglob("*.py"))
             for name, n in long_functions(_tree(p)).items()}
    fixed = sorted(set(LONG_FUNCTIONS) - set(found))
    assert not fixed, f"no longer over {MAX_FUNCTION_LINES} lines, take them off LONG_FUNCTIONS: {fixed}"
    new = {k: v for k, v in found.items() if k not in LONG_FUNCTIONS}
    assert not new, f"functions over {MAX_FUNCTION_LINES} lines (split them by idea): {new}"


def test_the_length_check_measures_every_function_and_names_it_by_its_class():
    body = "\n".join(f"    x{i} = {i}" for i in range(59))
    src = (f"class A:\n    def short(self):\n{body}\n\n"  # 60 lines: the limit itself passes
           f"    def long(self):\n{body}\n        y = 1\n\n"
           f"def outer():\n    def inner():\n{body}\n        z = 2\n    return inner\n")
    src = src.replace("\n    x", "\n        x")
    found = long_functions(ast.parse(src))
    assert found == {"A.long": 61, "outer": 63, "outer.inner": 61}, found


# ---------------------------------------------------------------- rooms

# the folders whose top holds rooms, and the modules each keeps at its top
HOMES = {
    "daemon": (),  # the Daemon lives in heart/, the process in runtime/
    "discovery": (),
    "planner": ("plan", "codes", "explain", "lint"),  # the entry, its codes, and what reads a plan
}
ROOMS = sorted([f"{home}.{p.name}" for home in HOMES for p in (PKG / home).iterdir() if (p / "__init__.py").is_file()]
               + ["values"])
_RULE = re.compile(r"May import: (?:from (?:the )?(?P<home>[a-z_]+), (?P<inside>[^;]+); )?"
                   r"from the rest of ascendbind, (?P<outside>.+?)\.(?:\s|$)")
_PATHS = re.compile(r"\b[a-z_]+/(?:[a-z_]+\.py)?|\b[a-z_]+\.py\b")


def _dotted(base: str, path: str) -> str:
    """With base ``daemon``: ``api/requests.py`` -> ``daemon.api.requests``, ``runtime/`` -> ``daemon.runtime``."""
    parts = [*base.split("."), *path.removesuffix("/").removesuffix(".py").split("/")]
    return ".".join(p for p in parts if p)


class Rule(NamedTuple):
    inside: frozenset[str]  # what of the room's home it may import
    but: frozenset[str] | None = None  # what of the rest it must not ("anything but …")
    only: frozenset[str] | None = None  # what of the rest it may ("only …"; "nothing": empty)


def room_rule(doc: str, home: str = "daemon") -> Rule:
    """The import rule a room's docstring states; ``home`` is the package the room lives in ("" at the top)."""
    m = _RULE.search(" ".join(doc.split()))
    assert m, "a room's docstring ends with 'May import: from the daemon, …; from the rest of ascendbind, ….'"
    assert (m["home"] or "") == home, f"the rule names {m['home']!r}, the room lives in {home!r}"
    inside = (m["inside"] or "nothing").strip()
    allowed = frozenset() if inside == "nothing" else frozenset(_dotted(home, t) for t in _PATHS.findall(inside))
    assert inside == "nothing" or allowed, f"no room or module named in {inside!r}"
    outside = m["outside"].strip()
    named = frozenset(_dotted("", t) for t in _PATHS.findall(outside))
    if outside == "nothing":
        return Rule(allowed, only=frozenset())
    if outside.startswith("only "):
        assert named, outside
        return Rule(allowed, only=named)
    assert outside == "anything" or outside.startswith("anything but "), outside
    return Rule(allowed, but=named)


def _under(name: str, roots) -> bool:
    return any(name == r or name.startswith(r + ".") for r in roots)


def room_violations(room: str, rule: Rule, imports: dict[str, set[str]]) -> list[str]:
    """``module imports dep`` for each import of the room's modules that its rule forbids;
    ``room`` is dotted (``daemon.watch``, ``values``)."""
    home = room.rpartition(".")[0]
    bad = []
    for mod, deps in sorted(imports.items()):
        for dep in sorted(deps):
            if _under(dep, [room]):
                continue
            if home and _under(dep, [home]):
                ok = _under(dep, rule.inside)
            elif rule.only is not None:
                ok = _under(dep, rule.only)
            else:
                ok = not _under(dep, rule.but or ())
            if not ok:
                bad.append(f"{mod} imports {dep}")
    return bad


@pytest.mark.parametrize("home", sorted(HOMES))
def test_a_homes_top_holds_its_own_modules_and_the_rooms(home):
    folder = PKG / home
    rooms = [r.partition(".")[2] for r in ROOMS if r.partition(".")[0] == home]
    entries = {p.name for p in folder.iterdir() if p.name != "__pycache__"}
    assert rooms, home
    assert entries == {"__init__.py", *(f"{m}.py" for m in HOMES[home]), *rooms}, "put a new module in a room"
    assert home != "daemon" or set(rooms) >= {"api", "heart", "host", "state", "watch", "runtime", "isolate"}
    assert home != "daemon" or len(entries) <= 8, f"the daemon's top holds {len(entries)} entries: {sorted(entries)}"
    assert home != "discovery" or set(rooms) >= {"parse", "read", "gather"}
    inits = [folder / r / "__init__.py" for r in rooms] + ([folder / "__init__.py"] if home == "daemon" else [])
    for init in [*inits, PKG / "values" / "__init__.py"]:
        body = _tree(init).body
        assert len(body) == 1 and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant), \
            f"{init.relative_to(PKG)}: a docstring and nothing else (import a name from the module that defines it)"


@pytest.mark.parametrize("room", ROOMS)
def test_each_room_imports_only_what_its_docstring_allows(room):
    folder = PKG.joinpath(*room.split("."))
    rule = room_rule(ast.get_docstring(_tree(folder / "__init__.py")) or "", room.rpartition(".")[0])
    mods = [m for m in _modules() if m.startswith(f"{room}.")]
    assert mods, room
    imports = {m: _package_imports(m, _tree(_module_file(m))) for m in mods}
    bad = room_violations(room, rule, imports)
    assert not bad, f"{folder.relative_to(PKG)}/__init__.py does not allow: {bad}"


def test_a_parser_room_may_import_no_reader():
    """discovery/parse/'s own rule: the values and the errors, nothing that reads."""
    rule = room_rule(ast.get_docstring(_tree(PKG / "discovery" / "parse" / "__init__.py")) or "", "discovery")
    assert rule == Rule(frozenset(), only=frozenset({"values", "errors"}))


def test_the_process_plumbing_imports_no_other_room():
    """runtime/ holds serve.py, which starts every room; the rest of runtime/ is plumbing
    every room may use, so it imports nothing of the daemon (nor more than eventfd.py)."""
    for m in [m for m in _modules() if m.startswith("daemon.runtime.") and m != "daemon.runtime.serve"]:
        deps = _package_imports(m, _tree(_module_file(m)))
        assert deps <= {"eventfd"} | {d for d in deps if d.startswith("daemon.runtime.")}, (m, deps)


def crowded(root: Path) -> dict[str, int]:
    """Folders under ``root`` holding more than MAX_MODULES modules (``.py`` files but ``__init__.py``)."""
    counts = {str(d.relative_to(root.parent)): sum(1 for p in d.glob("*.py") if p.name != "__init__.py")
              for d in [root, *root.rglob("*")] if d.is_dir() and d.name != "__pycache__"}
    return {d: n for d, n in sorted(counts.items()) if n > MAX_MODULES}


def test_no_folder_holds_more_than_16_modules():
    assert not crowded(PKG), f"more than {MAX_MODULES} modules: give these folders rooms: {crowded(PKG)}"


_MUTATORS = {"pop", "popitem", "clear", "update", "setdefault"}


def _held_table_changes(tree: ast.Module) -> list[int]:
    """Lines that assign or delete ``….held`` or ``….held[…]``, or call a dict mutator on ``….held``."""
    def is_held(n):
        return isinstance(n, ast.Attribute) and n.attr == "held"
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Attribute, ast.Subscript)) and isinstance(node.ctx, (ast.Store, ast.Del)) \
                and (is_held(node) or (isinstance(node, ast.Subscript) and is_held(node.value))):
            lines.append(node.lineno)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr in _MUTATORS and is_held(node.func.value):
            lines.append(node.lineno)
    return lines


def test_only_the_daemon_changes_the_held_table():
    changers = {str(p.relative_to(PKG)) for p in PKG.rglob("*.py") if _held_table_changes(_tree(p))}
    assert changers == {"daemon/heart/daemon.py"}, changers


_DAEMON_NAMES = {"daemon", "d", "self.daemon", "self._daemon"}


def _dotted_name(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted_name(node.value)}.{node.attr}"
    return ""


def daemon_reaches(tree: ast.Module) -> list[str]:
    """Places where a room takes a lock that is not its own (``<something>.lock``) or uses a
    private name of the daemon it is handed (``daemon._x``, ``self.daemon._x``)."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        base = _dotted_name(node.value)
        if node.attr == "lock" and base != "self":
            found.append(f"line {node.lineno}: {base}.lock")
        elif node.attr.startswith("_") and not node.attr.startswith("__") and base in _DAEMON_NAMES:
            found.append(f"line {node.lineno}: {base}.{node.attr}")
    return found


ROOM_FILES = sorted(p for p in (PKG / "daemon").rglob("*.py") if "heart" not in p.relative_to(PKG / "daemon").parts)


@pytest.mark.parametrize("path", ROOM_FILES, ids=lambda p: str(p.relative_to(PKG)))
def test_rooms_read_the_held_table_through_its_reader(path):
    """heart/ holds the daemon's lock and its private names; a room is handed the ``Daemon``
    and uses its reader and its public operations."""
    found = daemon_reaches(_tree(path))
    assert not found, f"{path.relative_to(PKG)} reaches into the daemon (use daemon.reader or a public operation): {found}"


def test_the_reader_check_catches_a_room_that_reaches_in():
    tree = ast.parse("with daemon.lock:\n    pass\nd._first_allowance(w, h)\nself.daemon._claim()\n"
                     "self.lock.acquire()\ndaemon.reader.records()\nself._x = 1\nother._y\n")
    assert daemon_reaches(tree) == ["line 1: daemon.lock", "line 3: d._first_allowance", "line 4: self.daemon._claim"]


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` as [a, b, …, a], or None."""
    done: set[str] = set()
    path: list[str] = []

    def visit(n: str) -> list[str] | None:
        path.append(n)
        for m in sorted(graph.get(n, ())):
            if m in path:
                return path[path.index(m):] + [m]
            if m not in done and (found := visit(m)):
                return found
        done.add(path.pop())
        return None
    for n in sorted(graph):
        if n not in done and (found := visit(n)):
            return found
    return None


def test_no_import_runs_in_a_circle():
    graph = {m: _package_imports(m, _tree(_module_file(m))) - {m} for m in _modules()}
    assert "cli" in graph and graph["daemon.runtime.serve"]  # the walk sees the whole package
    assert _cycle(graph) is None, f"import cycle: {' -> '.join(_cycle(graph))}"


# names a module lists in __all__ without defining them: its public surface for callers outside the package
PUBLIC_REEXPORTS = {"client": {"DEFAULT_SOCKET"}}  # workers import the client module alone


def _defined(tree: ast.Module) -> set[str]:
    names: set[str] = set()

    def visit(body):
        for n in body:
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(n.name)
            elif isinstance(n, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                for t in n.targets if isinstance(n, ast.Assign) else [n.target]:
                    names.update(x.id for x in ast.walk(t) if isinstance(x, ast.Name))
            elif isinstance(n, (ast.If, ast.Try)):
                handlers = [h.body for h in getattr(n, "handlers", [])]
                for block in (n.body, n.orelse, getattr(n, "finalbody", []), *handlers):
                    visit(block)
    visit(tree.body)
    return names


def _all_of(tree: ast.Module) -> list[str]:
    for n in tree.body:
        if isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in n.targets):
            return list(ast.literal_eval(n.value))
    return []


def _imported_names(name: str | None, tree: ast.Module) -> Iterator[tuple[int, str, str]]:
    """(line, module of the package, name) for each ``from … import name`` of the package in ``tree``;
    ``name`` is the importing module (None outside the package: absolute imports only)."""
    pkg = [] if name is None else name.split(".") if _module_file(name).name == "__init__.py" else name.split(".")[:-1]
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level and name is not None:
            mod = ".".join([*pkg[: len(pkg) - (node.level - 1)], *([node.module] if node.module else [])])
        elif not node.level and node.module and node.module.split(".")[0] == "ascendbind":
            mod = node.module.partition(".")[2]
        else:
            continue
        for a in node.names:
            yield node.lineno, mod, a.name


def reexport_violations(files: dict[str, tuple[str | None, ast.Module]]) -> list[str]:
    """Names imported from a module that only imports them, and ``__all__`` entries a module only imports."""
    trees = {m: _tree(_module_file(m)) for m in _modules()}
    defined = {m: _defined(t) for m, t in trees.items()}
    bad = []
    for m, t in trees.items():
        if _module_file(m).name != "__init__.py":
            bad += [f"{m}.__all__ lists {n}, defined elsewhere" for n in _all_of(t)
                    if n not in defined[m] and n not in PUBLIC_REEXPORTS.get(m, ())]
    for where, (name, tree) in files.items():
        for line, mod, n in _imported_names(name, tree):
            if mod not in defined or n in defined[mod] or f"{mod}.{n}" in defined:
                continue  # the module defines it, or it is a submodule (or a module outside this walk)
            if _module_file(mod).name == "__init__.py" and n in _all_of(trees[mod]):
                continue  # a package's API
            bad.append(f"{where}:{line}: {n} from {mod or 'ascendbind'}, which only imports it")
    return bad


def test_each_name_is_imported_from_the_module_that_defines_it():
    root = PKG.parent
    files = {str(_module_file(m).relative_to(root)): (m, _tree(_module_file(m))) for m in _modules()}
    for d in ("tests", "bench"):
        files.update({str(p.relative_to(root)): (None, _tree(p)) for p in sorted((root / d).rglob("*.py"))})
    assert len(files) > 150
    bad = reexport_violations(files)
    assert not bad, bad


def test_the_room_and_import_checks_catch_what_they_are_meant_to_catch():
    doc = ("Owns x.\n\nMay import: from the daemon, runtime/ and api/requests.py; from the\n"
           "rest of ascendbind, anything but applier/.\n")
    rule = room_rule(doc)
    assert rule == Rule(frozenset({"daemon.runtime", "daemon.api.requests"}), but=frozenset({"applier"}))
    assert room_rule("May import: from the daemon, nothing; from the rest of ascendbind, nothing.") \
        == Rule(frozenset(), only=frozenset())
    imports = {"daemon.watch.x": {"daemon.watch.y", "daemon.runtime.stopflag", "daemon.api.requests", "daemon.api.wire",
                                  "daemon.core", "applier.irq", "planner"}}
    assert room_violations("daemon.watch", rule, imports) == ["daemon.watch.x imports applier.irq",
                                                              "daemon.watch.x imports daemon.api.wire",
                                                              "daemon.watch.x imports daemon.core"]
    parse = room_rule("May import: from discovery, nothing; from the rest of ascendbind, only values/ and errors.py.",
                      "discovery")
    imports = {"discovery.parse.x": {"discovery.parse.y", "values.model", "errors", "discovery.read.sources",
                                     "command", "planner"}}
    assert room_violations("discovery.parse", parse, imports) == ["discovery.parse.x imports command",
                                                                  "discovery.parse.x imports discovery.read.sources",
                                                                  "discovery.parse.x imports planner"]
    top = room_rule("May import: from the rest of ascendbind, only errors.py.", "")
    assert room_violations("values", top, {"values.a": {"values.b", "errors", "settings"}}) == ["values.a imports settings"]
    changes = ast.parse("d.held[pid] = h\ndel self.held[p]\nd.held.pop(p)\nself.held = {}\nh = d.held.get(p)\n"
                        "job.held is h\nn = len(self.held)\n")
    assert _held_table_changes(changes) == [1, 2, 3, 4]
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None
    fake = ast.parse("from ascendbind.values.model import Plan, Step\nfrom ascendbind.discovery import LiveHost\n")
    assert reexport_violations({"t.py": (None, fake)}) == ["t.py:1: Step from values.model, which only imports it"]


def test_the_folder_count_catches_a_crowded_folder(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "room").mkdir(parents=True)
    for i in range(MAX_MODULES):
        (pkg / f"m{i}.py").write_text("")
        (pkg / "room" / f"m{i}.py").write_text("")
    (pkg / "__init__.py").write_text("")
    assert crowded(pkg) == {}
    (pkg / "room" / "one_more.py").write_text("")
    assert crowded(pkg) == {"pkg/room": MAX_MODULES + 1}


def unused_private(text: str) -> list[str]:
    """The module-private top-level functions and classes of a module's ``text`` that
    nothing in it names again: left behind, or (as a merge once did to the bounded
    read's 64 KiB pieces) kept while their one use was lost."""
    out = []
    for node in ast.parse(text).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) \
                and node.name.startswith("_") and not node.name.startswith("__"):
            if len(re.findall(rf"\b{re.escape(node.name)}\b", text)) < 2:
                out.append(node.name)
    return out


def test_no_module_keeps_a_private_function_it_never_uses():
    bad = {str(p.relative_to(PKG.parent)): names for p in sorted(PKG.rglob("*.py"))
           if (names := unused_private(p.read_text()))}
    assert not bad, bad


def test_the_unused_check_catches_a_helper_whose_use_was_lost():
    kept = "def _pieces(fh):\n    return fh.read(4)\n\n\ndef read(fh):\n    return _pieces(fh)\n"
    lost = "def _pieces(fh):\n    return fh.read(4)\n\n\ndef read(fh):\n    return fh.read()\n"
    assert unused_private(kept) == []
    assert unused_private(lost) == ["_pieces"]

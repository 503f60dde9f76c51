"""The package needs nothing newer than Python 3.9, the oldest Python on the hosts it serves.

A version linter (vermin) reads every module of ``ascendbind/`` for stdlib modules,
members, syntax and annotation forms by the version that brought them. It is a first
sieve, fast and on the host's Python: it does not know a value's type (``n.bit_count()``
on an int passes it) nor behaviour that changed between versions (``socket.timeout``
became ``TimeoutError`` in 3.10). What settles it is the suite run by a real Python 3.9
in a Debian 11 root (tests/test_debian_roots.py).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import tomllib
from pathlib import Path

from tests.deploy_tools import missing

ROOT = Path(__file__).resolve().parent.parent
OLDEST = "3.9"


def test_pyproject_admits_the_oldest_python():
    with open(ROOT / "pyproject.toml", "rb") as fh:
        project = tomllib.load(fh)["project"]
    assert project["requires-python"] == f">={OLDEST}"
    # the TOML reader before 3.11 is tomli, a dependency only there
    assert any(d.replace(" ", "").startswith("tomli>=") and "python_version<'3.11'" in d.replace(" ", "")
               for d in project["dependencies"]), project["dependencies"]


def test_no_module_of_the_package_needs_a_newer_python():
    if importlib.util.find_spec("vermin") is None:
        missing("vermin (the test extra)")
    # --eval-annotations: an annotation evaluated at run time (a module without
    # `from __future__ import annotations`) counts; `# novermin` marks a line behind a version check
    r = subprocess.run([sys.executable, "-c", "import sys, vermin; sys.exit(vermin.main())",
                        f"--target={OLDEST}-", "--violations", "--eval-annotations", "--no-tips", str(ROOT / "ascendbind")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert "Minimum required versions: 3.9" in r.stdout or "No known reason" in r.stdout, r.stdout[-2000:]

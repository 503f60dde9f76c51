"""Packaging: the sdist is complete and its tests run, building prints no deprecation
banner, `make install-service` gives units that verify and point at the installed
command, the example config names every key, `.gitignore` hides no tracked file.

Builds run without network access (`--no-isolation`, the venv's setuptools) from a
copy of the tree, so the checkout is never written to.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from ascendbind.values.config import Config
from ascendbind.settings import load_config

ROOT = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent
BANNER = re.compile(r"deprecat|!!\s*$|\*{20}", re.I | re.M)
UNSHIPPED = (".ci/", ".gitignore")  # repository plumbing, not part of the product


def tracked_files() -> list[str] | None:
    """The checkout's tracked files, or None when this is not a git checkout (an sdist)."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        return None
    out = subprocess.run(["git", "-C", str(ROOT), "ls-files"], capture_output=True, text=True, timeout=60)
    return out.stdout.splitlines() if out.returncode == 0 else None


def run(argv, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=300, **kw)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(source copy, sdist path, build output) — one sdist per test module."""
    base = tmp_path_factory.mktemp("pkg")
    src = base / "src"
    junk = shutil.ignore_patterns(".git", ".venv", "__pycache__", "*.egg-info", "build", "dist", ".pytest_cache",
                                  ".hypothesis", ".run")
    shutil.copytree(ROOT, src, ignore=junk, symlinks=True)
    r = run([sys.executable, "-m", "build", "--sdist", "--no-isolation", "--outdir", str(base / "dist"), str(src)])
    assert r.returncode == 0, r.stdout + r.stderr
    (sdist,) = (base / "dist").glob("ascendbind-*.tar.gz")
    return src, sdist, r.stdout + r.stderr


def test_building_the_sdist_prints_no_deprecation_banner(built):
    _src, _sdist, output = built
    assert not BANNER.search(output), output


def test_the_sdist_carries_every_shipped_file_with_its_mode(built):
    _src, sdist, _ = built
    with tarfile.open(sdist) as tar:
        members = {m.name.partition("/")[2]: m for m in tar.getmembers() if m.isfile()}
    required = ["LICENSE", "README.md", "Makefile", "pyproject.toml", "config.example.toml", "MANIFEST.in",
                "fixtures/bin/npu-smi", "systemd/ascendbind.service", "systemd/ascendbind.socket",
                "docs/daemon.md", "docs/integrations.md", "tests/conftest.py", "tests/vllm_standin.py",
                "bench/plan.py", "ascendbind/integrations.py"]
    tracked = tracked_files()
    if tracked is not None:
        required += [f for f in tracked if not f.startswith(UNSHIPPED)]
    missing = sorted(set(required) - set(members))
    assert not missing, missing
    assert members["fixtures/bin/npu-smi"].mode & 0o111, "the fake npu-smi lost its exec bit"
    assert not [n for n in members if "__pycache__" in n or n.endswith(".pyc")]
    with tarfile.open(sdist) as tar:
        pkg_info = tar.extractfile(next(m for m in tar.getmembers() if m.name.endswith("/PKG-INFO"))).read().decode()
    assert "License-Expression: Apache-2.0" in pkg_info and "License-File: LICENSE" in pkg_info


def test_the_sdists_own_tests_run_from_it(built, tmp_path):
    _src, sdist, _ = built
    with tarfile.open(sdist) as tar:
        tar.extractall(tmp_path, filter="data")
    (tree,) = tmp_path.glob("ascendbind-*")
    env = {**os.environ, "PYTHONPATH": str(tree)}
    probe = run([sys.executable, "-c", "import ascendbind; print(ascendbind.__file__)"], cwd=tree, env=env)
    assert probe.stdout.startswith(str(tree)), probe.stdout + probe.stderr  # the sdist's code, not the checkout's
    # fixtures/ (golden plans), systemd/ (units) and the example config, read from the sdist's own tree
    r = run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_golden_plans.py",
             "tests/test_daemon_systemd_units.py", "tests/test_packaging.py::test_the_example_config_names_every_key"],
            cwd=tree, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert re.search(r"\b\d+ passed", r.stdout) and "failed" not in r.stdout, r.stdout[-2000:]


@pytest.fixture(scope="module")
def pip_installed(built, tmp_path_factory):
    """`pip install` of the sdist into a prefix, the way root's pip fills /usr/local. --ignore-installed:
    without it pip would first uninstall the checkout's own editable install from the venv."""
    _src, sdist, _ = built
    prefix = tmp_path_factory.mktemp("prefix")
    r = run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index",
             "--ignore-installed", "--prefix", str(prefix), str(sdist)])
    assert r.returncode == 0, r.stdout + r.stderr
    assert (VENV_BIN / "ascendbind").exists(), "the venv's own install was removed"
    return prefix, r.stdout + r.stderr


def test_pip_install_prints_no_deprecation_banner(pip_installed):
    _prefix, output = pip_installed
    assert not BANNER.search(output), output


def install_service(destdir: Path, **make_vars: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("ASCENDBIND", "DESTDIR", "MAKEFLAGS", "MAKELEVEL")}
    env.update(make_vars.pop("env", {}))
    args = [f"{k}={v}" for k, v in make_vars.items()]
    return run(["make", "-s", "-C", str(ROOT), "install-service", f"DESTDIR={destdir}", *args], env=env)


def unit_settings(path: Path) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in path.read_text().splitlines():
        if "=" in line and not line.lstrip().startswith(("#", "[")):
            key, _, value = line.partition("=")
            out.setdefault(key.strip(), []).append(value.strip())
    return out


@pytest.mark.skipif(shutil.which("make") is None, reason="make missing")
def test_install_service_points_the_unit_at_the_pip_installed_command(pip_installed, tmp_path):
    prefix, _ = pip_installed
    command = prefix / "bin" / "ascendbind"
    assert os.access(command, os.X_OK)
    site = next(prefix.glob("lib/python3*/site-packages"))
    r = run([str(command), "--version"], env={**os.environ, "PYTHONPATH": str(site)})
    assert r.returncode == 0 and r.stdout.strip() == "ascendbind 0.1.0", r.stdout + r.stderr

    dest = tmp_path / "root"
    r = install_service(dest, ASCENDBIND=str(command))
    assert r.returncode == 0, r.stdout + r.stderr
    units = dest / "etc/systemd/system"
    service = unit_settings(units / "ascendbind.service")
    assert service["ExecStart"] == [f"{command} serve"]
    for unit in ("ascendbind.service", "ascendbind.socket"):
        for doc in unit_settings(units / unit)["Documentation"]:
            assert doc.startswith("file:/"), doc
            assert (dest / doc.removeprefix("file:/")).is_file(), f"{unit}: {doc} not installed"
    assert (dest / "usr/share/doc/ascendbind/config.example.toml").is_file()
    if shutil.which("systemd-analyze"):
        v = run(["systemd-analyze", "verify", str(units / "ascendbind.service"), str(units / "ascendbind.socket")])
        assert v.returncode == 0 and v.stderr.strip() == "", v.stderr


@pytest.mark.skipif(shutil.which("make") is None, reason="make missing")
def test_install_service_finds_the_command_on_path(tmp_path):
    r = install_service(tmp_path, env={"PATH": f"{VENV_BIN}:/usr/bin:/bin"})
    assert r.returncode == 0, r.stdout + r.stderr
    service = unit_settings(tmp_path / "etc/systemd/system/ascendbind.service")
    assert service["ExecStart"] == [f"{VENV_BIN / 'ascendbind'} serve"]


@pytest.mark.skipif(shutil.which("make") is None, reason="make missing")
@pytest.mark.parametrize("command, why", [
    ("bin/ascendbind", "not an absolute path"),
    ("/home/alice/venv/bin/ascendbind", "ProtectHome"),
    ("/root/.local/bin/ascendbind", "ProtectHome"),
    ("/opt/no such/ascendbind", "only letters"),
    ("/opt/x|y/ascendbind", "only letters"),
    ("/nonexistent/ascendbind", "not an executable"),
])
def test_install_service_refuses_a_command_the_unit_could_not_run(tmp_path, command, why):
    r = install_service(tmp_path, ASCENDBIND=command)
    assert r.returncode != 0 and why in r.stderr, r.stdout + r.stderr
    assert not any(tmp_path.iterdir()), "nothing may be installed"


@pytest.mark.skipif(shutil.which("make") is None, reason="make missing")
def test_install_completion_writes_the_generated_script(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL")}
    r = run(["make", "-s", "-C", str(ROOT), "install-completion", f"DESTDIR={tmp_path}",
             f"ASCENDBIND={VENV_BIN / 'ascendbind'}"], env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    script = (tmp_path / "usr/share/bash-completion/completions/ascendbind").read_text()
    expected = run([str(VENV_BIN / "ascendbind"), "completion", "bash"]).stdout
    assert script == expected and "complete -F _ascendbind ascendbind" in script


def test_the_example_config_names_every_key(tmp_path):
    example = ROOT / "config.example.toml"
    defaults = {f.name: f.default for f in dataclasses.fields(Config) if f.name != "explicit"}
    # as shipped, every line is commented out: loading it changes nothing
    assert load_config(str(example), env={}) == Config()
    # uncommented, each `# key = value` line must be a known key set to its real default
    text = example.read_text()
    keys = re.findall(r"^# (\w+) = ", text, re.M)
    assert sorted(keys) == sorted(set(keys)), "a key is listed twice"
    assert set(keys) == set(defaults), f"missing: {sorted(set(defaults) - set(keys))}, " \
                                       f"unknown: {sorted(set(keys) - set(defaults))}"
    live = tmp_path / "config.toml"
    live.write_text(re.sub(r"^# (\w+ = )", r"\1", text, flags=re.M))
    cfg = load_config(str(live), env={})
    assert cfg.explicit == frozenset(defaults)
    assert {k: getattr(cfg, k) for k in defaults} == defaults


def test_gitignore_hides_no_tracked_file():
    if tracked_files() is None:
        pytest.skip("not a git checkout")
    r = run(["git", "-C", str(ROOT), "ls-files", "-ci", "--exclude-standard"])
    assert r.returncode == 0 and r.stdout == "", r.stdout

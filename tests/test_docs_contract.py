"""The contract documents under docs/ say what the code does, table by table.

Each test reads a table of a document and compares it with the thing it
describes, taken from the code or from its real output: the argument parser
(cli.md), the Config dataclass and its choices (config.md), the planner's code
sets (errors.md, alignment.md), plans the CLI prints for fixture hosts and an
`apply` that binds a real worker (plan-json.md), a snapshot recorded on this
host plus the fixture hosts (snapshot.md), and the API's routes and error codes
(api.md). A key, flag, code or file added on one side only fails here.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from ascendbind import errors
from ascendbind.cli import build_parser
from ascendbind.values.config import CHOICES, ISOLATION_KEYS, PLAN_KEYS, Config
from ascendbind.settings import OTHER_VARIABLES
from ascendbind.daemon.runtime.serve import RESTART_KEYS
from ascendbind.daemon.api.server import ROUTES, http_status_of
from ascendbind.discovery.gather.snapshot import record_snapshot
from ascendbind.planner import ALIGNMENT_FAILURE_REASONS, ERROR_CODES, WARNING_CODES
from tests.golden import HOSTS, run_plan
from tests.workers import start_worker

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
FIXTURE_NPU_SMI = ROOT / "fixtures" / "bin" / "npu-smi"


# ---------------------------------------------------------------- markdown tables


def _cells(line: str) -> list[str]:
    """The cells of a table row; ``\\|`` is a literal bar inside a cell."""
    inner = line.strip()[1:-1] if line.strip().endswith("|") else line.strip()[1:]
    return [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", inner)]


def section(doc: str, heading: str) -> str:
    """The text under the heading line ``heading`` (exactly), up to the next heading of that level or higher."""
    text = (DOCS / doc).read_text(encoding="utf-8")
    lines = text.splitlines()
    level = len(heading) - len(heading.lstrip("#"))
    try:
        start = lines.index(heading)
    except ValueError:
        raise AssertionError(f"docs/{doc} has no heading {heading!r}") from None
    out = []
    for line in lines[start + 1:]:
        m = re.match(r"^(#+) ", line)
        if m and len(m.group(1)) <= level:
            break
        out.append(line)
    return "\n".join(out)


def table(doc: str, heading: str) -> list[list[str]]:
    """Body rows of the first table under ``heading``."""
    rows, seen = [], False
    for line in section(doc, heading).splitlines():
        if line.startswith("|"):
            seen = True
            rows.append(_cells(line))
        elif seen:
            break
    assert len(rows) >= 3, f"docs/{doc} {heading!r}: no table"
    assert set(rows[1][0]) <= set("-: "), f"docs/{doc} {heading!r}: no header separator"
    return rows[2:]


def ticked(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def first_ticked(rows: list[list[str]]) -> list[str]:
    out = []
    for row in rows:
        names = ticked(row[0])
        assert names, f"row without a backticked name: {row}"
        out.append(names[0])
    return out


def keys_of(doc: str, heading: str) -> set[str]:
    names = first_ticked(table(doc, heading))
    assert len(names) == len(set(names)), f"docs/{doc} {heading!r}: a key is listed twice"
    return set(names)


# ---------------------------------------------------------------- cli.md


def _verbs() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def _arguments(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    out = {}
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        if action.option_strings:
            name = max(action.option_strings, key=len)
        else:
            name = action.metavar or action.dest
        out[name] = action
    return out


def _documented_flags(heading: str) -> dict[str, list[str]]:
    rows = table("cli.md", heading)
    if "[plan-shaping flags](#plan-shaping-flags)" in section("cli.md", heading):
        rows = rows + table("cli.md", "## Plan-shaping flags")
    if "[isolation flags](#isolation-flags)" in section("cli.md", heading):
        rows = rows + table("cli.md", "## Isolation flags")
    flags = {}
    for row in rows:
        name = ticked(row[0])[0]
        assert name not in flags, f"cli.md {heading}: {name} listed twice"
        flags[name] = row
    return flags


def _check_flags(heading: str, parser: argparse.ArgumentParser) -> None:
    documented = _documented_flags(heading)
    actual = _arguments(parser)
    assert set(documented) == set(actual), f"cli.md {heading}: documented {sorted(documented)}, parser {sorted(actual)}"
    for name, action in actual.items():
        row = documented[name]
        assert len(row) == 4, f"cli.md {heading} {name}: expected flag | value | default | meaning"
        if action.choices is not None:
            assert set(ticked(row[1])) == {str(c) for c in action.choices}, f"cli.md {heading} {name}: choices"
        if action.nargs == 0:
            assert row[1] == "", f"cli.md {heading} {name} takes no value"
        assert (row[2] == "required") == bool(action.required), f"cli.md {heading} {name}: required is {action.required}"


def test_cli_md_documents_every_verb_and_no_other():
    text = (DOCS / "cli.md").read_text(encoding="utf-8")
    documented = set(re.findall(r"^## `ascendbind (\w+)`$", text, re.M))
    assert documented == set(_verbs())


@pytest.mark.parametrize("verb", sorted(_verbs()))
def test_cli_md_flags_match_the_parser(verb):
    _check_flags(f"## `ascendbind {verb}`", _verbs()[verb])


def test_cli_md_top_level_flags_match_the_parser():
    top = build_parser()
    _check_flags("## `ascendbind` (no verb)", top)


def test_cli_md_plan_shaping_flags_are_the_plan_keys():
    assert set(_documented_flags("## Plan-shaping flags")) == {"--" + k.replace("_", "-") for k in PLAN_KEYS}


def test_cli_md_isolation_flags_are_the_isolation_keys():
    assert set(_documented_flags("## Isolation flags")) == {"--" + k.replace("_", "-") for k in ISOLATION_KEYS}


def test_cli_md_lists_every_exit_status():
    documented = {int(row[0]) for row in table("cli.md", "## Exit status")}
    kinds = {getattr(errors, name) for name in errors.__all__}
    # 0: success; 2: argparse's usage error; 130: Ctrl-C; 126/127: run's exec failures
    assert {k.exit_status for k in kinds} | {0, 2, 126, 127, 130} == documented


# ---------------------------------------------------------------- config.md

_TYPES = {"string": str, "bool": bool, "int": int, "float": float, "array": tuple}


def test_config_md_documents_every_key_with_its_type_default_choices_flag_and_reload():
    rows = {ticked(r[0])[0]: r for r in table("config.md", "## Keys")}
    fields = {f.name: f for f in dataclasses.fields(Config) if f.name != "explicit"}
    assert set(rows) == set(fields)
    for key, f in fields.items():
        _name, kind, default, choices, flag, sighup, meaning = rows[key]
        assert _TYPES[kind] is type(f.default), f"{key}: type {kind}"
        literal = ticked(default)[0]
        loaded = tomllib.loads(f"v = {literal}")["v"]
        assert (tuple(loaded) if isinstance(loaded, list) else loaded) == f.default, f"{key}: default {literal}"
        if key in CHOICES:
            assert ticked(choices) == list(CHOICES[key]), f"{key}: choices"
        expected_flag = "--" + key.replace("_", "-") if key in PLAN_KEYS + ISOLATION_KEYS else None
        assert (ticked(flag)[0] if ticked(flag) else None) == expected_flag, f"{key}: flag"
        assert sighup == ("restart" if key in RESTART_KEYS else "reload"), f"{key}: SIGHUP"
        assert meaning, f"{key}: no meaning"


def test_config_md_lists_the_other_ascendbind_variables():
    assert keys_of("config.md", "## Other `ASCENDBIND_` variables") == set(OTHER_VARIABLES)


# ---------------------------------------------------------------- errors.md, alignment.md


def test_errors_md_lists_the_plan_error_codes():
    assert keys_of("errors.md", "## Errors (the NPU is not planned)") == set(ERROR_CODES)


def test_errors_md_lists_the_plan_warning_codes():
    assert keys_of("errors.md", "## Warnings (the NPU is planned)") == set(WARNING_CODES)


def test_errors_md_lists_every_code_the_planner_raises_before_planning():
    raised = set()
    for path in (ROOT / "ascendbind" / "planner").rglob("*.py"):
        raised |= set(re.findall(r'code="(\w+)"', path.read_text(encoding="utf-8")))
    assert raised, "the scan found no raised codes"
    assert keys_of("errors.md", "## Before planning") == raised


def test_alignment_md_lists_the_failure_reasons():
    assert keys_of("alignment.md", "## Failure reasons and metrics") == set(ALIGNMENT_FAILURE_REASONS)


# ---------------------------------------------------------------- plan-json.md


def _plans() -> list[dict]:
    cases = [("a2-8x910b3", ["--npu", "3"]), ("950-4numa", ["--npu", "0", "--npu", "5"]),
             ("a3-16die", ["--pid", "1003", "--npu", "9", "--topology-policy", "single-numa-node"]),
             ("310p-4card", ["--npu", "0", "--npu", "5"]), ("a3-k8s", ["--pid", "2105", "--npu", "5"]),
             ("a2-8x910b3", ["--npu", "3", "--thread-classes", "ucm:ucm_*:second-half;hccl:hccl*:acl"])]
    plans = []
    for host, argv in cases:
        code, plan, err = run_plan(host, argv)
        assert plan is not None, err
        plans.append(plan)
    return plans


PLANS = _plans()


# keys only some plans carry: pool_source is present when the pool is the worker's own cpuset,
# thread_classes (and each NPU's classes) when thread classes are configured
OPTIONAL_PLAN_KEYS = {"pool_source", "thread_classes"}
OPTIONAL_NPU_KEYS = {"classes"}


def test_plan_json_md_top_level_keys_are_a_real_plans():
    documented = keys_of("plan-json.md", "## Top-level keys")
    for plan in PLANS:
        assert documented - OPTIONAL_PLAN_KEYS == set(plan) - OPTIONAL_PLAN_KEYS
    assert set().union(*PLANS) == documented
    assert keys_of("plan-json.md", "## `pool_source`") == set(PLANS[-2]["pool_source"])


def test_plan_json_md_targets_keys_and_rules_are_a_real_plans():
    from ascendbind.values.targeting import RULES, SOURCES

    for plan in PLANS:
        assert keys_of("plan-json.md", "## `targets`") == set(plan["targets"])
        assert [e["source"] for e in plan["targets"]["evidence"]] == list(SOURCES)
        assert {k for e in plan["targets"]["evidence"] for k in e} == {"source", "npus", "detail"}
    rule_row = next(r for r in table("plan-json.md", "## `targets`") if ticked(r[0]) == ["rule"])
    assert set(RULES) <= set(ticked(rule_row[2])) and set(SOURCES) <= set(ticked(
        next(r for r in table("plan-json.md", "## `targets`") if ticked(r[0]) == ["evidence"])[2]))


def test_plan_json_md_npu_uvb_and_issue_keys_are_a_real_plans():
    npus = [e for p in PLANS for e in p["npus"].values()]
    issues = [e for p in PLANS for e in p["errors"] + p["warnings"]]
    assert npus and issues and any(p["uvb"]["tids"] for p in PLANS)
    for entry in npus:
        assert keys_of("plan-json.md", "## `npus` entries") - OPTIONAL_NPU_KEYS == set(entry) - OPTIONAL_NPU_KEYS
    assert keys_of("plan-json.md", "## `npus` entries") == set().union(*npus)
    for entry in issues:
        assert keys_of("plan-json.md", "## `errors` and `warnings` entries") == set(entry)
    for plan in PLANS:
        assert keys_of("plan-json.md", "## `uvb`") == set(plan["uvb"])


def test_plan_json_md_alignment_keys_are_a_real_plans():
    hints = [h for p in PLANS for hs in p["alignment"]["providers"].values() for h in hs]
    assert hints
    for plan in PLANS:
        al = plan["alignment"]
        assert keys_of("plan-json.md", "## The `alignment` block") == set(al)
        assert set(al["providers"]) == {"device", "cpu", "memory"}
        for entry in al["npus"].values():
            assert keys_of("plan-json.md", "### `alignment.npus` entries") == set(entry)
    for hint in hints:
        assert keys_of("plan-json.md", "### `alignment.providers` hints") == set(hint)


def test_plan_json_md_step_keys_are_those_of_a_real_apply():
    """`apply` binds a real worker (npu-smi faked: this host's CPUs as one NPU)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ASCENDBIND_")}
    env.update(PATH=f"{FIXTURE_NPU_SMI.parent}:{env.get('PATH', '/usr/bin:/bin')}", ASCENDBIND_CONFIG="",
               ASCENDBIND_SMALL_POOL="share")
    with start_worker(plain=1, acl=1, release=1) as w:
        r = subprocess.run([sys.executable, "-m", "ascendbind", "apply", "--pid", str(w.pid), "--npu", "0",
                            "--format", "json"], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert r.returncode in (0, 8), r.stderr
    out = json.loads(r.stdout)
    assert keys_of("plan-json.md", "## Steps") == set(out)
    assert [s["step"] for s in out["steps"]] == ["affinity", "irq", "memory", "uvb"]
    documented = keys_of("plan-json.md", "### Step results")
    with_data = [s for s in out["steps"] if "data" in s]
    assert with_data, "no step carried data"
    for step in out["steps"]:
        assert set(step) <= documented and documented - set(step) <= {"data"}


# ---------------------------------------------------------------- snapshot.md


def _path_patterns() -> list[re.Pattern[str]]:
    out = []
    for name in first_ticked(table("snapshot.md", "## Layout")):
        rx = re.escape(name)
        rx = rx.replace(re.escape("<cgroup path>/"), "(?:.+/)?")
        rx = re.sub(r"<[^>]+>", "[^/]+", rx.replace("\\<", "<").replace("\\>", ">"))
        out.append(re.compile(rx))
    return out


def _undocumented(files: list[str]) -> list[str]:
    patterns = _path_patterns()
    return [f for f in files if not any(p.fullmatch(f) for p in patterns)]


def test_snapshot_md_names_every_file_of_a_snapshot_of_this_host(tmp_path):
    cfg = Config(npu_smi=str(FIXTURE_NPU_SMI))
    with start_worker(plain=1, acl=1, release=0) as w:
        written = record_snapshot(str(tmp_path / "snap"), w.pid, cfg)
    files = sorted(str(p.relative_to(tmp_path / "snap")) for p in (tmp_path / "snap").rglob("*") if p.is_file())
    assert set(written) <= set(files) and any(f.startswith("cmd/npu-smi_info") for f in files)
    assert any(f"proc/{w.pid}/task/" in f for f in files)
    assert _undocumented(files) == []
    meta = json.loads((tmp_path / "snap" / "meta.json").read_text())
    assert set(meta) == keys_of("snapshot.md", "## meta.json")


def test_snapshot_md_names_every_file_of_the_fixture_hosts():
    files = [str(p.relative_to(host)) for host in Path(HOSTS).iterdir() if host.is_dir()
             for p in host.rglob("*") if p.is_file() and "expected" not in p.relative_to(host).parts]
    assert len(files) > 100
    assert _undocumented(files) == []


def test_snapshot_md_pattern_check_can_fail():
    assert _undocumented(["cmd/npu-smi_info_-t_board_-i_3_-c_1.txt", "proc/self/task/7/comm",
                          "sys/fs/cgroup/cpuset/cpuset.effective_cpus"]) == []
    assert _undocumented(["cmd/nvidia-smi.txt", "proc/1/maps"]) == ["cmd/nvidia-smi.txt", "proc/1/maps"]


# ---------------------------------------------------------------- api.md


def _api_errors() -> dict[str, set[int]]:
    out: dict[str, set[int]] = {}
    for row in table("api.md", "## Errors"):
        out.setdefault(ticked(row[0])[0], set()).add(int(row[1]))
    return out


def test_api_md_lists_every_endpoint_with_its_method():
    rows = {(ticked(r[0])[0], ticked(r[1])[0]) for r in table("api.md", "## Endpoints")}
    assert rows == set(ROUTES.items())
    text = (DOCS / "api.md").read_text(encoding="utf-8")
    for path, method in ROUTES.items():
        assert f"### {method} {path}\n" in text, f"api.md has no section for {method} {path}"


def test_api_md_worker_keys_are_those_the_daemon_lists():
    from ascendbind.daemon.watch.held import Held
    from ascendbind.values.model import Binding, Plan

    plan = Plan.from_json(PLANS[0])
    held = Held(Binding(pid=4242, start_time=1, npus=tuple(p.npu for p in plan.npus), plan=plan,
                        original_cpus=frozenset(plan.allowed_cpus), saved_irq_masks={}, steps=()), bound_at=0.0)
    assert keys_of("api.md", "### GET /v1/workers") == set(held.to_json())


def test_api_md_gives_each_daemon_error_kind_its_status():
    documented = _api_errors()
    client_side = {errors.DaemonUnreachable, errors.StepFailed}  # raised by the CLI, never answered
    for name in errors.__all__:
        kind = getattr(errors, name)
        if kind in client_side or kind is errors.AscendbindError:
            continue
        status = http_status_of(kind.__new__(kind))  # only its kind matters
        assert status in documented.get(kind.code, set()), f"api.md: {kind.code} should be {status}"


def test_api_md_lists_every_code_the_wire_answers_with_its_status():
    source = "\n".join(p.read_text(encoding="utf-8") for p in (ROOT / "ascendbind" / "daemon").rglob("*.py"))
    pairs = set(re.findall(r'WireError\(\s*(\d{3}),\s*"(\w+)"', source))
    pairs |= set(re.findall(r'json_response\(\s*(\d{3}),\s*\{\s*"error":\s*"(\w+)"', source))
    pairs |= {("400", c) for c in re.findall(r'_bad\([^()]*?,\s*"(\w+)"\)', source)} | {("400", "bad_http")}
    assert len(pairs) >= 8, pairs
    documented = _api_errors()
    missing = sorted(f"{code} {status}" for status, code in pairs if int(status) not in documented.get(code, set()))
    assert not missing, f"api.md does not list: {missing}"


# codes raised with code="..." that never reach an API answer, and why
_NOT_ANSWERED = {
    "state_dir_untrusted": "serve refuses to start (exit 2) before the socket opens",
    "bad_policy": "the API checks the policy first and answers bad_request",
    "too_large": "a numa_maps over its read limit: a locality check result, never an answer",
    # the codes of errors.py's classes that only the client and the CLI raise
    "daemon_unreachable": "the client's own error when no daemon answers on the socket",
    "step_failed": "the CLI's exit 8 after an answer that names a failed step",
    # why the reconcile loop has no process events: a reason on ascendbind_reconcile_mode, never an answer
    "permission": "the kernel refused the process-events subscription",
    "namespace": "the process-events connector lives in the initial network namespace only",
    "no_ack": "the kernel ignored the process-events subscription (another pid or user namespace)",
    "error": "the process-events socket failed otherwise",
}


def test_api_md_lists_every_named_code_the_daemon_can_answer():
    codes = set()
    for path in (ROOT / "ascendbind").rglob("*.py"):
        codes |= set(re.findall(r'code="(\w+)"', path.read_text(encoding="utf-8")))
    documented = set(_api_errors())
    missing = sorted(codes - documented - set(ERROR_CODES) - set(_NOT_ANSWERED))
    assert not missing, f"api.md does not list: {missing}"
    assert "<plan error code>" in documented  # the plan codes come with 422


def test_plan_json_md_irqs_entries_are_a_real_plans():
    entries = [e for p in PLANS for e in p["irqs"].values()]
    assert any(e["cpus"] for e in entries) and any(e["skipped"] for e in entries)
    for entry in entries:
        assert keys_of("plan-json.md", "## `irqs` entries") == set(entry)

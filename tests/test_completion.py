"""`ascendbind completion bash`: the generated script, run by a real bash, offers
exactly the parser's verbs, each verb's flags and each flag's choices."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ascendbind.cli import build_parser
from ascendbind.completion import verbs_and_flags

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="bash missing")

BIN = Path(sys.executable).parent / "ascendbind"


@pytest.fixture(scope="module")
def script() -> str:
    r = subprocess.run([str(BIN), "completion", "bash"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    return r.stdout


def complete(script: str, cases: list[list[str]]) -> list[set[str]]:
    """What bash offers for each command line (the last word is the one being completed)."""
    body = [script, "t() { COMP_WORDS=(\"$@\"); COMP_CWORD=$(($# - 1)); COMPREPLY=(); _ascendbind; "
                    "printf '%s\\n' \"${COMPREPLY[@]}\"; echo '@@'; }"]
    for words in cases:
        body.append("t " + " ".join("'" + w.replace("'", "'\\''") + "'" for w in words))
    r = subprocess.run(["bash", "--norc", "--noprofile", "-c", "\n".join(body)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    chunks = r.stdout.split("@@\n")[:-1]
    assert len(chunks) == len(cases), r.stdout
    return [{w for w in chunk.splitlines() if w} for chunk in chunks]


def test_the_script_is_valid_bash_and_registers_itself(script):
    r = subprocess.run(["bash", "--norc", "--noprofile", "-c", script + "\ncomplete -p ascendbind"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "-F _ascendbind" in r.stdout, r.stdout + r.stderr


def test_verbs_and_flags_come_from_the_parser(script):
    parser = build_parser()
    table = verbs_and_flags(parser)
    verbs = sorted(v for v in table if v)
    assert {"plan", "apply", "snapshot", "serve", "bind", "release", "status", "run", "completion"} <= set(verbs)
    cases = [["ascendbind", ""]] + [["ascendbind", verb, "-"] for verb in verbs]
    offered = complete(script, cases)
    assert offered[0] == set(verbs) | set(table[""])
    for verb, got in zip(verbs, offered[1:]):
        sub = parser._subparsers._group_actions[0].choices[verb]
        flags = {s for a in sub._actions for s in a.option_strings if s.startswith("-")}
        assert got == flags, verb


def test_each_flag_offers_its_choices(script):
    parser = build_parser()
    cases, expected = [], []
    for verb, sub in parser._subparsers._group_actions[0].choices.items():
        for action in sub._actions:
            if action.choices and action.option_strings:
                cases.append(["ascendbind", verb, action.option_strings[-1], ""])
                expected.append({str(c) for c in action.choices})
    assert len(cases) >= 10  # --format, --topology-policy, --device-type, ... on several verbs
    assert complete(script, cases) == expected


def test_values_files_and_commands(script, tmp_path):
    (tmp_path / "host-a").mkdir()
    (tmp_path / "config.toml").write_text("")
    got = complete(script, [
        ["ascendbind", "pl"],
        ["ascendbind", "plan", "--irq-binding", ""],
        ["ascendbind", "plan", "--pid", ""],                   # free text: nothing, and no flags
        ["ascendbind", "serve", "--config", str(tmp_path / "con")],
        ["ascendbind", "snapshot", str(tmp_path / "ho")],
        ["ascendbind", "completion", ""],
        ["ascendbind", "run", "--npu", "0", "--", "bas"],
    ])
    assert got[0] == {"plan"}
    assert got[1] == {"true", "false"}
    assert got[2] == set()
    assert got[3] == {str(tmp_path / "config.toml")}
    assert got[4] == {str(tmp_path / "host-a")}
    assert got[5] == {"bash"}
    assert "bash" in got[6]

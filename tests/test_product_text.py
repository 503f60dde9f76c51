"""The product's text stands alone, and its documents link only to files it ships.

Operators read the docs, the README, ``--help``, the ``/metrics`` HELP lines and
every comment and docstring without the project's tracker, its design notes or
its history. So none of that text may point outside the repository: no issue
numbers, no section marks or paragraphs of a design note (``SPEC``), no files of
the reference designs the rules were first taken from, no ``../shared`` paths,
no "pre-issue" / "this build" history. The rule is stated instead.

In Python files only comments and string literals are prose (a variable may be
called ``seed`` in a test that shuffles with a random seed); every other text
file is prose throughout. "seed pool" is a product term (the pool the placement
rules give before NUMA alignment, docs/alignment.md), not a citation.

Relative links in README.md and docs/*.md must name files in the repository,
so a link never leads a reader out of the checkout to nothing.
"""

from __future__ import annotations

import io
import re
import subprocess
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SELF = Path(__file__).resolve()

# what ships as the product's text: code, tests, docs, deployment files
SCANNED_DIRS = ("ascendbind", "tests", "docs", "bench", "deploy", "systemd", ".ci")
SCANNED_FILES = ("README.md", "Makefile", "config.example.toml", "pyproject.toml", "MANIFEST.in",
                 "fixtures/hosts/README.md", "fixtures/bin/npu-smi", "fixtures/hostgen.py", "fixtures/make_hosts.py")
BINARY_SUFFIXES = (".png", ".jpg", ".gif", ".pyc")

# (what it cites, pattern). Precise on purpose: each names a way of pointing outside
# the repository, not a common word ("issue" as a verb, "seed pool", rdseed).
CITATIONS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("a design-note section", re.compile(r"\bSPEC\b|§")),
    ("a tracker issue", re.compile(r"(?i)\bissues?[ -]?#?\d+|\b(?:the|this|that) issue(?:'s)?\b|\bpre-issue\b")),
    ("the development history", re.compile(r"(?i)\bthis build\b")),
    ("a file outside the repository", re.compile(r"\.\./shared\b|\bshared/seeds\b|\bARCHITECTURE\.md\b")),
    ("a reference-design file", re.compile(r"\b00\d_(?:[0-9a-f]{6,}|\*)")),
    ("a reference design", re.compile(r"(?<!random )(?<!--)\b[Ss]eeds?\b(?!\s+pools?\b)")),
)


def scanned_files() -> list[Path]:
    """Tracked files under the product's directories (git), or every file there outside git."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--", *SCANNED_DIRS, *SCANNED_FILES], cwd=ROOT,
                             capture_output=True, check=True).stdout.decode()
        names = [n for n in out.split("\0") if n]
    except (OSError, subprocess.CalledProcessError):
        names = [str(p.relative_to(ROOT)) for d in SCANNED_DIRS for p in (ROOT / d).rglob("*") if p.is_file()]
        names += [n for n in SCANNED_FILES if (ROOT / n).is_file()]
    files = [ROOT / n for n in names]
    return sorted(p for p in files if p.is_file() and p.resolve() != SELF and not p.name.endswith(BINARY_SUFFIXES))


_F_FIELD = re.compile(r"\{[^{}]*\}")
_NAME_LITERAL = re.compile(r"""[rbuRBU]?(['"])[\w.-]+\1""")


def prose_lines(path_name: str, text: str) -> list[tuple[int, str]]:
    """(line number, text) of the prose in a file: comments and strings of Python, else every line."""
    if not path_name.endswith(".py"):
        return list(enumerate(text.splitlines(), 1))
    out: list[tuple[int, str]] = []
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        prose = tok.string
        if tok.type == tokenize.STRING and _NAME_LITERAL.fullmatch(prose):
            continue  # "seed", "--seed": a key or a flag, not prose
        if tok.type == tokenize.STRING and "f" in prose[:prose.index(prose[-1])].lower():
            prose = _F_FIELD.sub("{}", prose.replace("{{", "").replace("}}", ""))  # f"{seed}" is code
        elif tok.type not in (tokenize.COMMENT, tokenize.STRING, getattr(tokenize, "FSTRING_MIDDLE", -1)):
            continue
        out.extend((tok.start[0] + i, line) for i, line in enumerate(prose.splitlines()))
    return out


def citations_in(path_name: str, text: str) -> list[str]:
    """``path:line: cites WHAT: text`` for every citing line."""
    found = []
    for lineno, line in prose_lines(path_name, text):
        for what, pattern in CITATIONS:
            m = pattern.search(line)
            if m:
                found.append(f"{path_name}:{lineno}: cites {what} ({m.group(0)!r}): {line.strip()[:120]}")
    return found


def test_no_file_of_the_product_cites_anything_outside_it():
    files = scanned_files()
    assert len(files) > 100, "the scan found too few files to mean anything"
    found = []
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        found.extend(citations_in(str(path.relative_to(ROOT)), text))
    assert not found, "state the rule instead of citing where it came from:\n" + "\n".join(found)


@pytest.mark.parametrize("name, text", [
    ("a.py", "# the role split (SPEC §2)\n"),
    ("a.py", 'x = 1  # see issue 5, item 7\n'),
    ("a.py", 'HELP = "Bind requests by outcome (SPEC \\u00a77)"\n'),
    ("a.py", '"""Alignment (issue-5)."""\n'),
    ("a.py", 'print("(no alignment explanation available in this build)")\n'),
    ("a.py", 'why = f"the seed\'s split: {cl(pool)}"\n'),
    ("a.md", "The seed's rules put NPU 3 on node 5.\n"),
    ("a.md", "after the kubelet Topology Manager (seed 000_*)\n"),
    ("a.md", "read ../shared/seeds/003_c5d4478faf06539c.txt\n"),
    ("a.md", "the pre-issue behaviour\n"),
    ("a.md", "This test reproduces the issue's example.\n"),
    ("a.md", "defaults reproduce the seed design\n"),
])
def test_the_scan_catches_each_kind_of_citation(name, text):
    assert citations_in(name, text), text


@pytest.mark.parametrize("name, text", [
    ("a.py", "seed = make_plan(host)\nrandom.Random(seed).shuffle(items)\n"),
    ("a.py", 'why = f"cpu: slice {cl(seed)} is on NUMA {nodes_of(seed)}"\n'),
    ("a.py", 'reason = "topology_policy none keeps the seed pool"\n'),
    ("a.md", "flags: fpu avx512f rdseed adx\n"),
    ("a.md", "the main thread issues steps to the worker\n"),
    ("a.md", "Run i shuffles the tests with random seed i.\n"),
    ("a.md", "python bench/fuzz_api.py [--requests 10000] [--seed 7]\n"),
    ("a.py", 'ap.add_argument("--seed", type=int)\nout = {"seed": seed}\n'),
    ("a.py", "from .codes import issue\nerrors.append(issue(npu, 'unknown_npu', why))\n"),
    ("a.md", "Plan issues (`errors`, `warnings`) share one shape.\n"),
])
def test_the_scan_leaves_ordinary_words_alone(name, text):
    assert citations_in(name, text) == []


# ---------------------------------------------------------------- links

_LINK = re.compile(r"(?<!!)\[[^\]\n]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REF_LINK = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", re.M)
_IMAGE = re.compile(r"!\[[^\]\n]*\]\(\s*<?([^)\s>]+)>?\s*\)")


def _without_code(text: str) -> str:
    """The text with fenced blocks and inline code blanked (lines kept, so numbers stay right)."""
    out, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
            out.append("")
            continue
        out.append("" if fenced else re.sub(r"`[^`]*`", "", line))
    return "\n".join(out)


def relative_links(text: str) -> list[tuple[int, str]]:
    """(line, target) of every link or image to a relative path (no scheme, not a bare #anchor)."""
    text = _without_code(text)
    found = []
    for pattern in (_LINK, _REF_LINK, _IMAGE):
        for m in pattern.finditer(text):
            target = m.group(1)
            if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith("#"):
                continue
            found.append((text.count("\n", 0, m.start()) + 1, target))
    return found


def broken_links(md: Path, root: Path = ROOT) -> list[str]:
    bad = []
    for lineno, target in relative_links(md.read_text(encoding="utf-8")):
        rel = target.split("#", 1)[0].split("?", 1)[0]
        dest = (md.parent / rel).resolve()
        where = f"{md.relative_to(root)}:{lineno}: {target}"
        if not dest.is_relative_to(root):
            bad.append(f"{where} leads outside the repository")
        elif not dest.exists():
            bad.append(f"{where} names no file in the repository")
        elif dest.is_relative_to(root / ".git"):
            bad.append(f"{where} leads into .git")
    return bad


def documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "fixtures" / "hosts" / "README.md"]


def test_readme_and_docs_link_only_files_in_the_repository():
    bad = [b for md in documents() for b in broken_links(md)]
    assert not bad, "\n".join(bad)


def test_readme_links_every_contract_document():
    readme = {t.split("#", 1)[0] for _, t in relative_links((ROOT / "README.md").read_text(encoding="utf-8"))}
    for doc in ("api.md", "plan-json.md", "config.md", "cli.md", "snapshot.md", "errors.md", "reasons.md"):
        assert f"docs/{doc}" in readme, f"README.md does not link docs/{doc}"


def test_the_link_check_finds_a_broken_and_an_escaping_link(tmp_path):
    text = ("[ok](README.md) [gone](docs/no-such-file.md) [out](../../etc/passwd)\n"
            "```\n[in code](nowhere.md)\n```\n[web](https://example.com) [anchor](#x)\n")
    assert [t for _, t in relative_links(text)] == ["README.md", "docs/no-such-file.md", "../../etc/passwd"]
    root = tmp_path / "repo"
    (root / "docs").mkdir(parents=True)
    (root / "README.md").write_text("x\n")
    probe = root / "docs" / "a.md"
    probe.write_text("[a](../README.md) [b](no-such-file.md) [c](../../outside.md)\n", encoding="utf-8")
    (tmp_path / "outside.md").write_text("x\n")
    bad = broken_links(probe, root)
    assert len(bad) == 2 and "no-such-file.md names no file" in bad[0] and "outside the repository" in bad[1]

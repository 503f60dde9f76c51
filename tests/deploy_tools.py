"""Helpers for the tests of deploy/: external tools, YAML, PromQL names, scrapes.

A missing external tool (promtool, kubernetes-validate) skips its test with the
reason on a developer's machine, but fails it in CI (``CI=true``), where
.ci/run installs it: a broken install must not pass as a skip.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "kubernetes"
RULES = DEPLOY / "prometheus" / "ascendbind.rules.yml"
RULES_TEST = DEPLOY / "prometheus" / "tests" / "ascendbind.rules.test.yml"
DASHBOARD = DEPLOY / "grafana" / "ascendbind-dashboard.json"


@contextlib.contextmanager
def running(thing, start: Callable[[], object], stop: Callable[[], object]) -> Iterator:
    """``thing`` once ``start()`` returns, and ``stop()`` however the block ends, also when
    ``start`` itself fails half way (a service booted half way still has processes to end)."""
    try:
        start()
        yield thing
    finally:
        stop()


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def missing(what: str) -> None:
    """Skip (developer machine) or fail (CI) because ``what`` is not installed."""
    if in_ci():
        pytest.fail(f"{what} is not installed; .ci/run installs it")
    pytest.skip(f"{what} is not installed")


def need_tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        missing(f"{name} (Debian package prometheus)" if name == "promtool" else name)
    return path  # type: ignore[return-value]


def yaml_docs(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as fh:
        return [d for d in yaml.safe_load_all(fh) if d]


# ---------------------------------------------------------------- PromQL

_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "bool",
             "offset", "inf", "nan"}
_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
_SELECTOR = re.compile(rf"({_NAME})\s*\{{([^}}]*)\}}")
_MATCHER = re.compile(rf'\s*({_NAME})\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"\s*,?')


def promql_metric_names(expr: str) -> set[str]:
    """Every metric name an expression selects (label names, functions, keywords,
    Grafana $variables, numbers and durations are not metric names)."""
    s = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)           # string literals
    s = re.sub(r"\blabel_values\((.*),\s*\w+\s*\)", r"(\1)", s)  # Grafana: label_values(expr, label)
    s = re.sub(r"\{[^}]*\}", " ", s)                         # label matchers
    s = re.sub(r"\[[^\]]*\]", " ", s)                        # range and subquery windows
    s = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", s)
    s = re.sub(r"\$\{?\w+\}?", " ", s)                       # Grafana variables
    names = set()
    for m in re.finditer(rf"(?<![\w.]){_NAME}", s):
        word = m.group(0)
        rest = s[m.end():].lstrip()
        if rest.startswith("(") or word.lower() in _KEYWORDS:
            continue
        names.add(word)
    return names


def promql_equality_matchers(expr: str) -> list[tuple[str, str, str]]:
    """(metric, label, value) for every ``label="value"`` matcher with a literal value."""
    out = []
    for sel in _SELECTOR.finditer(expr):
        for m in _MATCHER.finditer(sel.group(2)):
            if m.group(2) == "=" and "$" not in m.group(3):
                out.append((sel.group(1), m.group(1), m.group(3)))
    return out


# ---------------------------------------------------------------- scrapes

_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",),
             "info": ("_info",), "summary": ("", "_sum", "_count"), "unknown": ("",)}


def exported(text: str) -> tuple[set[str], list[tuple[str, dict[str, str]]]]:
    """(every series name a scrape can hold, every sample as (name, labels)),
    parsed with prometheus_client's own parser."""
    from prometheus_client.parser import text_string_to_metric_families

    names: set[str] = set()
    samples: list[tuple[str, dict[str, str]]] = []
    for fam in text_string_to_metric_families(text):
        names.update(fam.name + sfx for sfx in _SUFFIXES.get(fam.type, ("",)))
        for s in fam.samples:
            names.add(s.name)
            samples.append((s.name, dict(s.labels)))
    return names, samples

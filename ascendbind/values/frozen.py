"""Read-only containers, so frozen dataclasses stay frozen all the way down, and their
plain JSON form. Pure."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

__all__ = ["frozen_map", "plain"]


def frozen_map(d: Mapping | None = None) -> Mapping:
    """A read-only mapping, so frozen dataclasses stay frozen all the way down."""
    return MappingProxyType(dict(d or {}))


def plain(v: Any) -> Any:
    if isinstance(v, Mapping):
        return {str(k): plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [plain(x) for x in v]
    if isinstance(v, (set, frozenset)):
        return sorted(v)
    return v

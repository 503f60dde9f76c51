"""structlog set-up for ``serve``: configured once, in the serve entry.

* under systemd (``JOURNAL_STREAM`` set, stderr connected to journald): one JSON
  object per line, prefixed with ``<N>``, the syslog priority journald reads
  (sd-daemon(3)), so ``journalctl -p warning`` filters correctly;
* on a TTY: structlog's console renderer;
* anything else (files, pipes, tests): plain JSON lines.

Request handlers bind ``request_id``, ``peer_pid`` and ``peer_uid`` with
structlog's contextvars, so every line of one request carries them.
"""

from __future__ import annotations

import logging
import os
import sys

import structlog

__all__ = ["configure_logging", "PRIORITIES"]

# syslog priorities (RFC 5424) for structlog level names
PRIORITIES = {"debug": 7, "info": 6, "warning": 4, "warn": 4, "error": 3, "exception": 3, "critical": 2}


def _journald_prefix(_logger, method_name: str, event_dict):
    event_dict["_priority"] = PRIORITIES.get(method_name, 6)
    return event_dict


class _PriorityJSON:
    """Render JSON and put journald's ``<N>`` priority prefix in front of it."""

    def __init__(self) -> None:
        self._json = structlog.processors.JSONRenderer(sort_keys=False)

    def __call__(self, logger, method_name: str, event_dict) -> str:
        prio = event_dict.pop("_priority", 6)
        return f"<{prio}>" + self._json(logger, method_name, event_dict)


def _under_journald(stream) -> bool:
    """True when stderr is the journald stream systemd gave us (JOURNAL_STREAM=dev:ino)."""
    value = os.environ.get("JOURNAL_STREAM", "")
    if not value:
        return False
    try:
        dev, ino = (int(x) for x in value.split(":"))
        st = os.fstat(stream.fileno())
    except (ValueError, OSError, AttributeError):
        return bool(value)
    return (st.st_dev, st.st_ino) == (dev, ino)


def configure_logging(*, level: str = "info", stream=None) -> str:
    """Configure structlog for the daemon; returns which renderer was chosen."""
    stream = stream or sys.stderr
    processors: list = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.format_exc_info,
    ]
    if _under_journald(stream):
        kind = "journald"
        processors += [_journald_prefix, _PriorityJSON()]
    elif hasattr(stream, "isatty") and stream.isatty():
        kind = "console"
        processors.append(structlog.dev.ConsoleRenderer(colors=False))
    else:
        kind = "json"
        processors.append(structlog.processors.JSONRenderer())
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper(), logging.INFO)),
        logger_factory=structlog.PrintLoggerFactory(file=stream),
        cache_logger_on_first_use=True,
    )
    return kind

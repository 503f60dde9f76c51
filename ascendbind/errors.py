"""Every exception ascendbind raises on purpose, and the exit status each maps to.

    AscendbindError                 base; ``code`` (a reason code) and ``exit_status``
      UsageError          exit 2    bad flags / arguments
      ConfigError         exit 2    bad config file, env value or unknown key (named)
      PlanImpossible      exit 3    no plan for a target NPU, or refused by policy
      DaemonUnreachable   exit 4    the socket is absent or nobody answers
      DiscoveryError      exit 5    a host input is unavailable or unusable
        ToolMissing                 the command does not exist on this host
        CommandFailed               non-zero exit or timeout (named, with stderr)
        ParseError                  malformed text: names the source and the line
        DiscoveryUnavailable        the daemon's answer while a query keeps failing
                                    (cached, retried with backoff in the background)
      ProcessGone         exit 6    no such pid, or the pid was recycled
      NotPermitted        exit 7    the caller may not touch that process
      StepFailed          exit 8    bound, but at least one step failed
      Conflict            exit 9    another live worker holds the NPU, or a policy mismatch

The CLI prints ``str(err)`` on one line and exits with ``err.exit_status``;
no traceback ever reaches an operator for these.
"""

from __future__ import annotations

__all__ = [
    "AscendbindError",
    "UsageError",
    "ConfigError",
    "PlanImpossible",
    "DaemonUnreachable",
    "DiscoveryError",
    "ToolMissing",
    "CommandFailed",
    "ParseError",
    "DiscoveryUnavailable",
    "ProcessGone",
    "NotPermitted",
    "StepFailed",
    "Conflict",
]


class AscendbindError(Exception):
    """Base: ``code`` (a reason code) and ``exit_status``. A subclass states both in its
    header, ``class X(AscendbindError, exit_status=.., code=..)``; one it leaves out is inherited."""

    exit_status = 1
    code = "error"

    def __init_subclass__(cls, *, exit_status: int | None = None, code: str | None = None, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if exit_status is not None:
            cls.exit_status = exit_status
        if code is not None:
            cls.code = code

    def __init__(self, message: str, *, code: str | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code


class UsageError(AscendbindError, exit_status=2, code="usage"):
    """Bad flags or arguments."""


class ConfigError(AscendbindError, exit_status=2, code="bad_config"):
    """A bad config file, environment value or unknown key (named)."""


class PlanImpossible(AscendbindError, exit_status=3, code="plan_impossible"):
    """No usable plan. ``plan`` (a model.Plan or None) carries the per-NPU errors."""

    def __init__(self, message: str, *, code: str | None = None, plan=None) -> None:
        super().__init__(message, code=code)
        self.plan = plan


class DaemonUnreachable(AscendbindError, exit_status=4, code="daemon_unreachable"):
    """The socket is absent or nobody answers."""


class DiscoveryError(AscendbindError, exit_status=5, code="discovery_failed"):
    """A host input is unavailable or unusable."""


class ToolMissing(DiscoveryError, code="tool_missing"):
    """The command does not exist on this host."""


class CommandFailed(DiscoveryError, code="command_failed"):
    """A non-zero exit or a timeout (named, with its stderr)."""


class ParseError(DiscoveryError, code="parse_error"):
    """Malformed input. The message always names the source and, when known, the line."""

    def __init__(self, source: str, message: str, *, line: int | None = None, text: str | None = None) -> None:
        where = source if line is None else f"{source} line {line}"
        detail = f"{where}: {message}"
        if text is not None:
            detail += f": {text.strip()[:120]!r}"
        super().__init__(detail)
        self.source = source
        self.line = line


class DiscoveryUnavailable(DiscoveryError, code="discovery_unavailable"):
    """A recent failure of the same query, answered from the cache without running
    anything; the message names the query and the failure's own code and text."""


class ProcessGone(AscendbindError, exit_status=6, code="pid_gone"):
    """No such pid, or the pid was recycled."""


class NotPermitted(AscendbindError, exit_status=7, code="not_permitted"):
    """The caller may not touch that process."""


class StepFailed(AscendbindError, exit_status=8, code="step_failed"):
    """Bound, but at least one step failed."""


class Conflict(AscendbindError, exit_status=9, code="conflict"):
    """Another live worker holds the NPU, or a policy mismatch."""

"""The suite's soak mode: the same tests, at the counts a long run wants.

A few tests exercise a defence by repetition: seeded requests thrown at the API, pids
recycled under a bind, binds timed while another uid hogs the socket. The normal run
repeats each enough to fail on a regression within seconds; a soak run repeats it at the
count a release is checked with (thousands of recycles, ten thousand requests), so that
a one-in-a-thousand race shows itself. The tests are the same, the assertions are the
same: only the count grows.

    make soak                   # = pytest -m soak --soak
    SOAK=1 pytest -q tests/test_pid_recycle.py

Such tests carry the ``soak`` marker (registered in pyproject.toml), so ``-m soak`` picks
them out; ``--soak`` (tests/conftest.py) or ``SOAK=1`` raises their counts.
"""

from __future__ import annotations

import os

# not an ASCENDBIND_* name: every such variable must name a config key, and the daemons and
# commands the tests start inherit the environment
ENV = "SOAK"


def soaking() -> bool:
    """Whether this run is a soak run (``--soak`` or ``SOAK`` set, not ``0``)."""
    return os.environ.get(ENV, "") not in ("", "0")


def count(normal: int, soak: int) -> int:
    """``normal`` in the ordinary run, ``soak`` in a soak run."""
    return soak if soaking() else normal

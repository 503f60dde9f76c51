"""Every step reason code is documented in docs/reasons.md, and nothing else is."""

import re
from pathlib import Path

from ascendbind.values.reasons import Reason

DOC = Path(__file__).resolve().parent.parent / "docs" / "reasons.md"


def test_reason_codes_match_the_documented_set():
    documented = set(re.findall(r"^\| `([a-z_]+)` \|", DOC.read_text(), re.M))
    assert documented == {r.value for r in Reason}

"""Every fixture host's plans match their golden files (see tests/golden.py)."""

import json
import os

import pytest

from tests.golden import CASES, HOSTS, all_cases, golden_path, run_plan



pytestmark = pytest.mark.usefixtures("defaults_only")  # goldens are planned with the defaults


CASE_LIST = [(h, c, a) for h, c, a in all_cases() if os.path.exists(golden_path(h, c))]


@pytest.mark.parametrize("host,case,argv", CASE_LIST, ids=[f"{h}/{c}" for h, c, _ in CASE_LIST])
def test_plan_matches_golden(host, case, argv):
    with open(golden_path(host, case)) as fh:
        golden = json.load(fh)
    assert golden["argv"] == argv
    code, plan, err = run_plan(host, argv)
    assert code == golden["exit"], err
    assert plan == golden["plan"]


def test_every_fixture_host_has_goldens():
    hosts = sorted(d for d in os.listdir(HOSTS) if os.path.isdir(os.path.join(HOSTS, d)))
    assert hosts, "no fixture hosts"
    for host in hosts:
        assert host in CASES, f"fixture host {host} has no golden cases"
        for case in CASES[host]:
            assert os.path.exists(golden_path(host, case)), f"missing golden {host}/{case}"

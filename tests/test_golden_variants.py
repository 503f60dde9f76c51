"""An unknown multi-word column, or reordered columns, in any table of any fixture host
changes nothing in any golden plan: every golden case is planned again from an edited
copy of its host (tests/table_variants.py) and must give the same exit status and JSON."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from tests import table_variants
from tests.golden import HOSTS, all_cases, golden_path, run_plan

CASES = [(h, c, a) for h, c, a in all_cases() if os.path.exists(golden_path(h, c))]


pytestmark = pytest.mark.usefixtures("defaults_only")  # goldens are planned with the defaults


@pytest.fixture(scope="module")
def edited_hosts(tmp_path_factory):
    """(host, variant) -> a copy of the host whose four tables are all edited."""
    made: dict[tuple[str, str], str] = {}

    def get(host: str, variant: str) -> str:
        if (host, variant) not in made:
            dst = str(tmp_path_factory.mktemp(f"{host}-{variant.replace('+', '-')}"))
            shutil.copytree(os.path.join(HOSTS, host), dst, dirs_exist_ok=True, ignore=shutil.ignore_patterns("expected"))
            edited = 0
            for table, rewrite in table_variants.TABLES.items():
                path = os.path.join(dst, "cmd", f"{table}.txt")
                if os.path.exists(path):
                    with open(path, encoding="utf-8") as fh:
                        text = fh.read()
                    with open(path, "w", encoding="utf-8") as fh:
                        fh.write(rewrite(text, variant))
                    edited += 1
            assert edited == len(table_variants.TABLES), f"{host}: a table is missing"
            made[(host, variant)] = dst
        return made[(host, variant)]

    return get


@pytest.mark.parametrize("variant", table_variants.VARIANTS)
@pytest.mark.parametrize("host,case,argv", CASES, ids=[f"{h}/{c}" for h, c, _ in CASES])
def test_edited_tables_plan_exactly_the_golden(edited_hosts, host, case, argv, variant):
    with open(golden_path(host, case)) as fh:
        golden = json.load(fh)
    code, plan, err = run_plan(edited_hosts(host, variant), argv)
    assert code == golden["exit"], err
    assert plan == golden["plan"]


def test_real_950_header_plans():
    with open(os.path.join(HOSTS, "950-4numa", "cmd", "npu-smi_info_-m.txt")) as fh:
        assert fh.readline() == "\tNPU ID    Slot ID    Chip ID    Chip Phy-ID    Chip Name\n"
    assert not [f for f in os.listdir(os.path.join(HOSTS, "950-4numa", "cmd")) if "board" in f]
    code, plan, err = run_plan("950-4numa", ["--npu", "0"])
    assert code == 0, err
    assert plan["device_type"] == "950" and plan["mode"] == "ascend950_cluster" and plan["npus"]["0"]["main"]

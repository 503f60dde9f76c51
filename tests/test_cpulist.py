import pytest
from hypothesis import given, strategies as st

from ascendbind.values.cpulist import bits, format_cpulist, format_mask, parse_cpulist, parse_mask

cpu_sets = st.frozensets(st.integers(min_value=0, max_value=4200), max_size=300)


@given(cpu_sets)
def test_cpulist_round_trip(cpus):
    assert parse_cpulist(format_cpulist(cpus)) == cpus


@given(cpu_sets)
def test_mask_round_trip(cpus):
    assert parse_mask(format_mask(cpus)) == cpus


def test_cpulist_forms_seen_on_hosts():
    assert parse_cpulist("144-167") == frozenset(range(144, 168))
    # npu-smi topo sometimes prints a space after the comma
    assert parse_cpulist("0-3, 8,10-11") == frozenset({0, 1, 2, 3, 8, 10, 11})
    assert parse_cpulist("  \n") == frozenset()
    assert format_cpulist([5, 1, 2, 3, 9]) == "1-3,5,9"


def test_mask_matches_kernel_format():
    assert format_mask({0, 1}) == "00000003"
    assert format_mask({35}) == "00000008,00000000"
    assert format_mask({0}, min_groups=3) == "00000000,00000000,00000001"
    assert parse_mask("00000000,00000000,00000003") == frozenset({0, 1})


@pytest.mark.parametrize("bad", ["1-", "a", "3-1", "1,,2", "-2"])
def test_bad_cpulist_is_value_error(bad):
    with pytest.raises(ValueError):
        parse_cpulist(bad)


@pytest.mark.parametrize("bad", ["", "xyz", "123456789", "1,,2"])
def test_bad_mask_is_value_error(bad):
    with pytest.raises(ValueError):
        parse_mask(bad)


@given(st.integers(min_value=0, max_value=2**300))
def test_bits_are_the_set_positions(value):
    assert sum(1 << b for b in bits(value)) == value
    assert list(bits(value)) == sorted(bits(value))

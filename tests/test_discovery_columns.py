"""The header-layout splitter every table parser shares: plain strings in, cells out."""

from __future__ import annotations

import pytest

from ascendbind.discovery.parse.columns import blank_before, header_layout, split_row
from ascendbind.errors import ParseError

REAL_950 = "\tNPU ID    Slot ID    Chip ID    Chip Phy-ID    Chip Name"


def cells(header: str, row: str, **kw) -> dict[str, str]:
    layout = header_layout(header, **kw)
    return dict(zip(layout.names, split_row(layout, row, "test", 7)))


def test_multi_word_names_are_one_column_whatever_their_words():
    layout = header_layout(REAL_950)
    assert layout.names == ("NPU ID", "Slot ID", "Chip ID", "Chip Phy-ID", "Chip Name")
    assert layout.find("chip  phy-id") == 3 and layout.find("Slot") is None


def test_row_with_every_cell_is_read_in_order():
    row = "\t0         0          0          0              Ascend950PR"
    assert cells(REAL_950, row) == {
        "NPU ID": "0", "Slot ID": "0", "Chip ID": "0", "Chip Phy-ID": "0", "Chip Name": "Ascend950PR",
    }


def test_single_spaces_keep_a_value_together_in_any_column():
    header = "Chip Name       NPU ID    Chip ID"
    assert cells(header, "Ascend 910B3    3         0") == {"Chip Name": "Ascend 910B3", "NPU ID": "3", "Chip ID": "0"}


def test_empty_cell_falls_back_to_the_header_offsets():
    header = "NPU ID    Bus Width Mode    Chip ID    Chip Name"
    row = "4                           1          Ascend 910B3"
    assert cells(header, row) == {"NPU ID": "4", "Bus Width Mode": "", "Chip ID": "1", "Chip Name": "Ascend 910B3"}
    # a row cut short leaves the trailing columns empty, for the parser to judge
    assert cells(header, "4         x16 lanes")["Chip Name"] == ""


def test_a_tab_separates_even_where_it_expands_to_one_column():
    # "abcdefg" ends at column 7: the tab advances one column, yet it still ends the cell
    assert cells("name\tid", "abcdefg\t5") == {"name": "abcdefg", "id": "5"}
    # a leading tab in the header lines up with eight spaces in a row
    assert cells("\tNPU ID    Chip ID    Chip Name", "        1                     Mcu") == {
        "NPU ID": "1", "Chip ID": "", "Chip Name": "Mcu",
    }


def test_words_mode_reads_right_aligned_numbers_wider_than_their_names():
    header = "   CPU NODE SOCKET CORE"
    assert header_layout(header, words=True).names == ("CPU", "NODE", "SOCKET", "CORE")
    # SOCKET empty: placed by offset, and "1000" overlaps the right-aligned "CPU"
    assert cells(header, "  1000    3             7", words=True) == {"CPU": "1000", "NODE": "3", "SOCKET": "", "CORE": "7"}


def test_cells_under_one_column_are_joined_for_the_parser_to_reject():
    got = cells("NPU ID    Chip ID    Chip Name", "0  9      0          Ascend")
    assert got["NPU ID"] == "0 9"  # a value a number check refuses, naming the line


def test_box_borders_are_hard_and_sections_keep_their_sub_columns():
    header = "| NPU     Chip       | Process id | Process name | Process memory(MB) |"
    layout = header_layout(header)
    assert layout.names == ("NPU", "Chip", "Process id", "Process name", "Process memory(MB)")
    assert layout.sections == 4
    # borders drawn at other offsets than the header's: matched by section, not by offset
    row = "| 32896   1 | 6100 | mindie  llm | 12840 |"
    got = dict(zip(layout.names, split_row(layout, row, "test", 3)))
    assert got == {"NPU": "32896", "Chip": "1", "Process id": "6100", "Process name": "mindie llm",
                   "Process memory(MB)": "12840"}


def test_box_row_with_another_number_of_sections_names_source_and_line():
    layout = header_layout("| NPU ID | Process id | Process name |")
    with pytest.raises(ParseError) as info:
        split_row(layout, "| 0 | 4343", "npu-smi info", 12)
    assert info.value.source == "npu-smi info" and info.value.line == 12
    assert "row has 2 cells, header has 3" in str(info.value)


def test_blank_before_keeps_display_offsets():
    line = "NPU0\tX          144-167"
    out = blank_before(line, line.index("X") + 1)
    assert out.expandtabs() == " " * len(line[: line.index("X") + 1].expandtabs()) + line[line.index("X") + 1 :]
    assert out.index("1") == line.index("1")

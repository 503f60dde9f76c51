"""Edited copies of fixture tables: an extra unknown multi-word column, the columns
in another order, or both. Written independently of ascendbind's own column
splitter (which they exist to test): each function knows how the generator in
fixtures/hostgen.py lays its table out and rebuilds it the way the tool would.

Every rewrite keeps the table aligned the way the tool aligns it (npu-smi
left-aligns, lscpu right-aligns numbers), so a parser that reads columns by the
header's layout must read the same facts from the copy as from the original.
"""

from __future__ import annotations

import re

EXTRA_NAME = "Bus Width Mode"
EXTRA_VALUE = "PCIe x16 Gen5"  # single spaces inside: one cell
VARIANTS = ("extra", "reordered", "extra+reordered")

_GAP = re.compile(r"\t| {2,}")


def _gap_cells(text: str) -> list[str]:
    return [c for c in _GAP.split(text.strip()) if c]


def _order(names: list[str], variant: str) -> list[str]:
    """Reversed order for "reordered"; the unknown column goes second when present
    (between known columns, so it is neither first nor last)."""
    out = list(reversed(names)) if "reordered" in variant else list(names)
    if "extra" in variant:
        out.insert(1, EXTRA_NAME)
    return out


# ---------------------------------------------------------------- npu-smi info -m


def chip_map(text: str, variant: str) -> str:
    """Tab-indented, left-aligned ``npu-smi info -m``; [WARNING] lines kept at the end."""
    lines = text.splitlines()
    header = _gap_cells(lines[0])
    rows, trailer = [], []
    for line in lines[1:]:
        if line.startswith("[") or not line.strip():
            trailer.append(line)
            continue
        cells = _gap_cells(line)
        assert len(cells) == len(header), f"fixture row does not fill the header: {line!r}"
        rows.append(dict(zip(header, cells)))
    names = _order(header, variant)
    for r in rows:
        r[EXTRA_NAME] = EXTRA_VALUE
    widths = {n: max(len(n), *(len(r[n]) for r in rows)) + 4 for n in names}
    out = ["\t" + "".join(n.ljust(widths[n]) for n in names).rstrip()]
    out += ["\t" + "".join(r[n].ljust(widths[n]) for n in names).rstrip() for r in rows]
    return "\n".join(out + trailer) + "\n"


# ---------------------------------------------------------------- npu-smi info (process table)


def _sections(line: str) -> list[str]:
    return line.split("|")[1:-1]


def process_table(text: str, variant: str) -> str:
    """The box-drawn process table: its ``|`` cells reordered and an unknown cell
    added; in the "NPU  Chip" first cell the two sub-columns swap places when
    reordered. The status table above it and the full-width rows stay as they are."""
    lines = text.splitlines()
    at = next(i for i, ln in enumerate(lines) if ln.startswith("|") and "Process id" in ln)
    head = _sections(lines[at])
    width = max(len(EXTRA_NAME), len(EXTRA_VALUE)) + 3
    order = list(range(len(head)))
    if "reordered" in variant:
        order = list(reversed(order))
    two_part = len(_gap_cells(head[0])) == 2

    def rebuild(cells: list[str], extra: str) -> str:
        first = cells[0]
        if two_part and "reordered" in variant:
            a, b = _gap_cells(first)
            first = (" " + b.ljust(8) + a).ljust(len(cells[0]))
        cells = [first, *cells[1:]]
        out = [cells[i] for i in order]
        if "extra" in variant:
            out.insert(1, (" " + extra).ljust(width))
        return "|" + "|".join(out) + "|"

    out = lines[:at] + [rebuild(head, EXTRA_NAME)]
    for line in lines[at + 1 :]:
        cells = _sections(line) if line.startswith("|") else []
        if len(cells) == len(head):
            out.append(rebuild(cells, EXTRA_VALUE))
        else:
            out.append(line)  # borders, "No running processes found" rows, [WARNING] notes
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------- npu-smi info -t topo


def topo(text: str, variant: str) -> str:
    """The matrix rebuilt as npu-smi prints it (11-wide cells, the header indented
    by a tab and three spaces). Reordered: the link columns in reverse label order
    and the columns after the matrix reversed; extra: an unknown column after them."""
    lines = text.splitlines()
    head_at = next(i for i, ln in enumerate(lines) if re.match(r"\s*(NPU|Phy-ID)\d+\s", ln))
    header = lines[head_at]
    labels = re.findall(r"(?:NPU|Phy-ID)\d+", header)
    label_end = header.index(labels[-1]) + len(labels[-1])
    extra_names = _gap_cells(header[label_end:])
    rows: list[tuple[str, list[str], dict[str, str]]] = []
    end = head_at + 1
    while end < len(lines) and lines[end].strip():
        line = lines[end]
        words = line.split()
        # label + one link word per label, then the extra cells ("0-15, 32-47": one cell)
        link_end = 0
        for w in words[: 1 + len(labels)]:
            link_end = line.index(w, link_end) + len(w)
        rows.append((words[0], words[1 : 1 + len(labels)], dict(zip(extra_names, _gap_cells(line[link_end:])))))
        end += 1
    names = list(extra_names) + ([EXTRA_NAME] if "extra" in variant else [])
    if "reordered" in variant:
        names.reverse()
        labels.reverse()
        rows = [(lab, list(reversed(links)), vals) for lab, links, vals in rows]
    for _, _, vals in rows:
        vals[EXTRA_NAME] = EXTRA_VALUE
    widths = {n: max(len(n), *(len(v[n]) for _, _, v in rows)) + 3 for n in names}
    tail = "".join(n.ljust(widths[n]) for n in names)
    new_head = "\t   " + "".join(lab.ljust(11) for lab in labels) + tail
    body = [
        lab.ljust(11) + "".join(w.ljust(11) for w in links) + "".join(vals[n].ljust(widths[n]) for n in names)
        for lab, links, vals in rows
    ]
    return "\n".join(lines[:head_at] + [new_head.rstrip()] + [b.rstrip() for b in body] + lines[end:]) + "\n"


# ---------------------------------------------------------------- lscpu -e


def lscpu_e(text: str, variant: str) -> str:
    """lscpu's layout: names and values are single words, one space apart at least,
    numbers right-aligned under their names, the cache column left-aligned."""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    header = lines[0].split()
    rows = [dict(zip(header, ln.split())) for ln in lines[1:]]
    assert all(len(r) == len(header) for r in rows)
    names = _order(header, variant)
    for r in rows:
        r[EXTRA_NAME] = "16"
    widths = {n: max(len(n), *(len(r[n]) for r in rows)) for n in names}

    def fmt(n: str, value: str) -> str:
        return value.ljust(widths[n]) if n.startswith("L1d") else value.rjust(widths[n])

    out = [" ".join(fmt(n, n) for n in names)]
    out += [" ".join(fmt(n, r[n]) for n in names) for r in rows]
    return "\n".join(s.rstrip() for s in out) + "\n"


TABLES = {
    "npu-smi_info_-m": chip_map,
    "npu-smi_info": process_table,
    "npu-smi_info_-t_topo": topo,
    "lscpu_-e": lscpu_e,
}

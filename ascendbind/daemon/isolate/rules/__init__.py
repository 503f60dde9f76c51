"""Isolation's pure rules: values in, verdicts out; nothing here touches the host.

keys.py names a mask (``MaskKey``: its kind and parts, printed as the state
file's key); records.py is what the state file keeps of each mask isolation
changed, one record type per kind; verdicts.py is the one answer to "does this
mask still hold what isolation wrote?" (``holds``) and what follows from it for
one mask (``mask_act``), and where one IRQ goes (``irq_target``). The shells
around them (kinds.py, keeper.py, hosttasks.py, banned.py) read and write the
host and ask these.
"""

"""The worker's NPUs: which ones it drives, and where their interrupts go.

targets.py weighs a bind's request and the evidence about the worker (its
devices, its environment, the driver's process map) into the target NPUs and
the one rule that picked them; ascend_env.py reads the ``ASCEND_*`` variables
as the container runtime and the NPU runtime do; irqs.py plans the IRQ step:
which interrupts each NPU's step moves, and to which CPU.

May import: from the planner, pools/; from the rest of ascendbind, only values/ and errors.py.
"""

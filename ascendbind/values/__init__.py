"""The values every layer hands the next, and nothing else: frozen, pure, no I/O.

model.py holds the host's and a worker's facts, the plan and the step results;
decisions.py what one step hands the next (IRQ writes with the masks they
replaced, UVB masks, the alignment verdict); targeting.py a bind's target
request, the NPU evidence about a worker and the target decision; reasons.py
the steps, their outcomes and the reason codes; config.py the configuration's
keys, defaults, choices and checks. Beneath them: frozen.py (read-only
containers and their JSON form), cpulist.py (CPU lists and kernel masks, both
ways) and digits.py (decimal ids in ASCII digits only).

Pure by location: tests/test_structure.py holds every module here, and all it
imports, to no ``os``, ``subprocess``, ``psutil`` or ``tomllib`` and no
``open()``. What reads a configuration file or the environment is
settings.py, and what runs a tool is command.py: shells, so they live outside.
errors.py stays at the top too, beside client.py: a worker imports both by
those names.

May import: from the rest of ascendbind, only errors.py.
"""

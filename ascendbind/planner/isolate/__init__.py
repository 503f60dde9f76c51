"""Isolation planned: which CPUs the rest of the host keeps to while workers are bound.

isolation.py plans each isolation level from the bound workers' plans (the
housekeeping CPUs, what each level moves, where a task goes); driverwork.py
names the NPU driver's own per-device work (kernel threads, workqueues) and
where it goes. daemon/isolate/ carries the plan out; this room only decides.

May import: from the planner, plan.py; from the rest of ascendbind, only values/.
"""

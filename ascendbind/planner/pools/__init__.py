"""Each NPU's CPU pool, and its split into roles.

One file per rule family: global_slice.py cuts the sorted allowed CPUs by
global logical NPU id, topo_affinity.py takes each NPU's CPU affinity,
cluster950.py one full CPU cluster per NPU on its affinity node; cpuset_pool.py
says when the worker's own cpuset is its pool instead; roles.py splits a pool
into the IRQ, main, ACL and release roles. layout.py is the host's CPU and
NUMA layout as they all need it, computed once per plan.

May import: from the planner, codes.py; from the rest of ascendbind, only values/.
"""

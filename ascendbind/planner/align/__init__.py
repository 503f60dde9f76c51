"""NUMA alignment under ``topology_policy``, after the kubelet Topology Manager.

providers.py gives each NPU's device, CPU and memory hints; hints.py holds the
hints and their merge; policy.py the topology and CPU-bind policies as small
objects behind one protocol; alignment.py decides, with the precedence and the
failure reasons the metrics label.

May import: from the planner, pools/ and codes.py; from the rest of ascendbind, only values/ and errors.py.
"""

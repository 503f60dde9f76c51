"""The host's facts, and what the daemon does when they change.

hostcache.py keeps the host's facts (the NPU map and topology, lscpu, NUMA
distances, each NPU's IRQs) and ``npu-smi``'s process table, with their
failures, so a hung tool costs one timeout and not one per request;
hotplug.py hears CPU and PCI uevents and asks for one rediscovery when a burst
is over; replan.py rediscovers and binds again only the workers whose plan
changed; autobind.py binds the processes ``npu-smi`` lists (``auto_bind``).
A new binding goes to the ``Daemon``, which alone records it.

May import: from the daemon, runtime/ and api/requests.py; from the rest of ascendbind, anything.
"""

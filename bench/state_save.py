"""The daemon's state write: ``StateFile.save`` with 16 bound workers.

    .venv/bin/python bench/state_save.py [--workers N] [--runs N] [--fixture PATH]

The workers are the entry of a state fixture (a worker of the 192-CPU A2 fixture
host bound to one NPU, its IRQ step, irqbalance bans) repeated under N pids, read
back through the daemon's own loader and written as the daemon writes them: the
records built from the bindings, then one save. Prints the record size per
worker, the file size and the median time of a save (build + write) over the runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ascendbind.daemon.state.state import StateFile  # noqa: E402
from ascendbind.daemon.state.staterecord import binding_from_json, binding_to_json  # noqa: E402

HELD = ("bound_at", "topology_policy", "culprit", "blame", "left_alone", "left_alone_why", "irq_culprit",
        "irqs_left_alone", "irqs_left_alone_why")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--fixture", default=os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                      "fixtures", "state", "state-v1.json"))
    args = ap.parse_args(argv)
    with open(args.fixture) as fh:
        doc = json.load(fh)
    with tempfile.TemporaryDirectory() as tmp:
        # a proc root whose boot id is the fixture's, so its entries are of "this boot"
        rnd = os.path.join(tmp, "proc", "sys", "kernel", "random")
        os.makedirs(rnd)
        with open(os.path.join(rnd, "boot_id"), "w") as fh:
            fh.write(doc["boot_id"] + "\n")
        src = os.path.join(tmp, "src")
        os.makedirs(src, mode=0o700)
        with open(os.path.join(src, "state.json"), "w") as fh:
            json.dump(doc, fh)
        os.chmod(os.path.join(src, "state.json"), 0o600)
        raw = StateFile(src, proc_root=os.path.join(tmp, "proc")).load().workers[0]
        binding = binding_from_json(raw)
        held = {k: raw.get(k) for k in HELD}
        bindings = [dataclasses.replace(binding, pid=binding.pid + i) for i in range(args.workers)]
        sf = StateFile(os.path.join(tmp, "state"), proc_root=os.path.join(tmp, "proc"))
        sf.prepare()
        times = []
        for _ in range(args.runs):
            t0 = time.perf_counter()
            sf.save([binding_to_json(b, **held) for b in bindings])
            times.append(time.perf_counter() - t0)
        size = os.path.getsize(sf.path)
        one = len(json.dumps(binding_to_json(bindings[0], **held), sort_keys=True))
    print(f"workers {args.workers}: record {one} bytes/worker, file {size} bytes, "
          f"save median {statistics.median(times) * 1e3:.3f} ms (p90 {sorted(times)[int(len(times) * .9)] * 1e3:.3f} ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

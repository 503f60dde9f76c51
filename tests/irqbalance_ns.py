"""Exec irqbalance with a private /run: ``unshare --mount --propagation private -- python
tests/irqbalance_ns.py /usr/sbin/irqbalance ARGS…``.

irqbalance binds ``/run/irqbalance/irqbalance<pid>.sock`` when that directory
exists (as under systemd's RuntimeDirectory=), else one abstract address shared
by every irqbalance. A tmpfs on /run in a mount namespace of its own gives each
test's irqbalance its own socket file, so tests may run side by side, and
nothing is created in the host's /run. The pid stays the same through the exec.
"""

import os
import subprocess
import sys

if __name__ == "__main__":
    subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=0755,size=1m", "ascendbind-test", "/run"], check=True)
    os.mkdir("/run/irqbalance", 0o755)
    os.execv(sys.argv[1], sys.argv[1:])

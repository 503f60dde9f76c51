"""Discovery: host text -> frozen facts. Pure parsers plus the HostSource edge."""

from .host import discover_host, discover_worker
from .sources import HostSource, LiveHost, SnapshotHost

__all__ = ["discover_host", "discover_worker", "HostSource", "LiveHost", "SnapshotHost"]

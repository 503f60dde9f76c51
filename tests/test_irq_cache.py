"""The daemon's cache of each NPU's IRQs: filled by a bind, kept until a rediscovery.

The host is the recorded A3 snapshot (16 NPUs, 640 CPUs, its /proc/interrupts
and msi_irqs), copied so a test can renumber the IRQs under the cache the way a
driver reload does.
"""

from __future__ import annotations

import os
import re
import shutil

import pytest

from ascendbind.applier.irq import planned_irqs
from ascendbind.values.config import Config
from ascendbind.daemon.host.hostcache import HostCache
from ascendbind.discovery import SnapshotHost, discover_worker
from ascendbind.planner import make_plan
from ascendbind.values.reasons import Reason

HOSTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "hosts")
NPU = 2  # 0000:99:00.0: SQ 205, CQ 206 in the recording


def _copy(tmp_path) -> str:
    dst = str(tmp_path / "a3")
    shutil.copytree(os.path.join(HOSTS, "a3-16die"), dst, ignore=shutil.ignore_patterns("expected"))
    return dst


def _renumber(d: str, old: int, new: int) -> None:
    """The driver came back with ``new`` where ``old`` was: /proc/interrupts and msi_irqs."""
    path = os.path.join(d, "proc", "interrupts")
    with open(path) as fh:
        text = fh.read()
    text, n = re.subn(rf"(?m)^(\s*){old}:", lambda m: f"{m.group(1)}{new}:", text)
    assert n == 1
    with open(path, "w") as fh:
        fh.write(text)
    msi = os.path.join(d, "sys", "bus", "pci", "devices", "0000:99:00.0", "msi_irqs")
    os.rename(os.path.join(msi, str(old)), os.path.join(msi, str(new)))


def _cache(d: str) -> HostCache:
    return HostCache(Config(), source=SnapshotHost(d))


@pytest.fixture
def cached(tmp_path):
    """(the copied host's directory, its HostCache, the facts that cache discovered)."""
    d = _copy(tmp_path)
    cache = _cache(d)
    try:
        yield d, cache, cache.get()
    finally:
        cache.close()


def test_a_bind_fills_the_cache_and_the_next_bind_reads_nothing(cached):
    d, cache, host = cached
    first = cache.npu_irqs(host, [NPU])[NPU]
    assert (first.sq, first.cq, first.reason) == (205, 206, None)
    # the files are gone: only a cache can still answer
    os.unlink(os.path.join(d, "proc", "interrupts"))
    assert cache.npu_irqs(host, [NPU])[NPU] == first


def test_a_rediscovery_drops_the_cached_irqs(cached):
    d, cache, host = cached
    assert cache.npu_irqs(host, [NPU])[NPU].sq == 205
    _renumber(d, 205, 4000)
    assert cache.npu_irqs(host, [NPU])[NPU].sq == 205  # no event yet: the numbers held
    host, changed = cache.refresh()  # the hot-plug debouncer's (or SIGHUP's) rediscovery
    assert not changed  # the static facts are the same; the IRQ numbers are not
    assert cache.npu_irqs(host, [NPU])[NPU].sq == 4000


class _RediscoveredMidway(SnapshotHost):
    """The snapshot, with a rediscovery landing while a bind lists an NPU's MSI vectors."""

    cache: HostCache | None = None

    def listdir(self, path):
        names = super().listdir(path)
        cache, self.cache = self.cache, None
        if cache is not None and path.endswith("/msi_irqs"):
            cache.refresh()
        return names


def test_a_lookup_overtaken_by_a_rediscovery_is_not_kept(tmp_path):
    d = _copy(tmp_path)
    source = _RediscoveredMidway(d)
    cache = HostCache(Config(), source=source)
    try:
        host = cache.get()
        source.cache = cache
        assert cache.npu_irqs(host, [NPU])[NPU].sq == 205  # the request still gets its answer
        assert source.cache is None  # the rediscovery did land inside the lookup
        _renumber(d, 205, 4000)
        assert cache.npu_irqs(cache.get(), [NPU])[NPU].sq == 4000  # nothing was kept for the new facts
    finally:
        cache.close()


def test_what_may_change_without_an_event_is_looked_up_again(tmp_path):
    d = _copy(tmp_path)
    msi = os.path.join(d, "sys", "bus", "pci", "devices", "0000:99:00.0", "msi_irqs")
    parked = str(tmp_path / "msi")
    os.rename(msi, parked)
    cache = _cache(d)
    try:
        host = cache.get()
        assert cache.npu_irqs(host, [NPU])[NPU].reason is Reason.NO_MSI_IRQS
        os.rename(parked, msi)  # MSI vectors enabled later, by the driver
        assert cache.npu_irqs(host, [NPU])[NPU].sq == 205
    finally:
        cache.close()


def test_a_failed_irq_write_forgets_the_cache(cached):
    d, cache, host = cached
    assert cache.npu_irqs(host, [NPU])[NPU].sq == 205
    _renumber(d, 205, 4000)
    cache.forget_irqs()
    assert cache.npu_irqs(host, [NPU])[NPU].sq == 4000


def test_the_irq_step_plans_from_the_lookup_it_is_given(cached):
    d, cache, host = cached
    cfg = Config()
    worker = discover_worker(SnapshotHost(d), 1001, cfg)
    plan = make_plan(host, worker, (NPU,), cfg)
    assert not plan.errors
    cache.npu_irqs(host, [NPU])
    _renumber(d, 205, 4000)
    source = SnapshotHost(d)
    from_host = planned_irqs(plan, host, cfg, source)[NPU]
    kept = planned_irqs(plan, host, cfg, source, lookup=cache.npu_irqs)[NPU]
    assert from_host.sq == 4000 and kept.sq == 205
    assert [irq for irq, _ in kept.moves][:1] == [205]

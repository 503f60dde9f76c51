"""The kernel settings the daemon sizes itself by, read through discovery."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from ascendbind.daemon.api.listen import open_listen_socket
from ascendbind.discovery.read.kernel import SOMAXCONN_FLOOR, SOMAXCONN_UNKNOWN, parse_somaxconn, somaxconn


@pytest.mark.parametrize("text, want", [
    ("4096\n", 4096), ("65535", 65535), (" 200 \n", 200),
    ("16\n", SOMAXCONN_FLOOR),       # below any sane backlog: the floor
    ("", SOMAXCONN_UNKNOWN), (None, SOMAXCONN_UNKNOWN), ("lots\n", SOMAXCONN_UNKNOWN),
])
def test_parse_somaxconn(text, want):
    assert parse_somaxconn(text) == want


def test_somaxconn_reads_the_file_under_proc_root(tmp_path):
    core = tmp_path / "sys" / "net" / "core"
    core.mkdir(parents=True)
    (core / "somaxconn").write_text("1234\n")
    assert somaxconn(str(tmp_path)) == 1234
    (core / "somaxconn").write_bytes(b"\xff\xfe")
    assert somaxconn(str(tmp_path)) == SOMAXCONN_UNKNOWN
    assert somaxconn(str(tmp_path / "absent")) == SOMAXCONN_UNKNOWN


def test_the_daemon_socket_listens_with_the_hosts_somaxconn(tmp_path):
    with open("/proc/sys/net/core/somaxconn") as fh:
        host = int(fh.read())
    assert somaxconn() == max(SOMAXCONN_FLOOR, host)
    path = str(tmp_path / "s.sock")
    sock, how, _owned = open_listen_socket(path, "")
    assert how == "created"
    try:
        # ss reports a listening socket's backlog in Send-Q
        ss = shutil.which("ss")
        if ss is None:
            from tests.deploy_tools import missing

            missing("ss (Debian package iproute2)")
        out = subprocess.run([ss, "-xlH", "src", path], capture_output=True, text=True, timeout=30).stdout
        fields = out.split()
        assert fields and int(fields[3]) == somaxconn(), out
    finally:
        sock.close()

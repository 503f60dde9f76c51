"""The Kubernetes node's preparation, piece by piece and without a node: the Debian mirrors
read from apt's sources, the OCI archives written for ``ctr images import``, the retried
downloads (tests/kubenode.py, tests/oci_archive.py)."""

from __future__ import annotations

import hashlib
import io
import json
import os
import sys
import tarfile

import pytest

from tests import kubenode, oci_archive


def _write(path, text: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as fh:
        fh.write(text)


def test_debian_mirrors_come_from_deb822_sources(tmp_path):
    _write(tmp_path / "sources.list.d" / "debian.sources",
           "Types: deb\nURIs: http://mirror.example/debian\nSuites: bookworm bookworm-updates\nComponents: main\n\n"
           "Types: deb\nURIs: http://mirror.example/debian-security\nSuites: bookworm-security\nComponents: main\n")
    _write(tmp_path / "sources.list.d" / "other.sources",
           "Types: deb\nURIs: https://vendor.example/apt\nSuites: nodistro\nComponents: main\n")
    assert kubenode.debian_uris(str(tmp_path)) == ("http://mirror.example/debian", "http://mirror.example/debian-security")


def test_debian_mirrors_come_from_one_line_sources(tmp_path):
    _write(tmp_path / "sources.list",
           "# a comment\ndeb [arch=amd64] http://a.example/debian trixie main\n"
           "deb http://a.example/debian-security trixie-security main\ndeb-src http://b.example/debian trixie main\n")
    assert kubenode.debian_uris(str(tmp_path)) == ("http://a.example/debian", "http://a.example/debian-security")


def test_no_debian_mirror_is_none(tmp_path):
    _write(tmp_path / "sources.list.d" / "x.sources",
           "Types: deb\nURIs: https://vendor.example/apt\nSuites: nodistro\nComponents: main\n")
    assert kubenode.debian_uris(str(tmp_path)) == (None, None)


def _members(path) -> dict[str, bytes]:
    with tarfile.open(path) as tf:
        return {m.name: tf.extractfile(m).read() for m in tf.getmembers() if m.isfile()}


def test_an_oci_archive_holds_a_consistent_image(tmp_path):
    out = tmp_path / "img.tar"
    digest = oci_archive.write_image(str(out), "localhost/x:1", {"bin/tool": b"\x7fELF...", "bin/sh": oci_archive.Link("tool")},
                                     entrypoint=["/bin/sh"])
    blobs = _members(out)
    for name, data in blobs.items():
        if name.startswith("blobs/sha256/"):
            assert hashlib.sha256(data).hexdigest() == name.rsplit("/", 1)[1]  # content-addressed
    index = json.loads(blobs["index.json"])
    (entry,) = index["manifests"]
    assert entry["digest"] == digest and entry["annotations"]["io.containerd.image.name"] == "localhost/x:1"
    manifest = json.loads(blobs["blobs/sha256/" + digest.split(":")[1]])
    config = json.loads(blobs["blobs/sha256/" + manifest["config"]["digest"].split(":")[1]])
    (layer_ref,) = manifest["layers"]
    layer = blobs["blobs/sha256/" + layer_ref["digest"].split(":")[1]]
    assert config["rootfs"]["diff_ids"] == [layer_ref["digest"]]  # uncompressed: diff id = digest
    assert config["config"]["Entrypoint"] == ["/bin/sh"]
    with tarfile.open(fileobj=io.BytesIO(layer)) as tf:
        members = {m.name: m for m in tf.getmembers()}
    assert members["bin/tool"].mode == 0o755 and members["bin/sh"].issym() and members["bin/sh"].linkname == "tool"
    assert members["tmp"].isdir() and members["proc"].isdir()


def test_the_same_files_give_the_same_digest(tmp_path):
    files = {"pause": b"binary"}
    a = oci_archive.write_image(str(tmp_path / "a.tar"), "localhost/p:1", files, entrypoint=["/pause"])
    b = oci_archive.write_image(str(tmp_path / "b.tar"), "localhost/p:1", files, entrypoint=["/pause"])
    assert a == b
    assert (tmp_path / "a.tar").read_bytes() == (tmp_path / "b.tar").read_bytes()


def _flaky(tmp_path, failures: int) -> list[str]:
    """argv of a download that fails ``failures`` times (exit 100, apt's), then succeeds."""
    counter = tmp_path / "tries"
    code = (f"import sys,pathlib; p=pathlib.Path({str(counter)!r}); n=int(p.read_text()) if p.exists() else 0; "
            f"p.write_text(str(n+1)); sys.stderr.write('E: 503 try %d\\n' % (n+1)); sys.exit(100 if n < {failures} else 0)")
    return [sys.executable, "-c", code]


def test_a_download_that_fails_is_tried_again(tmp_path):
    said = []
    kubenode._fetch(_flaky(tmp_path, 2), "apt-get source", cwd=str(tmp_path), waits=(0, 0), log=said.append)
    assert (tmp_path / "tries").read_text() == "3"
    assert len(said) == 2 and "try 2 of 3" in said[0]


def test_a_download_that_keeps_failing_names_itself_and_its_tries(tmp_path):
    with pytest.raises(kubenode.PrepareError) as err:
        kubenode._fetch(_flaky(tmp_path, 9), "apt-get source kubernetes", cwd=str(tmp_path), waits=(0, 0), log=lambda s: None)
    text = str(err.value)
    assert "apt-get source kubernetes: 3 tries failed" in text and "E: 503 try 3" in text and "exit 100" in text


def test_the_cache_key_changes_with_the_recipe(monkeypatch):
    before = kubenode.key()
    monkeypatch.setattr(kubenode, "RECIPE", kubenode.RECIPE + 1)
    assert kubenode.key() != before and kubenode.SOURCE_DSC_SHA256[:12] in kubenode.key()

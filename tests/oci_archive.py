"""A one-layer OCI image archive written from local files, for ``ctr images import``.

    write_image("busybox.tar", "localhost/busybox:local", {"bin/busybox": open(...).read(),
                "bin/sh": Link("busybox")}, entrypoint=["/bin/sh"])

The archive is an OCI image layout (``oci-layout``, ``index.json``, ``blobs/sha256/...``)
packed in a plain tar: one uncompressed layer tar, its config (the diff id of the layer, the
entrypoint, ``PATH``) and a manifest, named in the index by the
``io.containerd.image.name`` annotation, which ``ctr images import`` takes as the image's
reference. Every timestamp is 0 and every owner root, so the same files give the same digests:
importing an archive twice is a no-op for containerd. No registry is involved.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = ["Link", "write_image"]

_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
# the directories a container runtime mounts over (proc, sys, dev) or writes (tmp, etc/hosts)
_SKELETON = ("dev", "etc", "proc", "sys", "tmp")


@dataclass(frozen=True)
class Link:
    """A symbolic link to ``target`` in the layer."""
    target: str


def _add(tf: tarfile.TarFile, name: str, *, data: bytes | None = None, mode: int = 0o755,
         kind: bytes = tarfile.REGTYPE, link: str = "") -> None:
    ti = tarfile.TarInfo(name)
    ti.type, ti.mode, ti.mtime, ti.linkname = kind, mode, 0, link
    ti.uid = ti.gid = 0
    ti.size = len(data) if data is not None else 0
    tf.addfile(ti, io.BytesIO(data) if data is not None else None)


def _layer(files: Mapping[str, bytes | Link]) -> bytes:
    dirs = set(_SKELETON)
    for path in files:
        parts = path.split("/")[:-1]
        dirs.update("/".join(parts[:i]) for i in range(1, len(parts) + 1))
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for d in sorted(dirs):
            _add(tf, d, kind=tarfile.DIRTYPE, mode=0o1777 if d == "tmp" else 0o755)
        for path, content in sorted(files.items()):
            if isinstance(content, Link):
                _add(tf, path, kind=tarfile.SYMTYPE, link=content.target, mode=0o777)
            else:
                _add(tf, path, data=content)
    return buf.getvalue()


def _blob(data: bytes) -> tuple[str, bytes]:
    return "sha256:" + hashlib.sha256(data).hexdigest(), data


def write_image(out: str, ref: str, files: Mapping[str, bytes | Link], *, entrypoint: Sequence[str],
                arch: str = "amd64") -> str:
    """Write the archive ``out`` holding image ``ref`` (``files``: path in the image, without
    the leading slash -> content; every regular file is executable). Returns the manifest's
    digest."""
    layer_id, layer = _blob(_layer(files))
    config_id, config = _blob(json.dumps({
        "architecture": arch, "os": "linux", "created": "1970-01-01T00:00:00Z",
        "config": {"Entrypoint": list(entrypoint), "Env": ["PATH=/bin:/usr/bin:/sbin:/usr/sbin"], "WorkingDir": "/"},
        "rootfs": {"type": "layers", "diff_ids": [layer_id]},
    }, sort_keys=True).encode())
    manifest_id, manifest = _blob(json.dumps({
        "schemaVersion": 2, "mediaType": _MANIFEST,
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": config_id, "size": len(config)},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": layer_id, "size": len(layer)}],
    }, sort_keys=True).encode())
    index = json.dumps({"schemaVersion": 2, "manifests": [{
        "mediaType": _MANIFEST, "digest": manifest_id, "size": len(manifest),
        "platform": {"architecture": arch, "os": "linux"},
        "annotations": {"io.containerd.image.name": ref, "org.opencontainers.image.ref.name": ref},
    }]}, sort_keys=True).encode()
    with tarfile.open(out + ".part", "w") as tf:
        _add(tf, "oci-layout", data=b'{"imageLayoutVersion":"1.0.0"}', mode=0o644)
        _add(tf, "index.json", data=index, mode=0o644)
        _add(tf, "blobs", kind=tarfile.DIRTYPE)
        _add(tf, "blobs/sha256", kind=tarfile.DIRTYPE)
        for digest, data in ((layer_id, layer), (config_id, config), (manifest_id, manifest)):
            _add(tf, "blobs/sha256/" + digest.split(":")[1], data=data, mode=0o644)
    os.replace(out + ".part", out)
    return manifest_id

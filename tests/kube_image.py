"""The DaemonSet's image, built for real from ``deploy/kubernetes/Containerfile`` with
buildah, without pulling anything from a registry.

    archive, ref = daemon_image()     # a docker-archive tar and the reference it carries
    # ctr -n k8s.io images import <archive>  ->  image <ref>

Operators build the Containerfile on ``docker.io/library/python:3.11-slim-bookworm``
(its ``PYTHON_IMAGE`` build argument). Here the base is made from the Debian archive
instead: ``mmdebstrap`` writes a bookworm minbase with Debian's Python 3.11, pip and
CA certificates, shaped like the official slim image where the Containerfile can tell:

- pip installs into the system: the official image's Python has no PEP 668 marker, and
  Debian's ``/usr/lib/python3.11/EXTERNALLY-MANAGED`` makes ``pip install`` refuse. The
  marker is moved aside with ``dpkg-divert`` (not deleted, which an upgrade of
  libpython3.11-stdlib would undo, and not ``PIP_BREAK_SYSTEM_PACKAGES=1``, which the
  image's config would carry into every container the DaemonSet runs);
- apt keeps no package caches (Debian's container images' ``docker-clean``) and dpkg
  leaves out man pages, docs and translations (the slim variant);
- the host's own trust anchors (``/usr/local/share/ca-certificates``) are added: where
  outbound TLS passes a proxy that signs with a local CA, pip inside the build cannot
  reach PyPI without them. A host without any adds nothing.

The base is imported into buildah as ``BASE_REF`` and the Containerfile is built on it
with ``--build-arg PYTHON_IMAGE=BASE_REF --pull-never``, unchanged: its RUN steps reach
Debian's archive and PyPI themselves (``--isolation chroot`` shares the host's network).
buildah's storage is a fresh directory under the cache for each build, removed after
it. Every buildah command runs in a private mount namespace (``unshare --mount``) in
which ``/var/lib`` is an overlay whose upper layer is a tmpfs: buildah's mounts, and
the blob-info cache it writes under ``/var/lib/containers`` whatever ``--root`` says,
end with that namespace, so nothing of a build stays on the host but its archive.
The storage driver is overlay, else vfs where overlay cannot work (a root file system
that is itself an overlay); ``ASCENDBIND_KUBE_IMAGE_DRIVER`` picks one.

Both are cached under ``ASCENDBIND_KUBE_IMAGE_CACHE`` (default ``~/.cache/ascendbind-kube-image``): the
base, saved as a docker-archive once buildah has imported it, by a hash of its recipe
(the mmdebstrap command line, the added CAs), the image archive by a hash of the files the build context sends (the root
``.dockerignore`` applied), the Containerfile, the build arguments and the base's key.
A ``flock`` keeps two processes from building at once; the second reuses the first's.

``python -m tests.kube_image --prepare`` builds or reuses it and says which, and how long.
"""

from __future__ import annotations

import argparse
import fcntl
import glob
import hashlib
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CACHE = (os.environ.get("ASCENDBIND_KUBE_IMAGE_CACHE")
         or os.path.join(os.path.expanduser("~"), ".cache", "ascendbind-kube-image"))
CONTAINERFILE = "deploy/kubernetes/Containerfile"
IMAGE_REF = "localhost/ascendbind:test"
BASE_REF = "localhost/ascendbind-test-base:bookworm"
LOCAL_CAS = "/usr/local/share/ca-certificates"

# the base: what the Containerfile's `python -m pip` and `apt-get` need, and the official
# image's shape (see the module's docstring)
BASE_SUITE = "bookworm"
BASE_PACKAGES = ("python3", "python3-pip", "python-is-python3", "ca-certificates")
BASE_DPKG = ("path-exclude=/usr/share/man/*", "path-exclude=/usr/share/info/*", "path-exclude=/usr/share/doc/*",
             "path-include=/usr/share/doc/*/copyright", "path-exclude=/usr/share/locale/*")
APT_CLEAN = ('DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb '
             '/var/cache/apt/*.bin || true"; };\n'
             'APT::Update::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb '
             '/var/cache/apt/*.bin || true"; };\n'
             'Dir::Cache::pkgcache "";\nDir::Cache::srcpkgcache "";\nAcquire::Languages "none";\n')
BASE_ENV = ("PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG=C.UTF-8")
BASE_CMD = '["python3"]'

# a download that fails (mirror, PyPI) is tried this often in all
TRIES = 2


class BuildError(RuntimeError):
    """The image could not be built: which step, and the tool's last words."""


# ------------------------------------------------------------------ the build context

def _ignore_rules(root: str) -> list[tuple[bool, re.Pattern, str]]:
    """The root ``.dockerignore`` as (exclude?, regex, pattern) in file order; the last rule that
    matches a path or one of its parent directories decides (buildah skips an excluded
    directory's contents unless a later ``!`` rule names something in it)."""
    path = os.path.join(root, ".dockerignore")
    rules = []
    if not os.path.exists(path):
        return rules
    with open(path) as fh:
        for line in fh:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            exclude = not line.startswith("!")
            pat = os.path.normpath(line.lstrip("!").strip().lstrip("/"))
            rx = ""
            i = 0
            while i < len(pat):
                if pat.startswith("**/", i):
                    rx, i = rx + "(?:.*/)?", i + 3
                elif pat.startswith("**", i):
                    rx, i = rx + ".*", i + 2
                elif pat[i] == "*":
                    rx, i = rx + "[^/]*", i + 1
                elif pat[i] == "?":
                    rx, i = rx + "[^/]", i + 1
                else:
                    rx, i = rx + re.escape(pat[i]), i + 1
            rules.append((exclude, re.compile(rx + r"\Z"), pat))
    return rules


def _sent(rel: str, rules) -> bool:
    parts = rel.split("/")
    prefixes = ["/".join(parts[:n]) for n in range(1, len(parts) + 1)]
    sent = True
    for exclude, rx, _ in rules:
        if any(rx.match(p) for p in prefixes):
            sent = not exclude
    return sent


def context_files(root: str = REPO) -> list[str]:
    """The files (relative paths, sorted) a ``buildah bud`` of ``root`` sends as its context."""
    rules = _ignore_rules(root)
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        rel_dir = os.path.relpath(dirpath, root)
        for name in filenames + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
            rel = name if rel_dir == "." else f"{rel_dir}/{name}"
            if _sent(rel, rules):
                out.append(rel)
        dirnames[:] = [d for d in dirnames if not _prunable(d if rel_dir == "." else f"{rel_dir}/{d}", rules)]
    return sorted(out)


def _prunable(rel: str, rules) -> bool:
    """Whether nothing under directory ``rel`` can be sent: it is excluded and no ``!``
    rule names a path under it (a wildcard in one might, so it forbids pruning). This
    keeps the walk out of .git and .venv."""
    if _sent(rel, rules):
        return False
    for exclude, _, pat in rules:
        if not exclude and (any(c in pat for c in "*?[") or pat.startswith(rel + "/")):
            return False
    return True


def _digest(h, path: str) -> None:
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        h.update(b"L" + os.readlink(path).encode())
        return
    h.update(b"X" if st.st_mode & 0o111 else b"F")
    with open(path, "rb") as fh:
        h.update(hashlib.sha256(fh.read()).digest())


# ------------------------------------------------------------------------- keys

def _local_cas() -> list[str]:
    return sorted(glob.glob(os.path.join(LOCAL_CAS, "**", "*.crt"), recursive=True))


def _mmdebstrap_argv(out: str) -> list[str]:
    argv = ["mmdebstrap", "--mode=unshare", "--variant=minbase", "--include=" + ",".join(BASE_PACKAGES),
            *[f"--dpkgopt={o}" for o in BASE_DPKG],
            # pip installs into the system, as in the official image (see the docstring)
            "--customize-hook=chroot \"$1\" dpkg-divert --local --rename --add /usr/lib/python3.11/EXTERNALLY-MANAGED",
            "--customize-hook=upload {apt_clean} /etc/apt/apt.conf.d/docker-clean",
            # mmdebstrap's own `apt-get clean` cannot find these once docker-clean unnames them
            "--customize-hook=rm -f \"$1\"/var/cache/apt/pkgcache.bin \"$1\"/var/cache/apt/srcpkgcache.bin"]
    cas = _local_cas()
    if cas:
        argv += [f"--customize-hook=copy-in {' '.join(cas)} /usr/local/share/ca-certificates/",
                 "--customize-hook=chroot \"$1\" update-ca-certificates"]
    return argv + [BASE_SUITE, out]


def base_key() -> str:
    """A hash of the base's recipe: the mmdebstrap command, the apt settings, the image
    config and the content of every CA it adds."""
    h = hashlib.sha256(json.dumps([_mmdebstrap_argv("OUT"), APT_CLEAN, BASE_ENV, BASE_CMD]).encode())
    for ca in _local_cas():
        _digest(h, ca)
    return h.hexdigest()[:16]


def image_key(root: str = REPO) -> str:
    """A hash of what the image is made of: the context's files (path, exec bit,
    content), the Containerfile, the reference, the build argument and the base."""
    h = hashlib.sha256(json.dumps([IMAGE_REF, BASE_REF, base_key()]).encode())
    for rel in context_files(root):
        h.update(rel.encode() + b"\0")
        _digest(h, os.path.join(root, rel))
    _digest(h, os.path.join(root, CONTAINERFILE))
    return h.hexdigest()[:16]


def _archive(key: str, cache: str) -> str:
    return os.path.join(cache, "images", f"ascendbind-{key}.tar")


def _base_image(cache: str) -> str:
    """The base as a docker-archive: buildah pulls it in about half the time that
    importing mmdebstrap's tar and committing it takes (6 to 8 s against 11 to 25 s here)."""
    return os.path.join(cache, f"base-{BASE_SUITE}-{base_key()}.tar")


# ------------------------------------------------------------------------ build

def _run(what: str, argv: list[str], log: str, *, tries: int = 1, env: dict | None = None) -> None:
    """Run one step, its output appended to ``log``; BuildError with the log's tail."""
    for attempt in range(1, tries + 1):
        with open(log, "a") as fh:
            fh.write(f"\n$ {' '.join(argv)}\n")
            fh.flush()
            rc = subprocess.run(argv, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=REPO).returncode
        if rc == 0:
            return
        if attempt == tries:
            with open(log, errors="replace") as fh:
                tail = "\n".join(fh.read().splitlines()[-25:])
            raise BuildError(f"kube image: {what} failed (exit {rc}, try {attempt} of {tries}); Debian's archive "
                             f"and PyPI must be reachable from this host (full log {log}):\n{tail}")


def _mmdebstrap(work: str, log: str) -> str:
    """The base's root file system as a tar in ``work``."""
    apt_clean = os.path.join(work, "docker-clean")
    with open(apt_clean, "w") as fh:
        fh.write(APT_CLEAN)
    out = os.path.join(work, "rootfs.tar")  # mmdebstrap writes a tar for a name ending in .tar
    argv = [a.replace("{apt_clean}", apt_clean) for a in _mmdebstrap_argv(out)]
    # mmdebstrap keeps its temporary chroot in TMPDIR: under the work folder, removed with it
    _run("mmdebstrap (the bookworm base)", argv, log, tries=TRIES, env={**os.environ, "TMPDIR": work})
    return out


# runs as the first process of a private mount namespace: /var/lib becomes an overlay
# whose writes land in a tmpfs, then the build steps run (``--inside``)
_PRIVATE_VARLIB = r"""
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
scratch = sys.argv[1]
def mount(src, dst, fs, opts):
    if libc.mount(src.encode(), dst.encode(), fs.encode(), 0, opts.encode()) != 0:
        sys.exit(f"kube image: mount {fs} on {dst}: errno {ctypes.get_errno()}")
mount("tmpfs", scratch, "tmpfs", "mode=0700")
os.mkdir(scratch + "/upper"); os.mkdir(scratch + "/work")
mount("overlay", "/var/lib", "overlay", f"lowerdir=/var/lib,upperdir={scratch}/upper,workdir={scratch}/work")
os.execv(sys.executable, [sys.executable, *sys.argv[2:]])
"""


def _inside(work: str, base_image: str, out: str, log: str) -> None:
    """The buildah steps (in the private namespace): the base (pulled from its archive,
    else imported from mmdebstrap's tar and saved as that archive), the build, the export."""
    os.environ["TMPDIR"] = os.path.join(work, "tmp")
    os.makedirs(os.environ["TMPDIR"], exist_ok=True)
    seconds = {}
    driver = os.environ.get("ASCENDBIND_KUBE_IMAGE_DRIVER", "overlay")
    bh = ["buildah", "--root", os.path.join(work, "storage"), "--runroot", os.path.join(work, "run")]
    t = time.monotonic()
    probe = subprocess.run([*bh, "--storage-driver", driver, "images"], capture_output=True, text=True)
    if probe.returncode != 0:  # e.g. a root file system that is itself an overlay
        with open(log, "a") as fh:
            fh.write(f"storage driver {driver} unusable here, using vfs:\n{probe.stderr}\n")
        driver = "vfs"
    bh += ["--storage-driver", driver]
    if os.path.exists(base_image):
        _run("buildah pull (the base's archive)", [*bh, "pull", "--quiet", f"docker-archive:{base_image}"], log)
    else:
        _import_base(bh, os.path.join(work, "rootfs.tar"), base_image, log)
    seconds["base_import"] = time.monotonic() - t
    t = time.monotonic()
    _run("buildah bud (deploy/kubernetes/Containerfile)",
         [*bh, "bud", "--isolation", "chroot", "--pull-never", "--build-arg", f"PYTHON_IMAGE={BASE_REF}",
          "-f", CONTAINERFILE, "-t", IMAGE_REF, "."], log, tries=TRIES)
    seconds["build"] = time.monotonic() - t
    t = time.monotonic()
    _run("buildah push (docker-archive)", [*bh, "push", "--quiet", IMAGE_REF, f"docker-archive:{out}:{IMAGE_REF}"], log)
    seconds["export"] = time.monotonic() - t
    print(json.dumps({"driver": driver, "seconds": seconds}))


def _import_base(bh: list[str], rootfs: str, base_image: str, log: str) -> None:
    ctr = subprocess.run([*bh, "from", "--pull-never", "scratch"], capture_output=True, text=True)
    if ctr.returncode != 0:
        raise BuildError(f"kube image: buildah from scratch failed (exit {ctr.returncode}): {ctr.stderr.strip()}")
    name = ctr.stdout.strip()
    _run("buildah add (the base)", [*bh, "add", "--quiet", name, rootfs, "/"], log)
    _run("buildah config (the base)", [*bh, "config", *[a for e in BASE_ENV for a in ("--env", e)],
                                       "--cmd", BASE_CMD, name], log)
    _run("buildah commit (the base)", [*bh, "commit", "--quiet", "--rm", name, BASE_REF], log)
    part = base_image + ".part"
    _run("buildah push (the base's archive)", [*bh, "push", "--quiet", BASE_REF, f"docker-archive:{part}:{BASE_REF}"],
         log)
    os.rename(part, base_image)


def _mounts_under(path: str) -> list[str]:
    with open("/proc/self/mountinfo") as fh:
        points = [line.split()[4] for line in fh]
    return [p for p in points if p == path or p.startswith(path.rstrip("/") + "/")]


def _build(key: str, cache: str, log_step) -> dict:
    started = time.monotonic()
    for stale in glob.glob(os.path.join(cache, "work-*")):  # a build killed half-way
        if not _mounts_under(stale):
            shutil.rmtree(stale, ignore_errors=True)
    work = tempfile.mkdtemp(prefix="work-", dir=cache)
    log = os.path.join(cache, "build.log")
    open(log, "w").close()
    seconds = {}
    try:
        base = _base_image(cache)
        if not os.path.exists(base):
            log_step("kube image: building the bookworm base with mmdebstrap")
            t = time.monotonic()
            _mmdebstrap(work, log)
            seconds["base"] = time.monotonic() - t
            for old in glob.glob(os.path.join(cache, "base-*.tar*")):
                os.unlink(old)
        os.makedirs(os.path.join(cache, "images"), exist_ok=True)
        out = _archive(key, cache)
        part = out + ".part"
        log_step("kube image: buildah bud deploy/kubernetes/Containerfile")
        scratch = os.path.join(work, "varlib")
        os.mkdir(scratch)
        r = subprocess.run(["unshare", "--mount", "--propagation", "private", "--", sys.executable, "-c",
                            _PRIVATE_VARLIB, scratch, os.path.abspath(__file__), "--inside", work, base, part, log],
                           capture_output=True, text=True, cwd=REPO)
        if r.returncode != 0:
            raise BuildError(r.stderr.strip() or f"kube image: the build exited {r.returncode} (log {log})")
        inside = json.loads(r.stdout.strip().splitlines()[-1])
        seconds.update(inside["seconds"])
        os.rename(part, out)
        meta = {"key": key, "archive": out, "ref": IMAGE_REF, "base": BASE_REF, "base_key": base_key(),
                "driver": inside["driver"], "seconds": {k: round(v, 1) for k, v in seconds.items()},
                "total_seconds": round(time.monotonic() - started, 1)}
        with open(out[:-len(".tar")] + ".json", "w") as fh:
            json.dump(meta, fh, indent=1)
        _prune(cache, keep=out)
        return meta
    finally:
        left = _mounts_under(work)
        if left:  # never delete under a mount: that would reach into what is mounted
            raise BuildError(f"kube image: mounts left under {work}: {left}")
        shutil.rmtree(work, ignore_errors=True)


def _prune(cache: str, keep: str, count: int = 3) -> None:
    """Keep the ``count`` archives used last (worktrees with other sources share the cache)."""
    tars = sorted(glob.glob(os.path.join(cache, "images", "ascendbind-*.tar")), key=os.path.getmtime, reverse=True)
    for old in [t for t in tars if t != keep][count - 1:]:
        for path in (old, old[:-len(".tar")] + ".json"):
            if os.path.exists(path):
                os.unlink(path)


def why_not() -> str | None:
    """None when the image can be built here, else what is missing."""
    missing = [f"{tool} ({pkg})" for tool, pkg in (("mmdebstrap", "mmdebstrap"), ("buildah", "buildah"),
                                                   ("unshare", "util-linux")) if shutil.which(tool) is None]
    return None if not missing else "cannot build the DaemonSet image: missing " + ", ".join(missing)


def prepare(cache: str = CACHE, log_step=lambda line: None) -> dict:
    """The image's record (``archive``, ``ref``, ``seconds``..., and ``reused``): the
    cached archive for the current sources, else a new build (a minute or two)."""
    key = image_key()
    os.makedirs(cache, exist_ok=True)
    with open(os.path.join(cache, ".lock"), "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log_step("kube image: waiting for another process's build")
            fcntl.flock(lock, fcntl.LOCK_EX)
        out = _archive(key, cache)
        meta_path = out[:-len(".tar")] + ".json"
        if os.path.exists(out) and os.path.exists(meta_path):
            os.utime(out)  # last used: what _prune keeps
            with open(meta_path) as fh:
                return {**json.load(fh), "reused": True}
        why = why_not()
        if why:
            raise BuildError(why)
        return {**_build(key, cache, log_step), "reused": False}


def daemon_image() -> tuple[str, str]:
    """(path of a docker-archive tar ``ctr images import`` takes, the image reference it
    holds), built from this checkout or reused from the cache."""
    meta = prepare(log_step=lambda line: print(line, file=sys.stderr))
    return meta["archive"], meta["ref"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prepare", action="store_true", help="build (or reuse) the image and say which")
    ap.add_argument("--inside", nargs=4, metavar=("WORK", "BASE", "OUT", "LOG"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.inside:
        try:
            _inside(*args.inside)
        except BuildError as exc:
            print(exc, file=sys.stderr)
            return 1
        return 0
    t = time.monotonic()
    try:
        meta = prepare(log_step=print)
    except BuildError as exc:
        print(exc, file=sys.stderr)
        return 1
    steps = ", ".join(f"{k} {v:.1f} s" for k, v in meta["seconds"].items())
    what = "reused" if meta["reused"] else f"built ({steps})"
    print(f"kube image: {what} {meta['ref']} {meta['archive']} in {time.monotonic() - t:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

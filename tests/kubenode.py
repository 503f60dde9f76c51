"""A real Kubernetes node for the tests: containerd + runc + a standalone kubelet 1.20.2 with
the static CPU manager, everything under one temporary directory, no registry, no API server.

Preparing (once per machine, cached)::

    python -m tests.kubenode --prepare     # prints what it built or reused, and the seconds

``prepare()`` builds kubelet v1.20.2 from Debian bookworm's ``kubernetes`` source package
(SOURCE_VERSION; its orig tarball carries ``vendor/``, so the build needs no network), fetched
with a private apt configuration: deb-src lines for the Debian mirrors this machine's own apt
sources name, lists, cache and state under the cache directory, ``/etc/apt`` untouched. The
vendored ``github.com/modern-go/reflect2`` 1.0.1 reads Go runtime internals that Go 1.18
changed (the build succeeds, the kubelet crashes); it is replaced by Debian's 1.0.2 source.
Kubernetes 1.20 predates its own module build, so it is compiled in GOPATH mode
(``GO111MODULE=off``, ``CGO_ENABLED=0``, ``GOPROXY=off``) with Debian's Go 1.19, stripped, with
the version stamped so ``kubelet --version`` says v1.20.2. The pause container is compiled from
the same tree (``build/pause/linux/pause.c``, ``gcc -static``); the pause and busybox images are
OCI archives written by tests/oci_archive.py. The result lives in
``~/.cache/ascendbind-kube/<key>/`` (``ASCENDBIND_KUBE_CACHE`` overrides the parent), the key being
the pinned ``.dsc`` hashes and RECIPE: a later run reads it and fetches and builds nothing. The
Go build cache and the unpacked tree (1.2 GB) are deleted after the build; an flock keeps two
test processes from building at once; each download is retried.

Running a node::

    with kube_node() as node:                         # or SharedNode().get() for a module's tests
        uid = node.add_pod(manifest)                  # -> str: the UID the kubelet gave the pod
        pid = node.wait_container("pinned", "work")   # -> int: host pid of the container's process
        node.checkpoint()                             # -> dict: cpu_manager_state, parsed
        node.cgroup_of(pid)                           # -> {"cpuset": "/kubepods/pod<uid>/<id>", ...}
        node.pod_status("pinned")                     # -> dict | None: the kubelet's status of the pod
        node.kill_container("pinned", "work")         # -> int: the pid it killed; the kubelet restarts it
        node.wait_container("pinned", "work", other_than=pid)
        node.restart_kubelet()                        # pods and their CPUs survive
        node.import_image("daemon.tar")               # -> list[str]: the references imported
        node.container_log("pinned", "work")          # -> str: its stdout/stderr, CRI's log format
        node.remove_pod("pinned")                     # its tasks gone and its checkpoint entry gone
        node.wait_for("what", check, timeout)         # check()'s first truthy value, else NodeError
        node.log()                                    # -> str: kubelet and containerd log tails

Node attributes: ``dir`` (the temp dir), ``node_name``, ``kubelet_root`` (kubelet's
``--root-dir``: ``cpu_manager_state`` is there), ``manifests`` (its ``staticPodPath``),
``socket`` (containerd's), ``kubelet_pid``, ``containerd_pid``, ``BUSYBOX`` / ``PAUSE`` (the
local image references); ``node.ctr(*args)`` runs ``ctr`` on this containerd in the CRI
namespace. A pod is named by its manifest's ``metadata.name``; the kubelet calls a static pod
``<name>-<node_name>``, which ``node.pod_name(name)`` gives. A static pod's UID is the
kubelet's hash of the manifest (32 hex digits) unless the manifest sets ``metadata.uid``
(kept as given, e.g. an API server's dashed UUID). Each wait polls with a deadline; a failure
(``NodeError``) carries the kubelet's and containerd's log tails.

The node's shape: containerd runs with its own root, state, socket and config in the temp dir
(``restrict_oom_score_adj``: without CAP_SYS_RESOURCE runc cannot give a container the negative
oom_score_adj the kubelet asks for; cgroupfs, not systemd; the sandbox image is the local pause;
CNI directories empty, so pods use ``hostNetwork``). The kubelet is standalone (``staticPodPath``,
``cpuManagerPolicy: static``, ``kubeReserved: {cpu: 500m}``, ``cgroupDriver: cgroupfs``, free ports
on 127.0.0.1 only, ``--root-dir`` in the temp dir). Its CPU manager writes each container's
cpuset again every ``cpuManagerReconcilePeriod`` (2 s here; 10 s is the default), as a
production kubelet does. At start it sets six sysctls
(SYSCTLS) that it considers required; it runs in a private mount namespace where each of those
``/proc/sys`` files is shadowed by a bind-mounted file already holding that value, so the host's
settings never change. (Mounts the kubelet makes would stay in its namespace, unseen by
containerd: secret and configMap volumes do not work here; emptyDir and hostPath do.)

Teardown stops the kubelet, kills and deletes every task, container and sandbox, stops
containerd (both by the pids it started, never by name), waits for the shims to exit, unmounts whatever remains under the temp
dir, removes the ``kubepods`` cgroups in every hierarchy, and removes what the kubelet 1.20 writes
outside its root (``/var/lib/kubelet/device-plugins``, ``/var/log/pods/<its pods>``,
``/var/log/containers/<its links>``) where they did not exist before. A node records its
owner and pids in ``<dir>/node.json``; a test process killed with its node up (a time limit)
leaves it running, and the next ``kube_node()`` on the machine tears it down first
(``reap_stale``: by those pids while their command lines name the node's dir). Nodes are serialised
machine-wide with ``tests.cpuset_cgroups.kubepods_lock()``: the kubelet's ``kubepods`` tree sits at
the top of each hierarchy, where other tests make fake ones.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import glob
import hashlib
import json
import os
import re
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from tests import oci_archive
from tests.cpuset_cgroups import kubepods_lock
from tests.daemon_harness import free_port

CACHE = os.environ.get("ASCENDBIND_KUBE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "ascendbind-kube")
SOURCE_PACKAGE = "kubernetes"
SOURCE_VERSION = "1.20.5+really1.20.2-1.1+deb12u1"
KUBE_VERSION = "v1.20.2"
# the .dsc of each pinned source package, as bookworm's signed Sources index lists it; the
# cache key, and checked against what apt fetched
SOURCE_DSC_SHA256 = "19fa1da5aefcef673894ac9511986bd98a14410cf8eea0b626613c30df435257"
REFLECT2_PACKAGE, REFLECT2_VERSION = "golang-github-modern-go-reflect2", "1.0.2-2"
REFLECT2_DSC_SHA256 = "cf4ba2c4e38fffda1f4cf666f9aa6284c398d153260be2b37f39bd5da468a590"
# bumped whenever the way the binaries are made changes: a new cache entry
RECIPE = 1
GO = "/usr/lib/go-1.19/bin/go"
BUSYBOX_BIN = "/bin/busybox"
PAUSE = "localhost/pause:local"
BUSYBOX = "localhost/busybox:local"
# the applets the busybox image links (sh for commands, the rest for what tests run in pods)
APPLETS = ("sh", "sleep", "cat", "grep", "ls", "echo", "true", "test", "head", "tail", "ps", "env", "kill")
# kubelet 1.20 writes each of these that differs at start (pkg/kubelet/cm/container_manager_linux.go,
# setupKernelTunables); the two keys limits already hold these values on most kernels
SYSCTLS = {"vm/overcommit_memory": "1", "vm/panic_on_oom": "0", "kernel/panic": "10", "kernel/panic_on_oops": "1",
           "kernel/keys/root_maxkeys": "1000000", "kernel/keys/root_maxbytes": "25000000"}
# what kubelet 1.20 writes outside its --root-dir (hard-coded paths)
DEVICE_PLUGINS = "/var/lib/kubelet/device-plugins"
POD_LOGS = "/var/log/pods"
CONTAINER_LOGS = "/var/log/containers"
# each download is tried this often, waiting RETRY_WAIT[i] seconds after try i
RETRY_WAIT = (5.0, 20.0)


class PrepareError(RuntimeError):
    """The kubelet or the images could not be made: what failed and the tool's last words."""


class NodeError(RuntimeError):
    """The node did not do what was waited for; the message ends with its log tails."""


def key() -> str:
    return f"kubelet-{SOURCE_DSC_SHA256[:12]}-{REFLECT2_DSC_SHA256[:8]}-r{RECIPE}"


def cache_dir(cache: str = CACHE) -> str:
    return os.path.join(cache, key())


@dataclass(frozen=True)
class Prepared:
    """What a node needs from the cache, and how it came to be there."""
    kubelet: str
    pause_archive: str
    busybox_archive: str
    built: bool                      # False: all read from the cache
    seconds: dict[str, float]        # step -> seconds spent now (fetch, build, images)


def tools_missing(building: bool = True) -> list[str]:
    """The tools (and their Debian packages) a node needs that are absent here."""
    need = [("containerd", "containerd"), ("containerd-shim-runc-v2", "containerd"), ("ctr", "containerd"),
            ("runc", "runc"), ("unshare", "util-linux"), ("mount", "mount"), ("umount", "mount")]
    if building:
        need += [("apt-get", "apt"), ("gcc", "gcc"), ("strip", "binutils")]
    missing = [f"{tool} ({pkg})" for tool, pkg in need if shutil.which(tool) is None]
    if building and not os.access(GO, os.X_OK):
        missing.append(f"{GO} (golang-1.19-go)")
    if not os.access(BUSYBOX_BIN, os.X_OK):
        missing.append(f"{BUSYBOX_BIN} (busybox-static)")
    return missing


def why_not() -> str | None:
    """None when a node can run here, else why not."""
    if os.geteuid() != 0:
        return "a kubelet node needs root"
    if not os.path.exists("/sys/fs/cgroup/cpuset/cpuset.cpus") and not os.path.exists("/sys/fs/cgroup/cgroup.controllers"):
        return "no cgroup hierarchy with a cpuset controller at /sys/fs/cgroup"
    if (os.cpu_count() or 1) < 2:
        return "the static CPU manager keeps CPU 0 for the system: a node needs 2 CPUs or more"
    missing = tools_missing(building=_cached() is None)
    return f"missing for a kubelet node: {', '.join(missing)}" if missing else None


def _run(argv: list[str], what: str, *, cwd: str | None = None, env: dict | None = None,
         timeout: float = 1800) -> str:
    r = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        tail = "\n".join((r.stderr or r.stdout).strip().splitlines()[-15:])
        raise PrepareError(f"{what} failed (exit {r.returncode}): {' '.join(argv[:6])}...\n{tail}")
    return r.stdout


def _fetch(argv: list[str], what: str, *, cwd: str, waits=RETRY_WAIT, log=print) -> None:
    """Run the download ``argv`` until it succeeds, ``len(waits) + 1`` tries at most."""
    for attempt in range(len(waits) + 1):
        try:
            _run(argv, what, cwd=cwd, timeout=900)
            return
        except (PrepareError, subprocess.TimeoutExpired) as exc:
            if attempt == len(waits):
                raise PrepareError(f"{what}: {attempt + 1} tries failed; the sources come from the Debian "
                                   f"mirrors in this machine's apt sources: is the network up?\n{exc}") from exc
            log(f"kubenode: {what} failed, try {attempt + 2} of {len(waits) + 1} in {waits[attempt]:g} s")
            time.sleep(waits[attempt])  # a back-off between downloads, not a wait for an event


# --- the private apt -------------------------------------------------------------------------

def debian_uris(etc_apt: str = "/etc/apt") -> tuple[str | None, str | None]:
    """The Debian archive and security mirrors this machine's apt sources name (deb822
    ``.sources`` or one-line ``.list``): (archive URI, security URI)."""
    entries: list[tuple[str, list[str]]] = []  # (uri, suites)
    for path in sorted(glob.glob(os.path.join(etc_apt, "sources.list.d", "*.sources"))):
        with open(path) as fh:
            for stanza in re.split(r"\n\s*\n", fh.read()):
                fields = dict(re.findall(r"^([A-Za-z-]+):\s*(.*)$", stanza, re.M))
                if "deb" in fields.get("Types", "").split() and fields.get("Enabled", "yes") != "no":
                    for uri in fields.get("URIs", "").split():
                        entries.append((uri, fields.get("Suites", "").split()))
    for path in [os.path.join(etc_apt, "sources.list"), *sorted(glob.glob(os.path.join(etc_apt, "sources.list.d", "*.list")))]:
        if os.path.exists(path):
            with open(path) as fh:
                for line in fh:
                    m = re.match(r"deb\s+(?:\[[^]]*\]\s+)?(\S+)\s+(\S+)", line)
                    if m:
                        entries.append((m.group(1), [m.group(2)]))
    archive = security = None
    for uri, suites in entries:
        if any(s.endswith("-security") or s.endswith("/updates") for s in suites):
            security = security or uri
        elif any(s.split("-")[0] in _DEBIAN_SUITES for s in suites):
            archive = archive or uri
    return archive, security


_DEBIAN_SUITES = {"bookworm", "trixie", "forky", "sid", "bullseye", "stable", "testing", "unstable", "oldstable"}


def _apt_setup(apt: str, log) -> list[str]:
    archive, security = debian_uris()
    if archive is None:
        raise PrepareError("no Debian mirror in this machine's apt sources (/etc/apt): the kubelet source "
                           "package comes from Debian bookworm's")
    for d in ("lists/partial", "cache/archives/partial", "parts", "prefs"):
        os.makedirs(os.path.join(apt, d), exist_ok=True)
    keyring = "/usr/share/keyrings/debian-archive-keyring.gpg"
    signed = f"[signed-by={keyring}] " if os.path.exists(keyring) else ""
    lines = [f"deb-src {signed}{archive} bookworm main\n"]
    if security:
        lines.append(f"deb-src {signed}{security} bookworm-security main\n")
    with open(os.path.join(apt, "sources.list"), "w") as fh:
        fh.writelines(lines)
    opts = [f"-oDir::Etc::SourceList={apt}/sources.list", f"-oDir::Etc::SourceParts={apt}/parts",
            f"-oDir::Etc::PreferencesParts={apt}/prefs", f"-oDir::State={apt}",
            f"-oDir::State::Lists={apt}/lists", f"-oDir::Cache={apt}/cache", "-oAPT::Update::Error-Mode=any"]
    _fetch(["nice", "-n", "19", "apt-get", *opts, "-qq", "update"], "apt-get update (bookworm sources)", cwd=apt, log=log)
    return opts


def _download_source(opts: list[str], package: str, version: str, dsc_sha256: str, into: str, log) -> str:
    """The source package's files under ``into``; returns the path of its orig tarball."""
    os.makedirs(into, exist_ok=True)
    _fetch(["nice", "-n", "19", "apt-get", *opts, "-qq", "source", "--download-only", f"{package}={version}"],
           f"apt-get source {package}={version}", cwd=into, log=log)
    dsc = os.path.join(into, f"{package}_{version.split(':')[-1]}.dsc")
    with open(dsc, "rb") as fh:
        got = hashlib.sha256(fh.read()).hexdigest()
    if got != dsc_sha256:
        raise PrepareError(f"{os.path.basename(dsc)} has sha256 {got}, the recipe pins {dsc_sha256}")
    origs = glob.glob(os.path.join(into, f"{package}_*.orig.tar.*"))
    if len(origs) != 1:
        raise PrepareError(f"expected one orig tarball of {package} in {into}, found {origs}")
    return origs[0]


# --- the build -------------------------------------------------------------------------------

def _unpack(tarball: str, into: str) -> str:
    """Unpack ``tarball`` under ``into``; returns its single top directory."""
    os.makedirs(into, exist_ok=True)
    _run(["nice", "-n", "19", "tar", "xf", tarball, "-C", into], f"unpacking {os.path.basename(tarball)}")
    tops = os.listdir(into)
    if len(tops) != 1:
        raise PrepareError(f"{tarball} unpacked to {len(tops)} top entries, expected one")
    return os.path.join(into, tops[0])


def _swap_reflect2(tree: str, reflect2_tree: str) -> None:
    vendored = os.path.join(tree, "vendor", "github.com", "modern-go", "reflect2")
    if not os.path.isdir(vendored):
        raise PrepareError(f"no vendored reflect2 at {vendored}: not the tree the recipe expects")
    for name in os.listdir(vendored):
        if name.endswith((".go", ".s")):
            os.unlink(os.path.join(vendored, name))
    for name in os.listdir(reflect2_tree):
        if name.endswith((".go", ".s")) and not name.endswith("_test.go"):
            shutil.copy(os.path.join(reflect2_tree, name), vendored)


def _go_build(work: str, tree: str, out: str) -> None:
    gopath = os.path.join(work, "gopath")
    pkg = os.path.join(gopath, "src", "k8s.io", "kubernetes")
    os.makedirs(os.path.dirname(pkg), exist_ok=True)
    os.rename(tree, pkg)  # GOPATH mode: the import path is the directory
    stamp = "k8s.io/kubernetes/vendor/k8s.io/component-base/version"
    major, minor = KUBE_VERSION[1:].split(".")[:2]
    ldflags = (f"-s -w -X {stamp}.gitVersion={KUBE_VERSION} -X {stamp}.gitMajor={major} "
               f"-X {stamp}.gitMinor={minor} -X {stamp}.gitTreeState=clean")
    env = {"PATH": f"{os.path.dirname(GO)}:/usr/bin:/bin", "HOME": work, "GOPATH": gopath, "PWD": pkg,
           "GOCACHE": os.path.join(work, "gocache"), "GO111MODULE": "off", "CGO_ENABLED": "0",
           "GOPROXY": "off", "GOFLAGS": "", "TMPDIR": work}
    _run(["nice", "-n", "19", GO, "build", "-ldflags", ldflags, "-o", out, "./cmd/kubelet"],
         "go build ./cmd/kubelet", cwd=pkg, env=env, timeout=3600)


def _images(dest: str, pause_bin: str) -> tuple[str, str, bool]:
    """The pause and busybox archives under ``dest`` (busybox's rewritten when the host's
    busybox changed); returns their paths and whether one was written."""
    with open(BUSYBOX_BIN, "rb") as fh:
        busybox = fh.read()
    wrote = False
    pause_tar = os.path.join(dest, "pause.tar")
    if not os.path.exists(pause_tar):
        with open(pause_bin, "rb") as fh:
            oci_archive.write_image(pause_tar, PAUSE, {"pause": fh.read()}, entrypoint=["/pause"])
        wrote = True
    busybox_tar = os.path.join(dest, f"busybox-{hashlib.sha256(busybox).hexdigest()[:12]}.tar")
    if not os.path.exists(busybox_tar):
        for old in glob.glob(os.path.join(dest, "busybox-*.tar")):
            os.unlink(old)
        files: dict[str, bytes | oci_archive.Link] = {"bin/busybox": busybox}
        files.update({f"bin/{a}": oci_archive.Link("busybox") for a in APPLETS})
        oci_archive.write_image(busybox_tar, BUSYBOX, files, entrypoint=["/bin/sh"])
        wrote = True
    return pause_tar, busybox_tar, wrote


def _cached(cache: str = CACHE) -> dict | None:
    """The built kubelet's manifest, None when no build finished (the manifest is its last write)."""
    try:
        with open(os.path.join(cache_dir(cache), "manifest.json")) as fh:
            return json.load(fh)
    except FileNotFoundError:
        return None


def _build(cache: str, log) -> dict[str, float]:
    missing = tools_missing()
    if missing:
        raise PrepareError(f"cannot build the kubelet: missing {', '.join(missing)}")
    dest = cache_dir(cache)
    work = os.path.join(cache, "work")
    shutil.rmtree(work, ignore_errors=True)  # a build interrupted earlier
    os.makedirs(os.path.join(dest, "bin"), exist_ok=True)
    seconds = {}
    try:
        t = time.monotonic()
        opts = _apt_setup(os.path.join(cache, "apt"), log)
        orig = _download_source(opts, SOURCE_PACKAGE, SOURCE_VERSION, SOURCE_DSC_SHA256, os.path.join(work, "dl"), log)
        r2_orig = _download_source(opts, REFLECT2_PACKAGE, REFLECT2_VERSION, REFLECT2_DSC_SHA256,
                                   os.path.join(work, "dl-reflect2"), log)
        seconds["fetch"] = time.monotonic() - t
        log(f"kubenode: sources fetched in {seconds['fetch']:.0f} s; building kubelet {KUBE_VERSION} (niced)")
        t = time.monotonic()
        tree = _unpack(orig, os.path.join(work, "src"))
        _swap_reflect2(tree, _unpack(r2_orig, os.path.join(work, "src-reflect2")))
        pause_c = os.path.join(tree, "build", "pause", "linux", "pause.c")
        pause = os.path.join(dest, "bin", "pause")
        _run(["nice", "-n", "19", "gcc", "-Os", "-static", "-o", pause, pause_c], "gcc -static pause.c")
        _run(["strip", pause], "strip pause")
        kubelet = os.path.join(dest, "bin", "kubelet")
        _go_build(work, tree, kubelet + ".part")
        os.replace(kubelet + ".part", kubelet)
        version = _run([kubelet, "--version"], "kubelet --version").strip()
        if KUBE_VERSION not in version:
            raise PrepareError(f"the kubelet built says {version!r}, expected {KUBE_VERSION}")
        seconds["build"] = time.monotonic() - t
    finally:
        shutil.rmtree(work, ignore_errors=True)  # the tree and the Go cache: 1.2 GB
    with open(os.path.join(dest, "manifest.json"), "w") as fh:
        json.dump({"kubelet": version, "source": f"{SOURCE_PACKAGE} {SOURCE_VERSION}", "seconds": seconds}, fh)
    for old in glob.glob(os.path.join(cache, "kubelet-*")):
        if old != dest:
            shutil.rmtree(old, ignore_errors=True)
    return seconds


def prepare(cache: str = CACHE, log: Callable[[str], None] = print) -> Prepared:
    """The kubelet and the two image archives, built (once, under a lock) or read from the cache."""
    os.makedirs(cache, exist_ok=True)
    with open(os.path.join(cache, "build.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second test process waits for the first one's build
        seconds: dict[str, float] = {}
        built = _cached(cache) is None
        if built:
            seconds.update(_build(cache, log))
        dest = cache_dir(cache)
        t = time.monotonic()
        pause_tar, busybox_tar, wrote = _images(dest, os.path.join(dest, "bin", "pause"))
        if wrote:
            seconds["images"] = time.monotonic() - t
        return Prepared(os.path.join(dest, "bin", "kubelet"), pause_tar, busybox_tar, built, seconds)


# --- the node --------------------------------------------------------------------------------

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NODE_PREFIX = os.path.join(tempfile.gettempdir(), "ascendbind-kube-")
CGROUP_ROOT = "/sys/fs/cgroup"
# the host-side directories containerd's shims and kubelet 1.20 may create outside our temp dir
OUTSIDE = (DEVICE_PLUGINS, os.path.dirname(DEVICE_PLUGINS), POD_LOGS, CONTAINER_LOGS, "/run/containerd/s", "/run/containerd")
_CONTAINERD_CONFIG = """\
version = 2
root = "{d}/containerd/root"
state = "{d}/containerd/state"
[grpc]
  address = "{d}/containerd/containerd.sock"
[ttrpc]
  address = "{d}/containerd/containerd.sock.ttrpc"
[plugins."io.containerd.internal.v1.opt"]
  path = "{d}/containerd/opt"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{pause}"
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  # no CAP_SYS_RESOURCE on such machines: runc cannot set the negative oom_score_adj the
  # kubelet asks for (-998 for a sandbox, -997 for a Guaranteed container); this caps it at ours
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
        Root = "{d}/containerd/runc"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{d}/containerd/cni-bin"
    conf_dir = "{d}/containerd/cni-conf"
"""


def _kubepods() -> list[str]:
    """Every ``kubepods*`` cgroup directory at the top of a hierarchy (v1 controllers, the
    named systemd one, v2's unified)."""
    found = glob.glob(os.path.join(CGROUP_ROOT, "*", "kubepods*")) + glob.glob(os.path.join(CGROUP_ROOT, "kubepods*"))
    return sorted(p for p in found if os.path.isdir(p))


def _tail(path: str, lines: int) -> str:
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - 200 * lines))
            text = fh.read().decode(errors="replace")
    except OSError as exc:
        return f"({exc})"
    return "\n".join(text.splitlines()[-lines:])


class Node:
    """A running containerd + kubelet pair; see the module docstring. Made by kube_node()."""

    _count = 0

    def __init__(self, prepared: Prepared | None, node_dir: str | None = None, record: dict | None = None):
        Node._count += 1
        self.prepared = prepared
        self.dir = node_dir or tempfile.mkdtemp(prefix=NODE_PREFIX)
        os.chmod(self.dir, 0o755)
        self.node_name = record["node_name"] if record else f"abnode-{os.getpid()}-{Node._count}"
        self.kubelet_root = os.path.join(self.dir, "kubelet")
        self.labels: dict[str, str] = {}
        self.manifests = os.path.join(self.dir, "manifests")
        self.socket = os.path.join(self.dir, "containerd", "containerd.sock")
        self.kubelet_log = os.path.join(self.dir, "kubelet.log")
        self.containerd_log = os.path.join(self.dir, "containerd.log")
        self.healthz_port = self.kubelet_port = 0
        self._kubelet: subprocess.Popen | None = None
        self._containerd: subprocess.Popen | None = None
        self._existed = record["existed"] if record else {p: os.path.lexists(p) for p in OUTSIDE}
        self._uids: dict[str, str] = {}
        self.BUSYBOX, self.PAUSE = BUSYBOX, PAUSE
        if record:  # a node whose test process died: its processes, by pid, while they are its own
            self._kubelet = _Orphan(record["kubelet"], self.dir) if record.get("kubelet") else None
            self._containerd = _Orphan(record["containerd"], self.dir) if record.get("containerd") else None
        else:
            self._record()

    def _record(self) -> None:
        """``node.json`` in the node's dir: enough for another process to tear the node down
        should this one die first (reap_stale)."""
        record = {"owner": os.getpid(), "owner_start": _start_time(os.getpid()), "node_name": self.node_name,
                  "existed": self._existed, "kubelet": self.kubelet_pid, "containerd": self.containerd_pid}
        with open(os.path.join(self.dir, "node.json.part"), "w") as fh:
            json.dump(record, fh)
        os.replace(os.path.join(self.dir, "node.json.part"), os.path.join(self.dir, "node.json"))

    @property
    def kubelet_pid(self) -> int | None:
        return self._kubelet.pid if self._kubelet else None

    @property
    def containerd_pid(self) -> int | None:
        return self._containerd.pid if self._containerd else None

    # -- logs and waits ------------------------------------------------------------------------

    def log(self, lines: int = 40) -> str:
        """The last lines of the kubelet's and containerd's logs."""
        return (f"--- kubelet log ({self.kubelet_log}), last {lines} lines:\n{_tail(self.kubelet_log, lines)}\n"
                f"--- containerd log ({self.containerd_log}), last {lines} lines:\n{_tail(self.containerd_log, lines)}")

    def _fail(self, what: str) -> NodeError:
        return NodeError(f"{what}\n{self.log()}")

    def _alive(self) -> None:
        for name, proc in (("containerd", self._containerd), ("kubelet", self._kubelet)):
            if proc is not None and proc.poll() is not None:
                raise self._fail(f"{name} (pid {proc.pid}) exited with {proc.returncode}")

    def wait_for(self, what: str, check: Callable[[], object], timeout: float, interval: float = 0.2):
        """``check()``'s first truthy result, polled until ``timeout`` s have passed."""
        deadline = time.monotonic() + timeout
        while True:
            self._alive()
            got = check()
            if got:
                return got
            if time.monotonic() > deadline:
                raise self._fail(f"{what}: not within {timeout:g} s")
            time.sleep(interval)  # the poll's period

    # -- containerd ------------------------------------------------------------------------------

    def ctr(self, *args: str, check: bool = True, timeout: float = 60) -> str:
        """``ctr`` against this node's containerd, in the CRI namespace (k8s.io)."""
        r = subprocess.run(["ctr", "--address", self.socket, "--namespace", "k8s.io", *args],
                           capture_output=True, text=True, timeout=timeout)
        if check and r.returncode != 0:
            raise self._fail(f"ctr {' '.join(args)} failed (exit {r.returncode}): {r.stderr.strip()}")
        return r.stdout

    def import_image(self, path: str) -> list[str]:
        """Import an image archive (OCI layout or ``docker save``) for the kubelet's pods; returns
        the references imported. A pod uses one with ``imagePullPolicy: Never``."""
        out = self.ctr("images", "import", path, timeout=300)
        refs = re.findall(r"^unpacking (\S+) \(", out, re.M)
        if not refs:
            raise self._fail(f"ctr images import {path} imported nothing: {out.strip()!r}")
        return refs

    def _tasks(self) -> dict[str, tuple[int, str]]:
        """container id -> (host pid, status) of every task."""
        tasks = {}
        for line in self.ctr("tasks", "ls").splitlines()[1:]:
            fields = line.split()
            if len(fields) >= 3:
                tasks[fields[0]] = (int(fields[1]), fields[2])
        return tasks

    def _containers(self, pod: str, container: str | None = None) -> list[str]:
        """Ids of the pod's containers named ``container``; None: its sandboxes; "*": all of them,
        sandboxes included (CRI labels each with the pod's and the container's name)."""
        filters = [f'labels."io.kubernetes.pod.name"=={self.pod_name(pod)}']
        if container is None:
            filters.append('labels."io.cri-containerd.kind"==sandbox')
        elif container != "*":
            filters.append(f'labels."io.kubernetes.container.name"=={container}')
        return self.ctr("containers", "ls", "--quiet", ",".join(filters)).split()

    def _labels(self, cid: str) -> dict[str, str]:
        return json.loads(self.ctr("containers", "info", cid)).get("Labels") or {}

    def _running(self, pod: str, container: str | None) -> list[tuple[str, int]]:
        tasks = self._tasks()
        return [(cid, tasks[cid][0]) for cid in self._containers(pod, container)
                if cid in tasks and tasks[cid][1] == "RUNNING"]

    # -- pods --------------------------------------------------------------------------------

    def pod_name(self, name: str) -> str:
        """The name the kubelet gives the static pod of manifest name ``name``."""
        return f"{name}-{self.node_name}"

    def write_manifest(self, manifest: dict) -> str:
        """Put ``manifest`` (a Pod) in the static pod directory, atomically; returns its path."""
        name = manifest["metadata"]["name"]
        path = os.path.join(self.manifests, f"{name}.json")
        tmp = os.path.join(self.manifests, f".{name}.tmp")  # the kubelet skips dot files
        with open(tmp, "w") as fh:
            json.dump(manifest, fh)
        os.replace(tmp, path)
        return path

    def add_pod(self, manifest: dict, timeout: float = 120) -> str:
        """Start the static pod ``manifest``; waits for its sandbox to run and returns the pod
        UID the kubelet uses (its ``metadata.uid`` if set, else the kubelet's hash)."""
        name = manifest["metadata"]["name"]
        self.write_manifest(manifest)

        def running() -> str | None:
            rejected = self._rejected(name)
            if rejected:  # the kubelet's admission said no (a nodeSelector, more CPU than allocatable)
                raise self._fail(f"the kubelet rejected pod {name}: {rejected}")
            return self._uid(name)
        self._uids[name] = self.wait_for(f"pod {name}'s sandbox running", running, timeout)
        return self._uids[name]

    def _pods(self) -> list[dict]:
        ctx = ssl.create_default_context()
        ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE  # its own self-signed certificate
        with urllib.request.urlopen(f"https://127.0.0.1:{self.kubelet_port}/pods", timeout=10, context=ctx) as r:
            return json.load(r).get("items") or []

    def _rejected(self, name: str) -> str | None:
        """Why the kubelet failed the pod at admission (status phase Failed), else None."""
        try:
            pods = self._pods()
        except OSError:
            return None
        for pod in pods:
            status = pod.get("status") or {}
            if pod["metadata"]["name"] == self.pod_name(name) and status.get("phase") == "Failed":
                return f"{status.get('reason')}: {status.get('message')}"
        return None

    def _uid(self, name: str) -> str | None:
        """The UID on the pod's running sandbox (CRI's io.kubernetes.pod.uid label)."""
        for cid, _pid in self._running(name, None):
            return self._labels(cid).get("io.kubernetes.pod.uid")
        return None

    def remove_pod(self, name: str, timeout: float = 120) -> None:
        """Remove the static pod ``name``; waits until none of its containers has a task left
        running and its UID has left the CPU manager's checkpoint. (The stopped containers'
        records go at the kubelet's next container GC, or at teardown.)"""
        path = os.path.join(self.manifests, f"{name}.json")
        if not os.path.exists(path):
            raise NodeError(f"no pod {name} on this node ({path} does not exist)")
        uid = self._uids.pop(name, None) or self._uid(name)  # a pod started by write_manifest
        os.unlink(path)
        self.wait_for(f"pod {name}'s containers gone", lambda: not self._running(name, "*"), timeout)
        if uid is not None:
            self.wait_for(f"pod {name} (uid {uid}) gone from the checkpoint",
                       lambda: uid not in (self.checkpoint().get("entries") or {}), timeout)

    def wait_container(self, pod: str, container: str, timeout: float = 120, other_than: int | None = None) -> int:
        """The host pid of the main process of ``container`` in pod ``pod`` (manifest name), once
        it runs; ``other_than``: a pid to wait past (a container restarted)."""
        def pid() -> int | None:
            running = [p for _cid, p in self._running(pod, container) if p != other_than]
            return running[0] if len(running) == 1 else None
        return self.wait_for(f"container {container} of pod {pod} running", pid, timeout)

    def kill_container(self, pod: str, container: str) -> int:
        """SIGKILL the container's main process (the kubelet then restarts it); returns its pid."""
        pid = self.wait_container(pod, container, timeout=10)
        os.kill(pid, signal.SIGKILL)
        return pid

    def checkpoint(self) -> dict:
        """The CPU manager's state file (``policyName``, ``defaultCpuSet``, ``entries``: pod UID
        -> container name -> cpulist), parsed; {} before the kubelet wrote it."""
        try:
            with open(os.path.join(self.kubelet_root, "cpu_manager_state")) as fh:
                return json.load(fh)
        except (OSError, ValueError):
            return {}

    def pod_status(self, name: str) -> dict | None:
        """The static pod's status as this kubelet last computed it (``containerStatuses``:
        ``containerID``, ``restartCount``, ``state``...), read from its ``/pods`` endpoint (a
        standalone kubelet reports its static pods' status there); None before its first sync."""
        for pod in self._pods():
            if pod["metadata"]["name"] == self.pod_name(name):
                status = pod.get("status") or {}
                return status if status.get("containerStatuses") else None
        return None

    def container_log(self, pod: str, container: str) -> str:
        """What the container's latest run wrote (stdout and stderr, as CRI logs them: each line
        prefixed with a timestamp, the stream and a tag); "" before it wrote anything."""
        runs = glob.glob(os.path.join(POD_LOGS, f"*_{self.pod_name(pod)}_*", container, "*.log"))
        if not runs:
            return ""
        with open(max(runs, key=os.path.getmtime), errors="replace") as fh:
            return fh.read()

    @staticmethod
    def cgroup_of(pid: int) -> dict[str, str]:
        """``/proc/<pid>/cgroup`` as controller -> path ("" for the v2 hierarchy,
        ``name=systemd`` for the named one)."""
        out = {}
        with open(f"/proc/{pid}/cgroup") as fh:
            for line in fh:
                _id, controllers, path = line.rstrip("\n").split(":", 2)
                for c in controllers.split(",") if controllers else [""]:
                    out[c] = path
        return out

    # -- start and stop ------------------------------------------------------------------------

    def _start(self) -> None:
        left = _kubepods()
        if left:
            raise NodeError(f"kubepods cgroups exist already ({', '.join(left)}): another kubelet, or a run "
                            "that was killed before its teardown; remove them (they must be empty) first")
        for d in ("containerd/cni-bin", "containerd/cni-conf", "kubelet", "manifests", "pki"):
            os.makedirs(os.path.join(self.dir, d), exist_ok=True)
        self._start_containerd()
        for archive in (self.prepared.pause_archive, self.prepared.busybox_archive):
            self.import_image(archive)
        self._write_kubelet_config()
        self._start_kubelet()

    def _spawn(self, argv: list[str], logfile: str) -> subprocess.Popen:
        with open(logfile, "ab") as fh:
            return subprocess.Popen(["nice", "-n", "10", *argv], stdin=subprocess.DEVNULL, stdout=fh,
                                    stderr=subprocess.STDOUT, start_new_session=True, cwd=self.dir)

    def _start_containerd(self) -> None:
        config = os.path.join(self.dir, "containerd", "config.toml")
        if not os.path.exists(config):
            with open(config, "w") as fh:
                fh.write(_CONTAINERD_CONFIG.format(d=self.dir, pause=PAUSE))
        self._containerd = self._spawn(["containerd", "--config", config], self.containerd_log)
        self._record()

        def up() -> bool:
            return os.path.exists(self.socket) and subprocess.run(
                ["ctr", "--address", self.socket, "version"], capture_output=True, timeout=30).returncode == 0
        self.wait_for("containerd answering on its socket", up, 60)

    def _write_kubelet_config(self) -> None:
        self.kubelet_port, self.healthz_port = free_port(), free_port()
        config = {
            "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
            "staticPodPath": self.manifests, "fileCheckFrequency": "1s", "syncFrequency": "5s",
            "cgroupDriver": "cgroupfs", "cpuManagerPolicy": "static", "cpuManagerReconcilePeriod": "2s",
            # half a CPU for the system: the static policy keeps CPU 0 (the ceiling, the lowest CPU)
            # out of exclusive sets, and 1.5 CPUs stay allocatable, so a pod of one whole CPU fits
            # beside the ascendbind DaemonSet's 50m (reservedSystemCPUs "0" would leave only 1)
            "kubeReserved": {"cpu": "500m"}, "makeIPTablesUtilChains": False, "failSwapOn": False,
            "address": "127.0.0.1", "port": self.kubelet_port, "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1", "healthzPort": self.healthz_port,
            "authentication": {"anonymous": {"enabled": True}, "webhook": {"enabled": False}},
            "authorization": {"mode": "AlwaysAllow"},
            # a shared test machine's disk may be fuller than the defaults allow
            "evictionHard": {"memory.available": "100Mi", "nodefs.available": "1%", "imagefs.available": "1%"},
            "imageGCHighThresholdPercent": 99, "imageGCLowThresholdPercent": 98,
        }
        with open(os.path.join(self.dir, "kubelet-config.json"), "w") as fh:
            json.dump(config, fh, indent=1)

    def _start_kubelet(self, timeout: float = 120) -> None:
        argv = [self.prepared.kubelet, f"--config={self.dir}/kubelet-config.json", "--container-runtime=remote",
                f"--container-runtime-endpoint=unix://{self.socket}", f"--root-dir={self.kubelet_root}",
                f"--cert-dir={self.dir}/pki", f"--hostname-override={self.node_name}",
                f"--pod-infra-container-image={PAUSE}", "--v=2"]
        if self.labels:  # what a manifest's nodeSelector is checked against (kubelet admission)
            argv.append("--node-labels=" + ",".join(f"{k}={v}" for k, v in sorted(self.labels.items())))
        wrapper = ["unshare", "--mount", "--propagation", "private", "env", f"PYTHONPATH={REPO}",
                   sys.executable, "-m", "tests.kubenode", "--exec-kubelet", os.path.join(self.dir, "sysctl"), *argv]
        self._kubelet = self._spawn(wrapper, self.kubelet_log)
        self._record()

        def healthy() -> bool:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.healthz_port}/healthz", timeout=5) as r:
                    ok = r.read() == b"ok"
            except OSError:
                return False
            return ok and self.checkpoint().get("policyName") == "static"
        self.wait_for("kubelet healthy with the static CPU manager", healthy, timeout, interval=0.5)

    def _stop(self, proc: subprocess.Popen | None, name: str, errors: list[str]) -> None:
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            errors.append(f"{name} (pid {proc.pid}) ignored SIGTERM for 30 s: killed")
            proc.kill()
            proc.wait(30)

    def restart_kubelet(self, timeout: float = 120) -> None:
        """Stop the kubelet (SIGTERM; its pods keep running in containerd) and start a new one
        on the same root dir; returns once it is healthy."""
        errors: list[str] = []
        self._stop(self._kubelet, "kubelet", errors)
        self._kubelet = None
        if errors:
            raise self._fail("; ".join(errors))
        self._start_kubelet(timeout)

    def _teardown(self) -> list[str]:
        """Leave the machine as found; returns what could not be undone (each a sentence)."""
        errors: list[str] = []
        self._stop(self._kubelet, "kubelet", errors)
        if isinstance(self._containerd, _Orphan) and self._containerd.poll() is not None:
            # its shims outlive it: a containerd on the same root and state finds them again
            with contextlib.suppress(NodeError):
                self._start_containerd()
        if self._containerd is not None and self._containerd.poll() is None:
            self._remove_containers(errors)
        self._stop(self._containerd, "containerd", errors)
        self._wait_shims(errors)
        self._unmount(errors)
        self._remove_cgroups(errors)
        self._remove_outside(errors)
        shutil.rmtree(self.dir, onerror=lambda _f, path, exc: errors.append(f"cannot remove {path}: {exc[1]}"))
        return errors

    def _remove_containers(self, errors: list[str]) -> None:
        """Every task (SIGKILL) and container, sandboxes included: the shims exit with them."""
        try:
            for cid in self._tasks():
                self.ctr("tasks", "delete", "--force", cid, check=False)
            for cid in self.ctr("containers", "ls", "--quiet").split():
                self.ctr("containers", "delete", cid, check=False)
            left = self.ctr("containers", "ls", "--quiet").split()
            if left:
                errors.append(f"containerd kept {len(left)} containers: {left}")
        except (NodeError, subprocess.TimeoutExpired) as exc:
            errors.append(f"removing the containers failed: {exc}")

    def _shims(self) -> list[int]:
        """Pids of the shims serving this node's containerd (their argv names its socket)."""
        pids = []
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    with open(f"/proc/{entry}/cmdline", "rb") as fh:
                        argv = fh.read().split(b"\0")
                except OSError:
                    continue
                if b"containerd-shim" in argv[0] and self.socket.encode() in argv:
                    pids.append(int(entry))
        return pids

    def _wait_shims(self, errors: list[str]) -> None:
        deadline = time.monotonic() + 20
        while self._shims() and time.monotonic() < deadline:
            time.sleep(0.2)  # the poll's period: shims exit once their last task is deleted
        for pid in self._shims():
            errors.append(f"shim pid {pid} of this node outlived its tasks: killed")
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def _unmount(self, errors: list[str]) -> None:
        """Whatever containerd left mounted under the temp dir (rootfs overlays, sandbox shm)."""
        with open("/proc/self/mountinfo") as fh:
            points = [line.split()[4] for line in fh]
        ours = [p for p in points if p == self.dir or p.startswith(self.dir + "/")]
        for point in reversed(ours):
            if subprocess.run(["umount", point], capture_output=True).returncode != 0:
                r = subprocess.run(["umount", "--lazy", point], capture_output=True, text=True)
                if r.returncode != 0:
                    errors.append(f"cannot unmount {point}: {r.stderr.strip()}")

    def _remove_cgroups(self, errors: list[str]) -> None:
        """The kubelet's kubepods trees, leaf first, in every hierarchy; a cgroup whose last
        process just died may be busy for a moment."""
        deadline = time.monotonic() + 20
        while True:
            busy = []
            for top in _kubepods():
                for path, _dirs, _files in sorted(os.walk(top), key=lambda w: -w[0].count("/")):
                    try:
                        os.rmdir(path)
                    except OSError as exc:
                        busy.append(f"{path}: {exc.strerror}")
            if not busy or time.monotonic() > deadline:
                break
            time.sleep(0.2)  # the poll's period
        if busy:
            errors.append(f"kubepods cgroups left: {busy[:5]}")

    def _remove_outside(self, errors: list[str]) -> None:
        """What the kubelet wrote outside its root dir, only where nothing was there before."""
        pods = glob.glob(os.path.join(POD_LOGS, f"*_*-{self.node_name}_*"))
        links = glob.glob(os.path.join(CONTAINER_LOGS, f"*-{self.node_name}_*.log"))
        for path in pods:
            shutil.rmtree(path, ignore_errors=True)
        for path in links:
            if os.path.islink(path):
                os.unlink(path)
        if not self._existed[DEVICE_PLUGINS]:
            shutil.rmtree(DEVICE_PLUGINS, ignore_errors=True)
        for path in (os.path.dirname(DEVICE_PLUGINS), POD_LOGS, CONTAINER_LOGS, "/run/containerd/s", "/run/containerd"):
            if not self._existed[path] and os.path.isdir(path):
                try:
                    os.rmdir(path)
                except OSError as exc:
                    errors.append(f"{path} did not exist before this node and is not empty now: {exc.strerror}")


class _Orphan:
    """A process started by a node whose test process died (init is its parent now): what the
    teardown uses of Popen, by pid, for as long as its command line names the node's dir (a pid
    used again by another program is left alone)."""

    def __init__(self, pid: int, node_dir: str):
        self.pid, self._dir, self.returncode = pid, node_dir.encode(), None

    def poll(self) -> int | None:
        try:
            with open(f"/proc/{self.pid}/cmdline", "rb") as fh:
                ours = self._dir in fh.read()  # a zombie's is empty
        except OSError:
            ours = False
        if not ours:
            self.returncode = 0
        return None if ours else 0

    def _signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self._signal(signal.SIGTERM)

    def kill(self) -> None:
        self._signal(signal.SIGKILL)

    def wait(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while self.poll() is None:
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout)
            time.sleep(0.1)  # the poll's period: init, not us, reaps it
        return 0


def _start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (with the pid: one process ever)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return int(fh.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def reap_stale(log: Callable[[str], None] = print) -> list[str]:
    """Tear down the nodes whose test process died before their teardown (a run killed at a
    time limit): their kubelet, containerd, shims, containers, cgroups and files. Called with
    ``kubepods_lock()`` held (kube_node does). Returns the node dirs it tore down."""
    reaped = []
    for path in glob.glob(os.path.join(os.path.dirname(NODE_PREFIX), os.path.basename(NODE_PREFIX) + "*", "node.json")):
        try:
            with open(path) as fh:
                record = json.load(fh)
        except (OSError, ValueError):
            continue
        if _start_time(record["owner"]) == record["owner_start"]:
            continue  # its test process is alive: its node is its own business
        node = Node(None, os.path.dirname(path), record)
        errors = node._teardown()
        log(f"kubenode: tore down {node.dir}, left by pid {record['owner']}"
            + (f"; left: {'; '.join(errors)}" if errors else ""))
        reaped.append(node.dir)
    return reaped


@contextlib.contextmanager
def kube_node(prepared: Prepared | None = None, log: Callable[[str], None] = print, *,
              lock: bool = True, labels: dict[str, str] | None = None) -> Iterator[Node]:
    """A node (see Node), torn down on exit; one at a time on this machine. ``lock=False``: the
    caller holds ``kubepods_lock()`` already (to look at the machine just before and after).
    ``labels``: the node's labels (``--node-labels``), which pods' nodeSelectors must match."""
    prepared = prepared or prepare(log=log)
    with kubepods_lock() if lock else contextlib.nullcontext():
        reap_stale(log)
        node = Node(prepared)
        node.labels = dict(labels or {})
        try:
            node._start()
            yield node
        except BaseException:
            errors = node._teardown()
            if errors:
                print("kubenode: teardown after a failure: " + "; ".join(errors), file=sys.stderr)
            raise
        errors = node._teardown()
        if errors:
            raise NodeError("the node's teardown left things behind: " + "; ".join(errors))


class SharedNode:
    """One node for several tests (a module-scoped fixture holds one), started on first use;
    ``close()`` ends it (a test that needs the machine without a node, or its own node, calls
    it first: the next ``get()`` starts a new one)."""

    def __init__(self) -> None:
        self._stack: contextlib.ExitStack | None = None
        self._node: Node | None = None

    def get(self) -> Node:
        if self._node is None:
            stack = contextlib.ExitStack()
            self._node = stack.enter_context(kube_node())
            self._stack = stack
        return self._node

    def close(self) -> None:
        stack, self._stack, self._node = self._stack, None, None
        if stack is not None:
            stack.close()


def _exec_kubelet(argv: list[str]) -> None:
    """``FAKE_DIR KUBELET ARGS...``, run by ``unshare -m --propagation private``: bind a file
    holding each value the kubelet wants over its ``/proc/sys`` file, then become the kubelet."""
    # the parent (the test process) is in the host's mount namespace
    if os.readlink("/proc/self/ns/mnt") == os.readlink(f"/proc/{os.getppid()}/ns/mnt"):
        raise SystemExit("kubenode: not in a mount namespace of its own: the host's sysctls would be shadowed")
    fake, kubelet_argv = argv[0], argv[1:]
    os.makedirs(fake, exist_ok=True)
    for name, value in SYSCTLS.items():
        path = os.path.join(fake, name.replace("/", "."))
        with open(path, "w") as fh:
            fh.write(value + "\n")
        subprocess.run(["mount", "--bind", path, f"/proc/sys/{name}"], check=True)
    os.execv(kubelet_argv[0], kubelet_argv)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.kubenode")
    ap.add_argument("--prepare", action="store_true", help="build (or reuse) the kubelet and the images")
    ap.add_argument("--exec-kubelet", nargs=argparse.REMAINDER,
                    help=argparse.SUPPRESS)  # inside the kubelet's mount namespace: shadow the sysctls, exec
    args = ap.parse_args(argv)
    if args.exec_kubelet:
        _exec_kubelet(args.exec_kubelet)
    if not args.prepare:
        ap.error("nothing to do: --prepare")
    t = time.monotonic()
    p = prepare()
    what = "built" if p.built else "reused"
    steps = ", ".join(f"{k} {v:.1f} s" for k, v in p.seconds.items()) or "nothing to do"
    print(f"kubenode: {what} {p.kubelet} ({steps}); images {p.pause_archive}, {p.busybox_archive}; "
          f"{time.monotonic() - t:.1f} s in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())

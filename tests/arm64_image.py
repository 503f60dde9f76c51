"""The arm64 guest's image: Debian's arm64 kernel and an initramfs holding an arm64
userland (Python 3.11, util-linux, procps, numactl, curl, busybox) and the project's
dependencies as aarch64 wheels, built on any host without emulating anything.

Nothing is installed: each ``.deb`` is downloaded with a private apt configuration
(arm64 only, its own lists and status file, so the host's dpkg never learns of arm64)
and unpacked with ``dpkg-deb -x``; their maintainer scripts never run, none of these
packages needs one to work. Wheels come from ``pip download --platform`` and are
unpacked into ``/usr/lib/python3/dist-packages`` (a wheel is a zip). The initramfs
is written here as a ``newc`` cpio, uncompressed: the kernel unpacks it with plain
copies, where inflating it under software emulation would cost seconds.

The result is cached under ``ARM64_CACHE`` (default ``~/.cache/ascendbind-arm64``)
in a folder named by a hash of the inputs (this file: its package list, the wheel
pins, the init script); any change builds a new one, and the old ones are removed.
"""

from __future__ import annotations

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
import zipfile

CACHE = os.environ.get("ARM64_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "ascendbind-arm64")

# the userland, each package unpacked as it is (no dependency resolution: the list is the
# closure of what the guest runs; libraries of programs it never starts are left out)
PACKAGES = (
    "libc6 libgcc-s1 libcrypt1 zlib1g libzstd1 liblz4-1 liblzma5 libbz2-1.0 libselinux1 libpcre2-8-0 "
    "libcap2 libcap-ng0 libaudit1 libgcrypt20 libgpg-error0 libsystemd0 libudev1 "
    # Python 3.11 (Debian's, the version the daemon targets)
    "python3.11-minimal libpython3.11-minimal libpython3.11-stdlib libexpat1 libffi8 libssl3 "
    "libncursesw6 libtinfo6 libreadline8 libuuid1 libsqlite3-0 media-types "
    # lscpu, taskset, setpriv, unshare; ps, pgrep; numactl; busybox for sh, mount, insmod, poweroff
    "util-linux libsmartcols1 libblkid1 libmount1 procps libproc2-0 numactl libnuma1 busybox-static "
    # curl --unix-socket: the tests' HTTP client
    "curl libcurl4 libnghttp2-14 libidn2-0 libunistring2 librtmp1 libgnutls30 libhogweed6 libnettle8 "
    "libgmp10 libp11-kit0 libtasn1-6 libssh2-1 libpsl5 libgssapi-krb5-2 libkrb5-3 libk5crypto3 "
    "libkrb5support0 libkeyutils1 libcom-err2 libldap-2.5-0 libsasl2-2 libsasl2-modules-db libdb5.3 libbrotli1 "
    # ss (a listening socket's backlog) and chattr (read-only IRQ fixture files)
    "iproute2 libbsd0 libmd0 libmnl0 libtirpc3 libtirpc-common e2fsprogs libext2fs2"
).split()
KERNEL_PACKAGE = "linux-image-arm64"  # the metapackage: its Depends names the kernel
# the daemon's dependencies and the test runner's, pinned (pure-Python wheels are any-arch);
# PyYAML: the deployment helpers some host tests import
WHEELS = ("psutil==7.2.2", "pyudev==0.24.5", "structlog==26.1.0", "tenacity==9.2.1", "prometheus-client==0.26.0",
          "pytest==9.2.0", "hypothesis==6.170.17", "PyYAML==6.0.4")
# the modules the init loads: the 9p shares (virtio-pci and 9p are modules in Debian's kernel), and
# unix_diag, without which ss reads /proc/net/unix and shows no listening socket's backlog
MODULES = ("virtio_pci", "9pnet_virtio", "9p", "unix_diag")
# never needed in the guest, and most of the image's size
PRUNE = ("usr/share", "usr/lib/linux-image-*", "usr/lib/aarch64-linux-gnu/gconv",
         "usr/lib/python3.11/test", "usr/lib/python3.11/idlelib", "usr/lib/python3.11/tkinter",
         "usr/lib/python3.11/lib2to3", "usr/lib/python3.11/ensurepip", "usr/lib/python3.11/turtledemo",
         "usr/lib/python3.11/pydoc_data", "usr/lib/python3.11/config-3.11-aarch64-linux-gnu")

# PID 1: mounts, the 9p shares, then the request the host left in /out (tests/arm64_guest.py)
INIT = r"""#!/bin/busybox sh
/bin/busybox mkdir -p /usr/sbin /usr/bin /sbin /bin
/bin/busybox --install -s
export PATH=/usr/sbin:/usr/bin:/sbin:/bin
mkdir -p /proc /sys /dev /tmp /run /out
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
mkdir -p /dev/shm /dev/pts
mount -t tmpfs tmpfs /dev/shm
mount -t tmpfs tmpfs /tmp
mount -t tmpfs tmpfs /run
mount -t cgroup2 cgroup2 /sys/fs/cgroup 2>/dev/null
ip link set lo up
while read -r ko; do insmod "$ko"; done < /etc/guest-modules
share() { mount -t 9p -o "trans=virtio,version=9p2000.L,msize=512000$3" "$1" "$2" || {
    echo "arm64 guest: cannot mount the $1 share"; poweroff -f; }; }
share out /out
src=$(cat /out/src)
mkdir -p "$src"
share src "$src" ,ro
cd "$src"
echo "arm64 guest: up after $(cut -d' ' -f1 /proc/uptime) s"
/usr/bin/python3.11 -m tests.arm64_guest --inside
sync
poweroff -f
"""


def key() -> str:
    """The hash of every input of the image (this file holds them all)."""
    with open(__file__, "rb") as fh:
        return hashlib.sha256(fh.read()).hexdigest()[:16]


def image_dir(cache: str = CACHE) -> str:
    return os.path.join(cache, f"image-{key()}")


def cached(cache: str = CACHE) -> dict | None:
    """The cached image's manifest (paths, versions, build time), None when there is none."""
    path = os.path.join(image_dir(cache), "manifest.json")
    if not os.path.exists(path):
        return None
    with open(path) as fh:
        return json.load(fh)


class BuildError(RuntimeError):
    """The image could not be built: what failed, how often, and the tool's last words."""


# a download that fails is tried this often, waiting RETRY_WAIT[i] seconds after try i: a
# mirror or PyPI answering 5xx for a minute is common, a host without network fails in seconds
RETRY_WAIT = (5.0, 20.0)
NETWORK = ("the arm64 image is fetched from Debian's archive (the mirrors in this host's /etc/apt "
           "sources) and PyPI (pip's index): is the network up?")


def fetch(what: str, argv: list[str], *, cwd: str | None = None, waits=RETRY_WAIT, log=lambda line: None) -> str:
    """Run ``argv`` (a download) until it succeeds, ``len(waits) + 1`` tries at most; its
    stdout, else BuildError naming ``what``, the tries and the end of its stderr."""
    for attempt in range(len(waits) + 1):
        try:
            r = subprocess.run(argv, capture_output=True, text=True, cwd=cwd, timeout=900)
        except subprocess.TimeoutExpired as exc:
            rc, err = "timeout", f"no answer in {exc.timeout:g} s"
        else:
            if r.returncode == 0:
                return r.stdout
            rc, err = r.returncode, (r.stderr or r.stdout).strip()
        if attempt == len(waits):
            tail = "\n".join(err.splitlines()[-8:])
            times = f"{attempt + 1} time{'s' if attempt else ''}"
            raise BuildError(f"{what} failed {times} (last exit {rc}); {NETWORK}\n{tail}")
        log(f"arm64 image: {what} failed (exit {rc}), try {attempt + 2} of {len(waits) + 1} in {waits[attempt]:g} s")
        time.sleep(waits[attempt])  # a back-off between downloads, not a test waiting for an event
    raise AssertionError("unreachable")


def why_not() -> str | None:
    """None when an image can be built here, else what is missing."""
    missing = [f"{tool} ({pkg})" for tool, pkg in (("apt-get", "apt"), ("dpkg-deb", "dpkg"))
               if shutil.which(tool) is None]
    return None if not missing else "cannot build the arm64 image: missing " + ", ".join(missing)


def _apt_setup(apt_dir: str, etc_apt: str = "/etc/apt", waits=RETRY_WAIT, log=lambda line: None) -> None:
    """A private apt for arm64 with the host's Debian sources (deb822 or one-line), its
    lists fetched."""
    for d in ("parts", "state/lists/partial", "cache/archives/partial", "debs"):
        os.makedirs(os.path.join(apt_dir, d), exist_ok=True)
    open(os.path.join(apt_dir, "status"), "a").close()
    for old in glob.glob(os.path.join(apt_dir, "parts", "*")):
        os.unlink(old)
    for src in glob.glob(os.path.join(etc_apt, "sources.list.d", "*.sources")):
        shutil.copy(src, os.path.join(apt_dir, "parts"))
    lines = []
    for src in [os.path.join(etc_apt, "sources.list"), *glob.glob(os.path.join(etc_apt, "sources.list.d", "*.list"))]:
        if os.path.exists(src):
            with open(src) as fh:
                lines += [ln for ln in fh if ln.startswith("deb ")]
    with open(os.path.join(apt_dir, "sources.list"), "w") as fh:
        fh.writelines(lines)
    # Error-Mode=any: a list that could not be fetched fails the update (apt's default only
    # warns, and the downloads then fail with "Unable to locate package")
    fetch("apt-get update (arm64 lists)", ["apt-get", *_apt_opts(apt_dir), "-oAPT::Update::Error-Mode=any", "update"],
          cwd=apt_dir, waits=waits, log=log)


def _download_debs(apt_dir: str, log=lambda line: None) -> tuple[list[str], str]:
    """The packages' .debs (and the kernel's) under apt_dir/debs; returns them and the
    kernel package's name."""
    sim = subprocess.run(["apt-get", *_apt_opts(apt_dir), "-s", "install", "--no-install-recommends", KERNEL_PACKAGE],
                         capture_output=True, text=True, cwd=apt_dir)
    if sim.returncode != 0:
        raise BuildError(f"apt-get cannot resolve {KERNEL_PACKAGE} for arm64 (exit {sim.returncode}):\n"
                         + sim.stderr.strip()[-2000:])
    policy = sim.stdout
    kernel = re.findall(r"^Inst (linux-image-\S+-arm64) ", policy, re.M)
    if not kernel:
        raise RuntimeError(f"no arm64 kernel package behind {KERNEL_PACKAGE}:\n{policy[-2000:]}")
    debs_dir = os.path.join(apt_dir, "debs")
    for old in glob.glob(os.path.join(debs_dir, "*.deb")):
        os.unlink(old)
    fetch("apt-get download (arm64 packages)", ["apt-get", "download", *_apt_opts(apt_dir), *PACKAGES, kernel[0]],
          cwd=debs_dir, log=log)
    return sorted(glob.glob(os.path.join(debs_dir, "*.deb"))), kernel[0]


def _apt_opts(apt_dir: str) -> list[str]:
    return [f"-oDir::Etc::SourceList={apt_dir}/sources.list", f"-oDir::Etc::SourceParts={apt_dir}/parts",
            f"-oDir::State={apt_dir}/state", f"-oDir::State::status={apt_dir}/status",
            f"-oDir::Cache={apt_dir}/cache", "-oAPT::Architecture=arm64", "-oAPT::Architectures::=arm64",
            "-oDebug::NoLocking=1", "-oAcquire::Retries=3", "-q"]


def _unpack_wheels(work: str, root: str, log=lambda line: None) -> list[str]:
    wheels = os.path.join(work, "wheels")
    os.makedirs(wheels, exist_ok=True)
    fetch("pip download (aarch64 wheels)", [sys.executable, "-m", "pip", "download", "-q", "--dest", wheels,
                                            "--only-binary=:all:", "--platform", "manylinux2014_aarch64",
                                            "--python-version", "3.11", "--implementation", "cp", "--abi", "cp311",
                                            *WHEELS], log=log)
    site = os.path.join(root, "usr/lib/python3/dist-packages")
    os.makedirs(site, exist_ok=True)
    names = sorted(os.listdir(wheels))
    for name in names:
        with zipfile.ZipFile(os.path.join(wheels, name)) as z:
            z.extractall(site)
    return names


def _modules(root: str, release: str) -> list[str]:
    """The .ko files of MODULES and what they depend on (read from each module's
    ``.modinfo``: the .deb ships no modules.dep, depmod makes it on install), in load
    order; every other module is removed from the image."""
    base = os.path.join(root, "lib/modules", release)
    by_name = {}
    for path in glob.glob(os.path.join(base, "**/*.ko"), recursive=True):
        by_name[os.path.basename(path)[:-3].replace("-", "_")] = path
    order: list[str] = []

    def visit(name: str) -> None:
        path = by_name[name.replace("-", "_")]
        if path in order:
            return
        with open(path, "rb") as fh:
            m = re.search(rb"\0depends=([^\0]*)\0", fh.read())
        for dep in (m.group(1).decode().split(",") if m and m.group(1) else []):
            visit(dep)
        order.append(path)

    for name in MODULES:
        visit(name)
    keep = os.path.join(root, "lib/guest-modules")
    os.makedirs(keep)
    loaded = []
    for path in order:
        dst = os.path.join(keep, os.path.basename(path))
        shutil.move(path, dst)
        loaded.append("/" + os.path.relpath(dst, root))
    shutil.rmtree(os.path.join(root, "lib/modules"))
    return loaded


def _compile(root: str) -> bool:
    """The stdlib's and the wheels' bytecode, compiled here: Debian makes it in a maintainer
    script (py3compile), which never runs, and without it every interpreter the guest starts
    compiles each module it imports, under emulation. Bytecode is the same on every
    architecture for one Python minor version, so only a 3.11 host can make it."""
    if sys.version_info[:2] != (3, 11):
        return False
    dirs = [os.path.join(root, d) for d in ("usr/lib/python3.11", "usr/lib/python3/dist-packages")]
    subprocess.run([sys.executable, "-m", "compileall", "-q", "-j", "0", "--invalidation-mode", "unchecked-hash",
                    *dirs], capture_output=True, text=True)  # a module that does not compile is only slower
    return True


def write_cpio(root: str, out: str) -> int:
    """``root`` as an uncompressed newc cpio (owner root, modes and symlinks kept); returns its size."""
    ino = 0

    def entry(fh, name: str, mode: int, data: bytes, mtime: int) -> None:
        nonlocal ino
        ino += 1
        nb = name.encode() + b"\0"
        fields = (ino, mode, 0, 0, 1, mtime, len(data), 0, 0, 0, 0, len(nb), 0)
        head = b"070701" + b"".join(b"%08x" % f for f in fields) + nb
        fh.write(head + b"\0" * (-len(head) % 4) + data + b"\0" * (-len(data) % 4))

    with open(out, "wb") as fh:
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames.sort()
            for name in [""] + sorted(filenames) + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
                path = os.path.join(dirpath, name) if name else dirpath
                rel = os.path.relpath(path, root)
                if rel == ".":
                    continue
                st = os.lstat(path)
                if stat.S_ISLNK(st.st_mode):
                    data = os.readlink(path).encode()
                elif stat.S_ISREG(st.st_mode):
                    with open(path, "rb") as f:
                        data = f.read()
                else:
                    data = b""
                entry(fh, rel, st.st_mode, data, int(st.st_mtime))
            dirnames[:] = [d for d in dirnames if not os.path.islink(os.path.join(dirpath, d))]
        entry(fh, "TRAILER!!!", 0, b"", 0)
        return fh.tell()


def build(cache: str = CACHE, log=print) -> dict:
    """The image for the current inputs: the cached one, else a new one (minutes: downloads)."""
    have = cached(cache)
    if have is not None:
        return have
    os.makedirs(cache, exist_ok=True)
    # one build at a time (a test session starts it early on a thread of its own, a guest
    # waits for it; two sessions share the cache): the second finds the first's image
    with open(os.path.join(cache, ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return cached(cache) or _build(cache, log)


def _build(cache: str, log) -> dict:
    started = time.monotonic()
    work = tempfile.mkdtemp(prefix="build-", dir=cache)
    try:
        apt_dir = os.path.join(cache, "apt")
        os.makedirs(apt_dir, exist_ok=True)
        log("arm64 image: apt lists (arm64)")
        _apt_setup(apt_dir, log=log)
        log("arm64 image: downloading the packages")
        debs, kernel = _download_debs(apt_dir, log=log)
        root = os.path.join(work, "root")
        os.makedirs(root)
        versions = {}
        for deb in debs:
            subprocess.run(["dpkg-deb", "-x", deb, root], check=True)
            name, version = os.path.basename(deb).split("_")[:2]
            versions[name] = version.replace("%3a", ":")
        release = kernel[len("linux-image-"):]
        out_dir = os.path.join(work, "image")
        os.makedirs(out_dir)
        shutil.move(os.path.join(root, "boot", f"vmlinuz-{release}"), os.path.join(out_dir, "Image"))
        shutil.rmtree(os.path.join(root, "boot"))
        for prune in PRUNE:
            for path in glob.glob(os.path.join(root, prune)):
                shutil.rmtree(path, ignore_errors=True)
        modules = _modules(root, release)
        log("arm64 image: wheels")
        wheels = _unpack_wheels(work, root, log=log)
        os.makedirs(os.path.join(root, "etc"), exist_ok=True)
        with open(os.path.join(root, "etc/guest-modules"), "w") as fh:
            fh.write("".join(m + "\n" for m in modules))
        passwd = "root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n"
        for name, text in (("etc/passwd", passwd), ("etc/group", "root:x:0:\nnogroup:x:65534:\n"),
                           ("etc/hostname", "arm64-guest\n")):
            with open(os.path.join(root, name), "w") as fh:
                fh.write(text)
        os.symlink("python3.11", os.path.join(root, "usr/bin/python3"))
        compiled = _compile(root)
        with open(os.path.join(root, "init"), "w") as fh:
            fh.write(INIT)
        os.chmod(os.path.join(root, "init"), 0o755)
        size = write_cpio(root, os.path.join(out_dir, "initrd.cpio"))
        manifest = {"key": key(), "kernel": release, "packages": versions, "wheels": wheels, "modules": modules,
                    "initrd_bytes": size, "bytecode": compiled, "build_seconds": round(time.monotonic() - started, 1),
                    "image": image_dir(cache)}
        with open(os.path.join(out_dir, "manifest.json"), "w") as fh:
            json.dump(manifest, fh, indent=1)
        for old in glob.glob(os.path.join(cache, "image-*")):
            shutil.rmtree(old, ignore_errors=True)
        os.rename(out_dir, image_dir(cache))
        return manifest
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    m = build()
    print(json.dumps({k: v for k, v in m.items() if k != "packages"}, indent=1))

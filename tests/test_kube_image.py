"""The DaemonSet's image as buildah builds it from deploy/kubernetes/Containerfile
(tests/kube_image.py): its config says what the Containerfile says, its layers, unpacked
the way a container runtime does, hold this checkout's package, and its programs run;
containerd takes the archive under the reference ``daemon_image()`` names; the cache
key follows exactly what the build context sends; and a build leaves nothing on the
host but its cached files.

The programs run chrooted into the unpacked layers in a mount and pid namespace of
their own (a fresh /proc of that namespace, a read-only /sys, a tmpfs /dev), as in a
container; nothing they mount outlives them.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time

import pytest

from tests import kube_image

REPO = kube_image.REPO


@pytest.fixture(scope="module")
def built():
    why = kube_image.why_not()
    if why:
        if os.environ.get("CI"):
            pytest.fail(why)
        pytest.skip(why)
    had_var_lib_containers = os.path.exists("/var/lib/containers")
    meta = kube_image.prepare(log_step=lambda line: print(line, file=sys.stderr))
    return {**meta, "had_var_lib_containers": had_var_lib_containers}


def _archive_json(archive: str, name: str):
    with tarfile.open(archive) as tf:
        return json.load(tf.extractfile(name))


@pytest.fixture(scope="module")
def config(built):
    manifest = _archive_json(built["archive"], "manifest.json")
    assert len(manifest) == 1, manifest
    return manifest[0], _archive_json(built["archive"], manifest[0]["Config"])


# unpacks the layers as a runtime does (whiteouts delete what lower layers hold), chrooted
# into the root first so that an absolute symlink in the image (/var/run -> /run) points
# into the image, never at the host
_UNPACK = r"""
import json, os, shutil, sys, tarfile
outer = tarfile.open(sys.argv[1])
layers = [outer.extractfile(n) for n in json.load(outer.extractfile("manifest.json"))[0]["Layers"]]
os.chroot(sys.argv[2]); os.chdir("/")
trusted = {"filter": "fully_trusted"} if hasattr(tarfile, "fully_trusted_filter") else {}
def remove(path):
    if os.path.isdir(path) and not os.path.islink(path): shutil.rmtree(path)
    elif os.path.lexists(path): os.unlink(path)
for fo in layers:
    layer = tarfile.open(fileobj=fo)
    members = layer.getmembers()
    for m in members:
        d, base = os.path.split("/" + m.name)
        if base == ".wh..wh..opq":
            for child in os.listdir(d) if os.path.isdir(d) else ():
                remove(os.path.join(d, child))
        elif base.startswith(".wh."):
            remove(os.path.join(d, base[4:]))
    for m in members:
        if os.path.basename(m.name).startswith(".wh."):
            continue
        path = "/" + m.name
        if os.path.lexists(path) and not (m.isdir() and os.path.isdir(path) and not os.path.islink(path)):
            remove(path)  # a layer's entry replaces what is there, never writes through a link
        layer.extract(m, "/", numeric_owner=True, **trusted)
"""


@pytest.fixture(scope="module")
def rootfs(built, tmp_path_factory):
    root = str(tmp_path_factory.mktemp("kube-image") / "root")
    os.mkdir(root)
    subprocess.run([sys.executable, "-c", _UNPACK, built["archive"], root], check=True, timeout=300)
    yield root
    assert not kube_image._mounts_under(root)
    shutil.rmtree(root)


# pid 1 of a new pid namespace, in a private mount namespace: /proc, /sys, /dev for the
# image's root, then the image's program with the image's environment
_RUN_IN = r"""
import ctypes, json, os, stat, sys
libc = ctypes.CDLL(None, use_errno=True)
root, env, argv = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3:]
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC = 1, 2, 4, 8, 32, 4096, 16384
def mount(src, dst, fs, flags, data=None):
    if libc.mount(src and src.encode(), dst.encode(), fs and fs.encode(), flags, data and data.encode()) != 0:
        sys.exit(f"mount {dst}: errno {ctypes.get_errno()}")
mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
mount("/sys", root + "/sys", None, MS_BIND | MS_REC)
mount(None, root + "/sys", None, MS_REMOUNT | MS_BIND | MS_RDONLY)
mount("tmpfs", root + "/dev", "tmpfs", MS_NOSUID, "mode=0755")
for name, minor in (("null", 3), ("zero", 5), ("full", 7), ("random", 8), ("urandom", 9)):
    os.mknod(f"{root}/dev/{name}", stat.S_IFCHR | 0o666, os.makedev(1, minor))
os.chroot(root); os.chdir("/")
os.execvpe(argv[0], argv, env)
"""


def run_in(root: str, config: dict, *argv: str) -> subprocess.CompletedProcess:
    env = dict(e.split("=", 1) for e in config["config"]["Env"])
    env.setdefault("HOME", "/root")  # what containerd adds for uid 0
    return subprocess.run(["unshare", "--mount", "--pid", "--fork", "--propagation", "private", "--",
                           sys.executable, "-c", _RUN_IN, root, json.dumps(env), *argv],
                          capture_output=True, text=True, timeout=120)


def _containerfile_final_stage() -> dict:
    """CMD (JSON form), USER and the ENV pairs of the Containerfile's last stage."""
    with open(os.path.join(REPO, kube_image.CONTAINERFILE)) as fh:
        text = fh.read().replace("\\\n", " ")
    stage = re.split(r"(?m)^FROM ", text)[-1]
    said = {"Env": {}}
    for line in stage.splitlines():
        word, _, rest = line.partition(" ")
        if word == "CMD":
            said["Cmd"] = json.loads(rest)
        elif word == "USER":
            said["User"] = rest.strip()
        elif word == "ENV":
            said["Env"].update(pair.split("=", 1) for pair in rest.split())
    return said


def test_the_image_config_says_what_the_containerfile_says(built, config):
    manifest, cfg = config
    said = _containerfile_final_stage()
    assert said["Cmd"] == ["ascendbind", "serve"] and said["User"] == "0:0"  # the parse found them
    assert manifest["RepoTags"] == [kube_image.IMAGE_REF] == [built["ref"]]
    assert cfg["config"]["Cmd"] == said["Cmd"]
    assert cfg["config"]["User"] == said["User"]
    assert not cfg["config"].get("Entrypoint")
    env = dict(e.split("=", 1) for e in cfg["config"]["Env"])
    assert said["Env"] == {"PYTHONDONTWRITEBYTECODE": "1", "PYTHONUNBUFFERED": "1"}
    assert {k: env.get(k) for k in said["Env"]} == said["Env"]
    # the base's own environment: no pip override leaks into the daemon's containers
    assert not any(k.startswith("PIP_") for k in env), env
    assert cfg["architecture"] == {"x86_64": "amd64", "aarch64": "arm64"}[os.uname().machine]
    assert cfg["os"] == "linux"


def test_the_image_holds_this_checkouts_package_and_runs_it(built, config, rootfs):
    site = os.path.join(rootfs, "usr/local/lib/python3.11/dist-packages/ascendbind")
    ours = [f for f in kube_image.context_files() if f.startswith("ascendbind/") and f.endswith(".py")]
    theirs = sorted(os.path.relpath(os.path.join(d, f), os.path.dirname(site))
                    for d, _, files in os.walk(site) for f in files if f.endswith(".py"))
    assert theirs == ours
    for rel in ours:
        with open(os.path.join(REPO, rel), "rb") as a, open(os.path.join(os.path.dirname(site), rel), "rb") as b:
            assert a.read() == b.read(), f"{rel} in the image is not this checkout's"
    r = run_in(rootfs, config[1], "ascendbind", "--version")
    assert r.returncode == 0, r.stderr
    with open(os.path.join(REPO, "ascendbind", "__init__.py")) as fh:
        version = re.search(r'__version__ = "([^"]+)"', fh.read()).group(1)
    with open(os.path.join(REPO, "pyproject.toml")) as fh:
        assert f'version = "{version}"' in fh.read()
    assert r.stdout == f"ascendbind {version}\n"
    r = run_in(rootfs, config[1], "python3", "-c", "import ascendbind.client, sys; print(sys.version_info[:2])")
    assert (r.returncode, r.stdout) == (0, "(3, 11)\n"), r.stderr


def test_the_npu_smi_wrapper_is_the_repositorys_and_executable(rootfs):
    path = os.path.join(rootfs, "usr/local/libexec/ascendbind/npu-smi")
    st = os.stat(path)
    assert st.st_mode & 0o111 == 0o111 and st.st_uid == 0
    with open(path, "rb") as a, open(os.path.join(REPO, "deploy/kubernetes/npu-smi-host"), "rb") as b:
        assert a.read() == b.read()


def test_the_discovery_tools_run_in_the_image(config, rootfs):
    # ps: the container's own pid namespace shows ps itself as pid 1
    r = run_in(rootfs, config[1], "ps", "-e", "-o", "pid=,comm=")
    assert (r.returncode, r.stdout.split()) == (0, ["1", "ps"]), r.stderr
    r = run_in(rootfs, config[1], "lscpu")
    assert r.returncode == 0, r.stderr
    fields = dict(line.split(":", 1) for line in r.stdout.splitlines() if ":" in line)
    assert fields["Architecture"].strip() == os.uname().machine
    assert int(fields["CPU(s)"]) == os.cpu_count()
    # pyudev's hot-plug monitor loads libudev.so.1
    r = run_in(rootfs, config[1], "python3", "-c", "import pyudev; pyudev.Context(); print('udev')")
    assert (r.returncode, r.stdout) == (0, "udev\n"), r.stderr


def test_a_build_leaves_nothing_but_its_cache(built):
    cache = os.path.dirname(os.path.dirname(built["archive"]))
    assert not kube_image._mounts_under(cache)
    assert [n for n in os.listdir(cache) if n.startswith("work-")] == []
    if not built["had_var_lib_containers"]:
        assert not os.path.exists("/var/lib/containers")


def _wait_for_socket(path: str, proc: subprocess.Popen, log: str, deadline_s: float = 60) -> None:
    end = time.monotonic() + deadline_s
    while not os.path.exists(path):
        if proc.poll() is not None or time.monotonic() > end:
            with open(log) as fh:
                pytest.fail(f"containerd did not listen (exit {proc.poll()}):\n{fh.read()[-3000:]}")
        time.sleep(0.05)  # a poll with a deadline: containerd says nothing when it listens


def test_containerd_imports_the_archive_under_its_reference(built, tmp_path):
    if shutil.which("containerd") is None or shutil.which("ctr") is None:
        if os.environ.get("CI"):
            pytest.fail("containerd is missing (Debian's containerd package)")
        pytest.skip("no containerd")
    d = str(tmp_path)
    sock = os.path.join(d, "c.sock")
    had_opt = os.path.exists("/opt/containerd")
    with open(os.path.join(d, "config.toml"), "w") as fh:
        # no CRI, and no opt plugin (it would make /opt/containerd)
        fh.write(f'version = 2\nroot = "{d}/root"\nstate = "{d}/state"\n'
                 'disabled_plugins = ["io.containerd.grpc.v1.cri", "io.containerd.internal.v1.opt"]\n'
                 f'[grpc]\n  address = "{sock}"\n')
    log = os.path.join(d, "containerd.log")
    with open(log, "w") as out:
        proc = subprocess.Popen(["containerd", "--config", os.path.join(d, "config.toml")],
                                stdout=out, stderr=subprocess.STDOUT)
    try:
        _wait_for_socket(sock, proc, log)
        ctr = ["ctr", "--address", sock, "--namespace", "k8s.io"]
        r = subprocess.run([*ctr, "images", "import", built["archive"]], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        r = subprocess.run([*ctr, "images", "check", f"name=={built['ref']}"], capture_output=True, text=True)
        rows = [line.split() for line in r.stdout.splitlines()[1:]]
        assert [row[0] for row in rows] == [built["ref"]], r.stdout + r.stderr
        assert "complete" in rows[0] and rows[0][-1] == "true", r.stdout  # every blob there, unpacked
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    assert not kube_image._mounts_under(d)
    assert had_opt or not os.path.exists("/opt/containerd")


def test_the_key_follows_exactly_what_the_build_context_sends(tmp_path):
    root = str(tmp_path / "repo")
    for rel in [*kube_image.context_files(), ".dockerignore", kube_image.CONTAINERFILE]:
        os.makedirs(os.path.dirname(os.path.join(root, rel)), exist_ok=True)
        shutil.copy2(os.path.join(REPO, rel), os.path.join(root, rel))
    key = kube_image.image_key(root)
    assert key == kube_image.image_key(REPO)

    def write(rel: str, text: str) -> str:
        os.makedirs(os.path.dirname(os.path.join(root, rel)), exist_ok=True)
        with open(os.path.join(root, rel), "a") as fh:
            fh.write(text)
        return kube_image.image_key(root)

    # not sent: no new build
    assert write("tests/test_new.py", "x = 1\n") == key
    assert write("ascendbind/__pycache__/cli.cpython-311.pyc", "junk") == key
    assert write("deploy/kubernetes/daemonset.yaml", "# a comment\n") == key
    # sent, or the Containerfile: a new image
    changed = {write("ascendbind/cli.py", "# a comment\n")}
    changed.add(write(kube_image.CONTAINERFILE, "# a comment\n"))
    os.chmod(os.path.join(root, "deploy/kubernetes/npu-smi-host"), 0o644)
    changed.add(kube_image.image_key(root))
    changed.add(write("ascendbind/new_module.py", ""))
    assert len(changed) == 4 and key not in changed


def test_dockerignore_rules_apply_in_order_to_paths_and_their_parents(tmp_path):
    files = ["a/keep.py", "a/b/drop.py", "a/b/keep/x.py", "a/c.tmp", "a/__pycache__/m.pyc", "top.txt", "z/y"]
    for rel in files:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("")
    (tmp_path / ".dockerignore").write_text("# only a/\n*\n!a\na/b\n!a/b/keep\n**/*.tmp\n**/__pycache__\n")
    assert kube_image.context_files(str(tmp_path)) == ["a/b/keep/x.py", "a/keep.py"]
    # an exception with a wildcard can reach into any excluded directory
    (tmp_path / ".dockerignore").write_text("*\n!**/x.py\n")
    assert kube_image.context_files(str(tmp_path)) == ["a/b/keep/x.py"]
    # this repository's: the package, its metadata and the npu-smi wrapper
    sent = kube_image.context_files()
    assert [f for f in sent if not f.startswith("ascendbind/")] == [
        "LICENSE", "README.md", "deploy/kubernetes/npu-smi-host", "pyproject.toml"]
    assert "ascendbind/cli.py" in sent and not [f for f in sent if "__pycache__" in f or f.endswith(".pyc")]


def test_a_second_process_waits_for_the_build_under_way_then_reuses_it(built):
    cache = os.path.dirname(os.path.dirname(built["archive"]))
    with open(os.path.join(cache, ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a build under way
        proc = subprocess.Popen([sys.executable, "-u", "-m", "tests.kube_image", "--prepare"], cwd=REPO,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, "ASCENDBIND_KUBE_IMAGE_CACHE": cache})
        try:
            assert proc.stdout.readline() == "kube image: waiting for another process's build\n"
            assert proc.poll() is None
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    assert out.startswith(f"kube image: reused {built['ref']} {built['archive']} in "), out

"""deploy/kubernetes: every manifest against the Kubernetes schemas, the kit's
files against each other, and the DaemonSet's layout with a real daemon.

Schemas: kubernetes-validate's bundled OpenAPI schemas, strict (unknown fields
fail), offline, for the oldest and a recent Kubernetes the kit supports. The
PodMonitor and PrometheusRule are Prometheus Operator CRDs, outside those
schemas: they are checked field by field here and in test_deploy_monitoring.py
(promtool on the PrometheusRule's spec).

The layout test rebuilds the DaemonSet's host mounts (read-only /proc with a
writable /proc/irq on top, read-only /sys) in a private mount namespace, so
nothing leaks to the host, and runs a real daemon there with the ConfigMap's
config, reaching npu-smi through the image's wrapper.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import tomllib

import pytest

from ascendbind import __version__
from ascendbind.cli import build_parser
from ascendbind.settings import load_config
from tests.daemon_harness import DaemonProc, base_env, free_port
from tests.deploy_tools import K8S, ROOT, missing, yaml_docs
from tests.workers import start_worker

# oldest and newest minor the kit is checked against (kubernetes-validate >= 1.30 bundles both)
K8S_VERSIONS = ("1.28.0", "1.33.0")
CRD_KINDS = {"PodMonitor", "PrometheusRule"}
CAPS = {"SYS_NICE", "SYS_PTRACE", "DAC_OVERRIDE"}
MANIFESTS = sorted(p for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")
EXAMPLES = sorted((K8S / "examples").glob("*.yaml"))
# files holding core kinds; the CRDs' own files are checked by the tests named after them
CORE = [p for p in MANIFESTS + EXAMPLES if any(d["kind"] not in CRD_KINDS for d in yaml_docs(p))]


def _kv():
    try:
        import kubernetes_validate
    except ImportError:
        missing("kubernetes-validate (pip, the test extra)")
    return kubernetes_validate


def _validate(doc: dict, version: str) -> None:
    _kv().validate(doc, version, strict=True)


def _kind(kind: str) -> dict:
    docs = [d for p in MANIFESTS for d in yaml_docs(p) if d["kind"] == kind]
    assert len(docs) == 1, f"{kind}: {len(docs)} documents"
    return docs[0]


def _container(ds: dict) -> dict:
    (c,) = ds["spec"]["template"]["spec"]["containers"]
    return c


def _config() -> dict:
    return tomllib.loads(_kind("ConfigMap")["data"]["config.toml"])


def _mounts(ds: dict) -> dict[str, tuple[dict, dict]]:
    """mountPath -> (volumeMount, volume)."""
    vols = {v["name"]: v for v in ds["spec"]["template"]["spec"]["volumes"]}
    return {m["mountPath"]: (m, vols[m["name"]]) for m in _container(ds)["volumeMounts"]}


def _json_patch(doc: dict, ops: list[dict]) -> dict:
    """RFC 6902 add/replace/remove on plain paths: what kustomize does with a patch file."""
    out = copy.deepcopy(doc)
    for op in ops:
        *parents, last = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].lstrip("/").split("/")]
        node = out
        for p in parents:
            node = node[int(p)] if isinstance(node, list) else node[p]
        key = int(last) if isinstance(node, list) else last
        if op["op"] == "remove":
            del node[key]
        elif op["op"] == "replace":
            assert key in node if isinstance(node, dict) else key < len(node), f"replace of a missing {op['path']}"
            node[key] = op["value"]
        elif op["op"] == "add":
            node[key] = op["value"]
        else:
            raise AssertionError(f"unsupported op {op['op']}")
    return out


def _api_server_rules(ds: dict) -> list[str]:
    """Cross-field rules the API server enforces that no OpenAPI schema can express."""
    errors = []
    sc = _container(ds)["securityContext"]
    if sc.get("privileged") and sc.get("allowPrivilegeEscalation") is False:
        errors.append("privileged with allowPrivilegeEscalation=false is refused")
    if sc.get("readOnlyRootFilesystem") is not True:
        errors.append("root filesystem must stay read-only")
    return errors


def _privileged() -> dict:
    return _json_patch(_kind("DaemonSet"), yaml_docs(K8S / "patches" / "privileged.yaml")[0])


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("path", CORE, ids=lambda p: p.relative_to(K8S).as_posix())
def test_every_core_manifest_validates_strictly(path, version):
    docs = yaml_docs(path)
    assert docs, f"{path} holds no document"
    for doc in docs:
        if doc["kind"] in CRD_KINDS:
            continue
        _validate(doc, version)


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_the_privileged_variant_validates_and_obeys_the_api_server(version):
    ds = _privileged()
    _validate(ds, version)
    assert _api_server_rules(ds) == []
    assert _container(ds)["securityContext"]["privileged"] is True
    assert _api_server_rules(_kind("DaemonSet")) == []


def test_the_validator_rejects_a_wrong_daemonset():
    ds = copy.deepcopy(_kind("DaemonSet"))
    _container(ds)["securityContext"]["capabilites"] = {"add": ["SYS_ADMIN"]}  # misspelt: strict must refuse
    with pytest.raises(_kv().ValidationError):
        _validate(ds, K8S_VERSIONS[-1])


def test_kustomization_lists_every_manifest_and_nothing_else():
    kust = yaml_docs(K8S / "kustomization.yaml")[0]
    listed = kust["resources"]
    assert len(listed) == len(set(listed))
    assert sorted(listed) == sorted(p.name for p in MANIFESTS)
    assert all((K8S / r).is_file() for r in listed)
    # the worked examples are workloads, never applied with the kit
    assert not any(r.startswith("examples") for r in listed)
    text = (K8S / "kustomization.yaml").read_text()
    for patch in (K8S / "patches").glob("*.yaml"):
        assert f"patches/{patch.name}" in text, f"{patch.name} is not offered in kustomization.yaml"
    (image,) = kust["images"]
    assert image["name"] == _container(_kind("DaemonSet"))["image"]
    assert image["newTag"] == __version__


def test_the_crd_files_hold_only_crds_and_are_left_to_their_own_tests():
    crd_files = sorted(set(MANIFESTS) - set(CORE))
    assert [p.name for p in crd_files] == ["podmonitor.yaml", "prometheusrule.yaml"]
    for p in crd_files:
        (doc,) = yaml_docs(p)
        assert doc["apiVersion"] == "monitoring.coreos.com/v1" and doc["spec"]
        assert set(doc["metadata"]) == {"name", "namespace", "labels"}
        with pytest.raises(_kv().SchemaNotFoundError):  # not in the core schemas, as said above
            _validate(doc, K8S_VERSIONS[-1])


def test_crds_carry_the_labels_the_rules_and_dashboard_select_on():
    pm, ds, svc = _kind("PodMonitor"), _kind("DaemonSet"), _kind("Service")
    pod_labels = ds["spec"]["template"]["metadata"]["labels"]
    assert pm["apiVersion"] == "monitoring.coreos.com/v1"
    assert pm["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert pod_labels[pm["spec"]["jobLabel"]] == "ascendbind"  # job="ascendbind" in every rule
    (ep,) = pm["spec"]["podMetricsEndpoints"]
    assert {"sourceLabels": ["__meta_kubernetes_pod_node_name"], "targetLabel": "node", "action": "replace"} \
        in ep["relabelings"]
    ports = {p["name"]: p["containerPort"] for p in _container(ds)["ports"]}
    assert ep["port"] in ports and svc["spec"]["ports"][0]["targetPort"] == ep["port"]
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    host, _, port = _config()["metrics_listen"].rpartition(":")
    assert host == "0.0.0.0" and int(port) == ports[ep["port"]] == svc["spec"]["ports"][0]["port"]
    namespaces = {d["metadata"].get("namespace") for p in MANIFESTS for d in yaml_docs(p) if d["kind"] != "Namespace"}
    assert namespaces == {_kind("Namespace")["metadata"]["name"]}


def test_daemonset_holds_only_the_documented_privileges():
    ds = _kind("DaemonSet")
    pod = ds["spec"]["template"]["spec"]
    sc = _container(ds)["securityContext"]
    assert pod["hostPID"] is True and not pod.get("hostNetwork") and not pod.get("hostIPC")
    assert sc["privileged"] is False and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"] and set(sc["capabilities"]["add"]) == CAPS
    writable = {path for path, (m, v) in _mounts(ds).items() if "hostPath" in v and not m.get("readOnly")}
    assert writable == {"/run/ascendbind", "/var/lib/ascendbind", "/host/proc/irq", "/dev/davinci_manager",
                        "/dev/devmm_svm", "/dev/hisi_hdc"}
    docs = (ROOT / "docs" / "operations.md").read_text()
    for cap in CAPS:
        assert f"CAP_{cap}" in docs
    for path, (_m, v) in _mounts(ds).items():
        if "hostPath" in v:
            assert f"`{v['hostPath']['path']}`" in docs, f"docs/operations.md does not explain {v['hostPath']['path']}"
    for word in ("hostPID", "seccomp", "Unconfined", "privileged.yaml"):
        assert word in docs


def test_configmap_config_is_accepted_by_the_daemon_and_matches_the_mounts(tmp_path):
    cfg_file = tmp_path / "config.toml"
    cfg_file.write_text(_kind("ConfigMap")["data"]["config.toml"])
    cfg = load_config(str(cfg_file), env={})  # the daemon's own loader: unknown keys and bad values fail
    ds = _kind("DaemonSet")
    mounts = _mounts(ds)
    assert os.path.dirname(cfg.socket) in mounts and cfg.state_dir in mounts
    assert mounts[cfg.proc_root][1]["hostPath"]["path"] == "/proc" and mounts[cfg.proc_root][0]["readOnly"]
    assert mounts[cfg.proc_root + "/irq"][1]["hostPath"]["path"] == "/proc/irq"
    assert mounts[cfg.sys_root][1]["hostPath"]["path"] == "/sys"
    # kubelet's checkpoint through the host's init, under the host's /proc: never a file mount, which
    # kubelet's rename of each new checkpoint over the old one would leave showing the first
    assert cfg.kubelet_root == cfg.proc_root + "/1/root/var/lib/kubelet"
    assert ds["spec"]["template"]["spec"]["hostPID"] is True
    assert not any("kubelet" in v.get("hostPath", {}).get("path", "") for _m, v in mounts.values())
    containerfile = (K8S / "Containerfile").read_text()
    assert f"COPY deploy/kubernetes/npu-smi-host {cfg.npu_smi}\n" in containerfile
    command = _container(ds)["command"]
    args = build_parser().parse_args(command[1:])
    assert command[0] == "ascendbind" and args.verb == "serve"
    assert os.path.dirname(args.config) in mounts and mounts[os.path.dirname(args.config)][1]["configMap"]
    example = yaml_docs(K8S / "examples" / "vllm-worker.yaml")[0]
    (worker,) = example["spec"]["containers"]
    assert {"name": "ASCENDBIND_SOCKET", "value": cfg.socket} in worker["env"]
    (vol,) = example["spec"]["volumes"]
    (wm,) = worker["volumeMounts"]
    assert vol["hostPath"]["path"] == os.path.dirname(cfg.socket) == wm["mountPath"] and wm["readOnly"] is True
    assert '{"enable_cpu_binding": false}' in worker["args"]
    # `ascendbind run` with no NPU: the daemon binds the NPU the pod's devices say
    # (tests/test_npu_deployments.py runs this command in a device-plugin pod's namespaces)
    run = build_parser().parse_args(worker["command"][1:] + worker["args"])
    assert worker["command"][0] == "ascendbind" and run.verb == "run" and run.npu is None
    assert run.command[1:3] == ["vllm", "serve"]


def _probe(ds: dict, kind: str, sock: str) -> list[str]:
    argv = _container(ds)[kind]["exec"]["command"]
    assert argv[0] == "python3" and _config()["socket"] in argv[-1]
    return [sys.executable, *argv[1:-1], argv[-1].replace(_config()["socket"], sock)]


NS_EXEC = r"""
import json, os, subprocess, sys
for m in json.loads(sys.argv[1]):
    os.makedirs(m["target"], exist_ok=True)
    subprocess.run(["mount", "--bind", m["source"], m["target"]], check=True)
    if m["readonly"]:
        subprocess.run(["mount", "-o", "remount,bind,ro", m["target"]], check=True)
os.execvp(sys.argv[2], sys.argv[2:])
"""


def _in_mount_ns(mounts: list[dict], argv: list[str]) -> list[str]:
    """argv run in a private mount namespace after the bind mounts (deepest last)."""
    mounts = sorted(mounts, key=lambda m: m["target"].count("/"))
    return ["unshare", "--mount", "--propagation", "private", sys.executable, "-c", NS_EXEC, json.dumps(mounts), *argv]


def _layout_daemon(tmp_path, irq_writable: bool = True) -> DaemonProc:
    """A daemon with the ConfigMap's config and the DaemonSet's host mounts, re-rooted under tmp_path."""
    root = str(tmp_path / "node")
    ds, conf = _kind("DaemonSet"), _config()
    binds = []
    for path, (m, v) in _mounts(ds).items():
        if "hostPath" in v and v["hostPath"]["path"] in ("/proc", "/proc/irq", "/sys"):
            ro = bool(m.get("readOnly")) or (path.endswith("/irq") and not irq_writable)
            binds.append({"source": v["hostPath"]["path"], "target": root + path, "readonly": ro})
    assert len(binds) == 3
    lines = [f"{k} = {json.dumps(v)}" for k, v in conf.items() if k not in ("proc_root", "sys_root", "npu_smi")]
    lines += [f'proc_root = "{root}{conf["proc_root"]}"', f'sys_root = "{root}{conf["sys_root"]}"',
              f'npu_smi = "{K8S / "npu-smi-host"}"']
    (tmp_path / "config.toml").write_text("\n".join(lines) + "\n")
    # socket, state dir and metrics port go to this test (the environment overrides the file)
    env = base_env(str(tmp_path / "ascendbind.sock"), str(tmp_path / "state"), free_port(),
                   ASCENDBIND_HOST_NPU_SMI=str(ROOT / "fixtures" / "bin" / "npu-smi"))
    serve = [sys.executable, "-m", "ascendbind.cli", "serve", "--config", str(tmp_path / "config.toml")]
    return DaemonProc(str(tmp_path), env, _in_mount_ns(binds, serve))


def test_daemon_binds_for_real_in_the_daemonset_layout_and_probes_answer(tmp_path):
    d = _layout_daemon(tmp_path).start()
    try:
        d.wait_discovered()  # npu-smi reached through the image's wrapper
        ds = _kind("DaemonSet")
        for kind in ("readinessProbe", "livenessProbe"):
            r = subprocess.run(_probe(ds, kind, d.sock), cwd=ROOT, capture_output=True, text=True, timeout=60)
            assert r.returncode == 0, r.stderr
        with start_worker() as w:
            result = d.client.bind(w.pid, 0)
            steps = {s["step"]: s for s in result["steps"]}
            assert steps["affinity"]["outcome"] == "applied"
            # past the /proc/irq writability check: this host's fake NPU has no MSI IRQs
            assert steps["irq"]["reason"] != "irq_not_writable", steps["irq"]
            pool = set(result["plan"]["npus"]["0"]["pool"])
            assert all(cpus <= pool for cpus in w.cpus_allowed().values())
        # a worker pod's view: the socket directory mounted read-only still connects
        view = str(tmp_path / "worker-view")
        probe = _probe(ds, "readinessProbe", view + "/ascendbind.sock")
        ns = _in_mount_ns([{"source": str(tmp_path), "target": view, "readonly": True}], probe)
        r = subprocess.run(ns, cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
    finally:
        d.stop()
    r = subprocess.run(_probe(ds, "livenessProbe", d.sock), cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0  # the probe fails once the daemon is gone


def test_a_read_only_proc_irq_is_reported_not_written(tmp_path):
    d = _layout_daemon(tmp_path, irq_writable=False).start()
    try:
        d.wait_discovered()
        with start_worker() as w:
            steps = {s["step"]: s for s in d.client.bind(w.pid, 0)["steps"]}
        assert steps["irq"]["outcome"] == "skipped" and steps["irq"]["reason"] == "irq_not_writable"
    finally:
        d.stop()


# ---------------------------------------------------------------- image


def _dockerignore_keeps(rel: str, patterns: list[str]) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parents decides."""
    import re

    def rx(p: str) -> re.Pattern:
        out = re.escape(p.strip("/")).replace(r"\*\*", "\0").replace(r"\*", "[^/]*").replace(r"\?", "[^/]")
        return re.compile(out.replace("\0/", "(?:.*/)?").replace("\0", ".*") + "$")

    parts = rel.split("/")
    keep = True
    for pat in patterns:
        neg = pat.startswith("!")
        r = rx(pat[1:] if neg else pat)
        if any(r.match("/".join(parts[:i])) for i in range(1, len(parts) + 1)):
            keep = neg
    return keep


def test_image_context_builds_the_package_and_holds_every_copied_file(tmp_path):
    patterns = [ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines()
                if ln.strip() and not ln.startswith("#")]
    tracked = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout.split()
    context = [f for f in tracked if (ROOT / f).is_file() and _dockerignore_keeps(f, patterns)]
    assert "deploy/kubernetes/npu-smi-host" in context and not any(f.startswith("tests/") for f in context)
    text = (K8S / "Containerfile").read_text()
    for src in [ln.split()[1] for ln in text.splitlines() if ln.startswith("COPY ") and "--from" not in ln]:
        assert src == "." or src in context, f"COPY {src}: not in the build context"
    # the image's runtime tools: ps, lscpu, and pyudev's libudev (the memory step calls
    # move_pages(2) itself: no numactl)
    for pkg in ("procps", "util-linux", "libudev1"):
        assert f" {pkg}" in text
    assert " numactl" not in text
    # the build stage needs the package to build from exactly the files the context
    # sends: setuptools' PEP 517 sdist hook, offline, finds the same packages and README
    ctx = tmp_path / "ctx"
    for f in context:
        (ctx / f).parent.mkdir(parents=True, exist_ok=True)
        (ctx / f).write_bytes((ROOT / f).read_bytes())
    build = "import sys, setuptools.build_meta as b; print(b.build_sdist(sys.argv[1]))"
    r = subprocess.run([sys.executable, "-c", build, str(tmp_path / "dist")], cwd=ctx, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    import tarfile

    with tarfile.open(tmp_path / "dist" / r.stdout.split()[-1]) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    assert {"ascendbind/daemon/runtime/serve.py", "ascendbind/client.py", "pyproject.toml"} <= names
    assert not any(n.startswith(("tests/", "deploy/")) for n in names)


def test_npu_smi_wrapper_runs_the_host_binary_with_its_arguments_and_status(tmp_path):
    wrapper = str(K8S / "npu-smi-host")
    fake = str(ROOT / "fixtures" / "bin" / "npu-smi")
    env = {"PATH": os.environ["PATH"], "LC_ALL": "C", "ASCENDBIND_HOST_NPU_SMI": fake}
    direct = subprocess.run([fake, "info", "-m"], env=env, capture_output=True, text=True, timeout=30)
    wrapped = subprocess.run([wrapper, "info", "-m"], env=env, capture_output=True, text=True, timeout=30)
    assert direct.returncode == wrapped.returncode == 0 and wrapped.stdout == direct.stdout and "910B3" in direct.stdout
    failing = tmp_path / "npu-smi"
    failing.write_text("#!/bin/sh\necho \"$LD_LIBRARY_PATH|$*\"\nexit 3\n")
    failing.chmod(0o755)
    r = subprocess.run([wrapper, "info", "-t", "board"], capture_output=True, text=True, timeout=30,
                       env=dict(env, ASCENDBIND_HOST_NPU_SMI=str(failing), LD_LIBRARY_PATH="/opt/x"))
    assert r.returncode == 3 and r.stdout.strip().endswith("/opt/x|info -t board")
    r = subprocess.run([wrapper, "info"], capture_output=True, text=True, timeout=30,
                       env=dict(env, ASCENDBIND_HOST_NPU_SMI=str(tmp_path / "absent")))
    assert r.returncode == 127 and "not found" in r.stderr

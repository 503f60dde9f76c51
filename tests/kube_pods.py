"""The pods the real-kubelet tests run: the daemon with the DaemonSet's own pod spec, and
workers as an operator would write them.

``daemon_pod`` takes ``deploy/kubernetes/daemonset.yaml``'s pod template and the
ConfigMap's config as they are, and changes only what a standalone test node cannot
give or must not touch, each change listed in ``CHANGES`` with its reason. Everything
else (hostPID, the mounts and where they land in the container, the capabilities,
seccomp, the read-only root, the probes, the resources) is the manifest's, so the
manifest cannot drift from what the test proves. ``changed_keys`` lets the test check
that nothing else differs.
"""

from __future__ import annotations

import copy
import os
import re
from dataclasses import dataclass

from tests.deploy_tools import K8S, yaml_docs

__all__ = ["CHANGES", "FAKE_NPU_ENV", "CONFIG_CHANGES", "configmap_toml", "HostDirs", "daemon_pod", "daemon_config", "worker_pod", "changed_keys"]

# what the test node changes in the DaemonSet's pod (as changed_keys names it), and why
_DRIVER = "no NPU driver here: an empty test directory for the driver's libraries"
_DEVICE = "no NPU driver here: /dev/null stands for npu-smi's device node"
CHANGES = {
    "spec.hostNetwork": "the test node has no CNI plugin: pods share the host's network",
    "containers[0].image": "the image this suite built from deploy/kubernetes/Containerfile",
    "containers[0].imagePullPolicy": "no registry: the image is imported, never pulled",
    "containers[0].env": "no NPU here: the fixture npu-smi is told to describe two NPUs, NPU 0 next to CPU 1 and "
                         "NPU 1 next to CPU 0 (FAKE_NPU_ENV)",
    "volumes.config": "static pods cannot use a ConfigMap: the ConfigMap's config.toml in a host directory",
    "volumes.run": "the test's own socket directory, never the host's /run/ascendbind",
    "volumes.state": "the test's own state directory, never the host's /var/lib/ascendbind",
    "volumes.ascend-driver": _DRIVER,
    "volumes.ascend-dcmi": _DRIVER,
    "volumes.host-sbin": "the fixture npu-smi, where the driver installs the real one",
    "volumes.host-bin": "an empty directory: the fixture npu-smi is found in sbin",
    "volumes.davinci-manager": _DEVICE,
    "volumes.devmm-svm": _DEVICE,
    "volumes.hisi-hdc": _DEVICE,
}
# the fixture npu-smi's settings (fixtures/bin/npu-smi), which the daemon passes to the tools it runs
FAKE_NPU_ENV = {"ASCENDBIND_FAKE_NPUS": "2", "ASCENDBIND_FAKE_NPU_AFFINITY": "1;0"}
# what it changes in the ConfigMap's config.toml, and why
CONFIG_CHANGES = {
    "kubelet_root": "the test kubelet's root directory, read through a host process's root as the ConfigMap "
                    "reads it; through containerd's, not init's: this machine's PID 1 (a microVM's init) refuses "
                    "/proc/1/root even to root",
    "metrics_listen": "a free port on the host's loopback (host network)",
    "small_pool": "2 CPUs on the test node: a pod's one exclusive CPU is below the role minimum, so roles share it",
}


@dataclass(frozen=True)
class HostDirs:
    """Host directories the daemon's pod mounts instead of the host's own."""

    config: str  # holds config.toml
    run: str  # the socket's directory
    state: str
    sbin: str  # holds the fixture npu-smi, as the driver installs the real one
    empty: str  # stands for the driver's library directories


def _daemonset() -> dict:
    docs = [d for d in yaml_docs(K8S / "daemonset.yaml") if d["kind"] == "DaemonSet"]
    assert len(docs) == 1
    return docs[0]


def configmap_toml() -> str:
    docs = [d for d in yaml_docs(K8S / "configmap.yaml") if d["kind"] == "ConfigMap"]
    return docs[0]["data"]["config.toml"]


def _set_key(text: str, key: str, value: str) -> str:
    new, n = re.subn(rf"(?m)^{key} = .*$", f"{key} = {value}", text)
    assert n == 1, f"the ConfigMap's config.toml sets {key} {n} times"
    return new


def daemon_config(kubelet_root: str, metrics_port: int, host_pid: int) -> str:
    """The ConfigMap's config.toml with the keys the test node changes (CONFIG_CHANGES);
    ``host_pid``: a process in the host's mount namespace whose root the daemon reads
    ``kubelet_root`` through."""
    text = configmap_toml()
    assert '"/host/proc/1/root/var/lib/kubelet"' in text
    text = _set_key(text, "kubelet_root", f'"/host/proc/{host_pid}/root{kubelet_root}"')
    text = _set_key(text, "metrics_listen", f'"127.0.0.1:{metrics_port}"')
    assert not re.search(r"(?m)^small_pool = ", text)
    return text + '\nsmall_pool = "share"\n'


def daemon_pod(image: str, dirs: HostDirs) -> dict:
    ds = _daemonset()
    spec = copy.deepcopy(ds["spec"]["template"]["spec"])
    spec["hostNetwork"] = True
    c = spec["containers"][0]
    c["image"], c["imagePullPolicy"] = image, "Never"
    c["env"] = c.get("env", []) + [{"name": k, "value": v} for k, v in FAKE_NPU_ENV.items()]
    swap = {"/run/ascendbind": dirs.run, "/var/lib/ascendbind": dirs.state,
            "/usr/local/Ascend/driver": dirs.empty, "/usr/local/dcmi": dirs.empty,
            "/usr/local/sbin": dirs.sbin, "/usr/local/bin": dirs.empty}
    for v in spec["volumes"]:
        if "configMap" in v:
            v.pop("configMap")
            v["hostPath"] = {"path": dirs.config, "type": "Directory"}
        elif "hostPath" in v and v["hostPath"]["path"] in swap:
            v["hostPath"]["path"] = swap[v["hostPath"]["path"]]
            v["hostPath"]["type"] = "Directory"
        elif "hostPath" in v and v["hostPath"].get("type") == "CharDevice":
            v["hostPath"]["path"] = "/dev/null"
    meta = {"name": ds["metadata"]["name"], "namespace": ds["metadata"]["namespace"],
            "labels": dict(ds["spec"]["template"]["metadata"]["labels"])}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}


def changed_keys(pod: dict) -> set[str]:
    """The container and pod keys where ``pod`` differs from the DaemonSet's template."""
    spec = _daemonset()["spec"]["template"]["spec"]
    out = {f"spec.{k}" for k in set(spec) | set(pod["spec"])
           if k not in ("containers", "volumes") and spec.get(k) != pod["spec"].get(k)}
    mine, theirs = pod["spec"]["containers"][0], spec["containers"][0]
    out |= {f"containers[0].{k}" for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k)}
    vols = {v["name"]: v for v in spec["volumes"]}
    out |= {f"volumes.{v['name']}" for v in pod["spec"]["volumes"] if v != vols.get(v["name"])}
    return out


def worker_pod(name: str, image: str, *, socket_dir: str, worker_dir: str, cpu: str, guaranteed: bool,
               uid: str | None = None, namespace: str = "inference", npu: str = "0") -> dict:
    """A vLLM-like worker that binds itself with ``ascendbind run`` before its program starts,
    mounting the daemon's socket directory read-only as docs/operations.md says."""
    resources = {"requests": {"cpu": cpu, "memory": "96Mi"}, "limits": {"memory": "96Mi"}}
    if guaranteed:
        resources["limits"]["cpu"] = cpu
    meta = {"name": name, "namespace": namespace}
    if uid:
        meta["uid"] = uid  # as the API server gives a pod; a static pod without one gets the kubelet's hash
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": {
        "hostNetwork": True,
        "terminationGracePeriodSeconds": 5,
        "containers": [{
            "name": "engine", "image": image, "imagePullPolicy": "Never",
            "command": ["ascendbind", "run", "--"],
            "args": ["python3", "/opt/worker/" + os.path.basename(WORKER_PROGRAM)],
            "env": [{"name": "ASCENDBIND_SOCKET", "value": "/run/ascendbind/ascendbind.sock"},
                    {"name": "ASCEND_VISIBLE_DEVICES", "value": npu},
                    {"name": "PYTHONUNBUFFERED", "value": "1"}],
            "resources": resources,
            "volumeMounts": [{"name": "ascendbind", "mountPath": "/run/ascendbind", "readOnly": True},
                             {"name": "worker", "mountPath": "/opt/worker", "readOnly": True}],
        }],
        "volumes": [{"name": "ascendbind", "hostPath": {"path": socket_dir, "type": "Directory"}},
                    {"name": "worker", "hostPath": {"path": worker_dir, "type": "Directory"}}],
    }}


WORKER_PROGRAM = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kube_worker.py")
# what the pod's worker directory holds: the program and the module it names its threads with
WORKER_FILES = (WORKER_PROGRAM, os.path.join(os.path.dirname(WORKER_PROGRAM), "threadname.py"))

"""A real node for the test cluster: kubelet (built from Go modules with the control plane),
containerd and runc from Debian, the CNI bridge plugin, and kube-scheduler to place pods.

The kubelet registers with the test API server and runs the pods scheduled to it, from
images imported from podman (``make images``) into containerd. What this machine needs
(``scripts/podman_host.sh`` installs it, as root):

- containerd's ``restrict_oom_score_adj``: runc writes the pod sandbox's negative
  ``oom_score_adj`` (-998) and this kernel refuses any decrease even to root (``write
  /proc/self/oom_score_adj: permission denied``, which runc reports as "can't get final
  child's PID from pipe: EOF"); restricted, scores are clamped to containerd's own;
- the pod sandbox image ``localhost/kvpool-pause`` (Kubernetes' pause image lives in a
  registry: this one is built by ``scripts/build_images.sh``);
- a bridge (``kvp0``, 10.244.0.1/24) for pod IPs; pods reach the host at 10.244.0.1.

The kubelet's own HTTPS server is off (``kubectl logs`` and ``exec`` do not work): tests
read results from pod phases and the pool's status.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

#: The pod network: the bridge's address is the host as pods see it.
BRIDGE, SUBNET, GATEWAY = "kvp0", "10.244.0.0/24", "10.244.0.1"


def node_usable() -> str | None:
    """Why a kubelet node cannot run here, or None when it can."""
    if os.geteuid() != 0:
        return "a kubelet node needs root"
    for tool in ("containerd", "runc", "ctr", "podman", "ip"):
        if shutil.which(tool) is None:
            return "{} is not installed (scripts/podman_host.sh installs it)".format(tool)
    if not Path("/usr/lib/cni/bridge").exists():
        return "the CNI plugins are not installed (containernetworking-plugins)"
    return None


def image_present(image: str) -> bool:
    """Whether podman holds ``image`` (``make images`` builds them)."""
    return shutil.which("podman") is not None and subprocess.run(
        ["podman", "image", "exists", image], check=False).returncode == 0


def _run(*argv: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, check=check)


@dataclass
class KubeletNode:
    """containerd + kubelet (+ kube-scheduler) registered as ``name`` with the API server."""

    bin_dir: Path
    kubeconfig: Path
    name: str = "node-a"
    work: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="kvpool-node-")))
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def socket(self) -> Path:
        return self.work / "containerd.sock"

    def ctr(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return _run("ctr", "-a", str(self.socket), "-n", "k8s.io", *args, check=check)

    def _spawn(self, name: str, argv: Sequence[str]) -> None:
        log = open(self.work / (name + ".log"), "wb")
        self.procs.append(subprocess.Popen(list(argv), stdout=log, stderr=subprocess.STDOUT))

    def log_tail(self, name: str, lines: int = 30) -> str:
        path = self.work / (name + ".log")
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""

    def start(self, images: Sequence[str], pause_image: str, timeout: float = 90) -> None:
        if _run("ip", "link", "show", BRIDGE, check=False).returncode != 0:
            _run("ip", "link", "add", BRIDGE, "type", "bridge")
            _run("ip", "addr", "add", GATEWAY + "/24", "dev", BRIDGE)
        _run("ip", "link", "set", BRIDGE, "up")
        (self.work / "cni").mkdir()
        (self.work / "cni" / "10-kvpool.conflist").write_text(json.dumps({
            "cniVersion": "0.4.0", "name": "kvpool-test", "plugins": [
                {"type": "bridge", "bridge": BRIDGE, "isGateway": True, "ipMasq": False,
                 "ipam": {"type": "host-local", "ranges": [[{"subnet": SUBNET, "gateway": GATEWAY}]],
                          "dataDir": str(self.work / "ipam")}}]}))
        (self.work / "containerd.toml").write_text("\n".join([
            "version = 2", 'root = "{}"'.format(self.work / "containerd"), 'state = "{}"'.format(self.work / "state"),
            "[grpc]", '  address = "{}"'.format(self.socket),
            '[plugins."io.containerd.grpc.v1.cri"]',
            '  sandbox_image = "{}"'.format(pause_image),
            "  restrict_oom_score_adj = true",
            '  [plugins."io.containerd.grpc.v1.cri".cni]',
            '    bin_dir = "/usr/lib/cni"', '    conf_dir = "{}"'.format(self.work / "cni"), ""]))
        self._spawn("containerd", ["containerd", "--config", str(self.work / "containerd.toml")])
        self._wait("containerd's socket", lambda: self.socket.exists() and self.ctr("version", check=False)
                   .returncode == 0, timeout)
        for image in [pause_image, *images]:
            archive = self.work / "image.tar"
            _run("podman", "save", "--format", "oci-archive", "-o", str(archive), image, timeout=300)
            self.ctr("images", "import", str(archive), check=True)
            archive.unlink()
        (self.work / "kubelet.yaml").write_text(json.dumps({
            "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
            "cgroupDriver": "cgroupfs", "failSwapOn": False,
            "containerRuntimeEndpoint": "unix://{}".format(self.socket),
            "authentication": {"anonymous": {"enabled": True}, "webhook": {"enabled": False}},
            "authorization": {"mode": "AlwaysAllow"}, "port": 0, "readOnlyPort": 0, "healthzPort": 0,
            "imageGCHighThresholdPercent": 100, "evictionHard": {"memory.available": "1Mi"}}))
        self._spawn("kubelet", [str(self.bin_dir / "kubelet"), "--config", str(self.work / "kubelet.yaml"),
                                "--kubeconfig", str(self.kubeconfig), "--root-dir", str(self.work / "kubelet"),
                                "--hostname-override", self.name, "--v", "1"])
        self._spawn("kube-scheduler", [str(self.bin_dir / "kube-scheduler"), "--kubeconfig", str(self.kubeconfig),
                                       "--leader-elect=false", "--secure-port=0", "--v", "1"])
        kubectl = [str(self.bin_dir / "kubectl"), "--kubeconfig", str(self.kubeconfig)]
        self._wait("node {} Ready".format(self.name), lambda: _run(
            *kubectl, "get", "node", self.name, "-o", "jsonpath={.status.conditions[?(@.type==\"Ready\")].status}",
            check=False).stdout == "True", timeout)

    def _wait(self, what: str, probe: Callable[[], bool], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(p.poll() is not None for p in self.procs):
                raise RuntimeError("{} exited while waiting for {}:\n{}".format(
                    [p.args for p in self.procs if p.poll() is not None], what, self.log_tail("kubelet")))
            if probe():
                return
            time.sleep(0.5)
        raise TimeoutError("no {} after {:.0f}s:\n{}".format(what, timeout, self.log_tail("kubelet")))

    def stop(self) -> None:
        for p in reversed(self.procs[1:]):  # scheduler and kubelet first, containerd last
            p.terminate()
        for p in self.procs[1:]:
            p.wait(timeout=30)
        if self.procs and self.procs[0].poll() is None:
            for task in self.ctr("tasks", "ls", "-q", check=False).stdout.split():
                self.ctr("tasks", "kill", "-s", "SIGKILL", task, check=False)
            deadline = time.monotonic() + 30
            while self.ctr("tasks", "ls", "-q", check=False).stdout.strip() and time.monotonic() < deadline:
                time.sleep(0.2)
            self.procs[0].terminate()
            self.procs[0].wait(timeout=30)
        self.procs.clear()
        _run("ip", "link", "del", BRIDGE, check=False)
        for mnt in sorted(_run("findmnt", "-rn", "-o", "TARGET", check=False).stdout.split(), reverse=True):
            if mnt.startswith(str(self.work)):
                _run("umount", "-l", mnt, check=False)
        shutil.rmtree(self.work, ignore_errors=True)

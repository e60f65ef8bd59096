"""Pods under podman: a stand-in for a kubelet, for a node this sandbox cannot run.

A kubelet needs cgroup management and pod networking this machine does not give a test (see
``docs/kubernetes.md``), so the end-to-end tests run each pod the operator rendered the way a
kubelet would, with podman: the same image, command, arguments, user, groups, capabilities,
read-only root, environment (``fieldRef`` and ``$(VAR)`` expanded) and volumes (ConfigMap
and Secret files written with the kubelet's modes and fsGroup ownership, hostPath and
emptyDir directories), init containers first, to completion. Two differences, both said
where they matter: every pod shares the host's network (no CNI here: the pod IP is
127.0.0.1), and resources are not enforced.

``scripts/podman_host.sh`` prepares the host (cgroup controllers, limits) once, as root.
"""

from __future__ import annotations

import base64
import json
import os
import re
import resource
import shutil
import subprocess
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: What ``$(VAR)`` references look like in a container's command, args and env.
_VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def podman_usable() -> str | None:
    """Why podman cannot run the pool's pods here, or None when it can."""
    if shutil.which("podman") is None:
        return "podman is not installed (apt-get install podman; then scripts/podman_host.sh)"
    if os.geteuid() != 0:
        return "running pods under podman needs root"
    controllers = Path("/sys/fs/cgroup/unified/cgroup.controllers")
    if controllers.exists() and controllers.read_text().strip():
        return "cgroup controllers on the hybrid v2 hierarchy: run scripts/podman_host.sh first"
    return None


def image_present(image: str) -> bool:
    return subprocess.run(["podman", "image", "exists", image], check=False).returncode == 0


def _expand(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion: a known name is replaced, others stay as written."""
    return _VAR.sub(lambda m: env.get(m.group(1), m.group(0)), text)


@dataclass
class PodmanNode:
    """One node's pods: ``root`` holds its host paths and the pods' volume files."""

    root: Path
    node_name: str
    #: Reads a ConfigMap or Secret: (kind, namespace, name) -> the object, as the API has it.
    read: Callable[[str, str, str], dict[str, Any] | None]
    containers: list[str] = field(default_factory=list)

    def host_path(self, path: str) -> Path:
        """Where this node keeps a hostPath ``path``."""
        return self.root / "host" / path.lstrip("/")

    # -------------------------------------------------------------- volumes
    def _volume(self, pod: str, namespace: str, vol: dict[str, Any], fs_group: int | None) -> Path:
        name = vol["name"]
        if "hostPath" in vol:
            p = self.host_path(vol["hostPath"]["path"])
            p.mkdir(parents=True, exist_ok=True)  # DirectoryOrCreate: root's, 0755, as a kubelet makes it
            return p
        p = self.root / "pods" / pod / "volumes" / name
        p.mkdir(parents=True, exist_ok=True)
        if "emptyDir" in vol:
            p.chmod(0o777)
            return p
        if "configMap" in vol:
            obj = self.read("ConfigMap", namespace, vol["configMap"]["name"]) or {}
            files = {k: v.encode() for k, v in (obj.get("data") or {}).items()}
            mode = vol["configMap"].get("defaultMode", 0o644)
            items = vol["configMap"].get("items")
        elif "secret" in vol:
            obj = self.read("Secret", namespace, vol["secret"]["secretName"]) or {}
            files = {k: base64.b64decode(v) for k, v in (obj.get("data") or {}).items()}
            mode = vol["secret"].get("defaultMode", 0o644)
            items = vol["secret"].get("items")
        else:
            raise ValueError("volume {!r}: only hostPath, emptyDir, configMap and secret are run here".format(name))
        if not obj:
            raise FileNotFoundError("volume {!r}: its object does not exist".format(name))
        chosen = {i["path"]: files[i["key"]] for i in items} if items else files
        p.chmod(0o755)
        for rel, data in chosen.items():
            f = p / rel
            f.parent.mkdir(parents=True, exist_ok=True)
            f.write_bytes(data)
            if fs_group is not None:  # the kubelet: the group owns it and may read what the owner may
                os.chown(f, 0, fs_group)
                f.chmod(mode | ((mode & 0o700) >> 3 & 0o050))
            else:
                f.chmod(mode)
        return p

    # ----------------------------------------------------------- containers
    def _env(self, container: dict[str, Any], namespace: str, pod: str) -> dict[str, str]:
        fields = {"spec.nodeName": self.node_name, "status.podIP": "127.0.0.1", "metadata.namespace": namespace,
                  "metadata.name": pod}
        env: dict[str, str] = {}
        for item in container.get("env") or ():
            if "value" in item:
                env[item["name"]] = _expand(str(item["value"]), env)
            else:
                env[item["name"]] = fields[item["valueFrom"]["fieldRef"]["fieldPath"]]
        return env

    def _argv(self, pod_spec: dict[str, Any], c: dict[str, Any], name: str, mounts: Mapping[str, Path],
              env: Mapping[str, str], *, detach: bool) -> list[str]:
        sc = c.get("securityContext") or {}
        psc = pod_spec.get("securityContext") or {}
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        argv = ["podman", "run", "--name", name, "--network", "host", "--pull", "never",
                "--ulimit", "nofile={}:{}".format(min(soft, 65536), min(hard, 65536)),
                "--ulimit", "nproc=4096:4096", "--cap-drop", "ALL"]
        argv += ["-d"] if detach else ["--rm"]
        for cap in (sc.get("capabilities") or {}).get("add") or ():
            argv += ["--cap-add", cap]
        uid, gid = sc.get("runAsUser", psc.get("runAsUser")), sc.get("runAsGroup", psc.get("runAsGroup"))
        if uid is not None:
            argv += ["--user", "{}:{}".format(uid, gid if gid is not None else uid)]
        for g in [psc.get("fsGroup"), *(psc.get("supplementalGroups") or ())]:
            if g is not None:
                argv += ["--group-add", str(g)]
        if sc.get("readOnlyRootFilesystem"):
            argv.append("--read-only")
        if sc.get("allowPrivilegeEscalation") is False:
            argv += ["--security-opt", "no-new-privileges"]
        for m in c.get("volumeMounts") or ():
            argv += ["-v", "{}:{}{}".format(mounts[m["name"]], m["mountPath"], ":ro" if m.get("readOnly") else "")]
        for k, v in env.items():
            argv += ["-e", "{}={}".format(k, v)]
        command = [_expand(a, env) for a in c.get("command") or ()]
        args = [_expand(a, env) for a in c.get("args") or ()]
        if command:
            argv += ["--entrypoint", json.dumps(command[:1])]
            args = command[1:] + args
        return [*argv, c["image"], *args]

    def run_pod(self, namespace: str, pod_spec: dict[str, Any], name: str | None = None) -> list[str]:
        """Start ``pod_spec`` as a kubelet would; returns its (long-running) container names."""
        pod = name or "pod-" + uuid.uuid4().hex[:8]
        fs_group = (pod_spec.get("securityContext") or {}).get("fsGroup")
        mounts = {v["name"]: self._volume(pod, namespace, v, fs_group) for v in pod_spec.get("volumes") or ()}
        for c in pod_spec.get("initContainers") or ():
            env = self._env(c, namespace, pod)
            done = subprocess.run(self._argv(pod_spec, c, "{}-{}".format(pod, c["name"]), mounts, env, detach=False),
                                  capture_output=True, text=True, timeout=120, check=False)
            if done.returncode != 0:
                raise RuntimeError("init container {} failed ({}): {}{}".format(c["name"], done.returncode,
                                                                               done.stdout, done.stderr))
        started = []
        for c in pod_spec["containers"]:
            env = self._env(c, namespace, pod)
            cname = "{}-{}".format(pod, c["name"])
            subprocess.run(self._argv(pod_spec, c, cname, mounts, env, detach=True), capture_output=True, text=True,
                           timeout=120, check=True)
            self.containers.append(cname)
            started.append(cname)
        return started

    def run_once(self, image: str, argv: Sequence[str], *, user: str, groups: Sequence[int] = (),
                 mounts: Mapping[Path, str] = {}, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        """A one-off container (a serving pod's process): its output once it exits."""
        cmd = ["podman", "run", "--rm", "--network", "host", "--pull", "never", "--user", user, "--read-only",
               "--cap-drop", "ALL", "--ulimit", "nproc=4096:4096", "--entrypoint", json.dumps(list(argv[:1]))]
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        cmd += ["--ulimit", "nofile={}:{}".format(min(soft, 65536), min(hard, 65536))]
        for g in groups:
            cmd += ["--group-add", str(g)]
        for host, path in mounts.items():
            cmd += ["-v", "{}:{}".format(host, path)]
        return subprocess.run([*cmd, image, *argv[1:]], capture_output=True, text=True, timeout=timeout, check=False)

    def logs(self, container: str) -> str:
        out = subprocess.run(["podman", "logs", container], capture_output=True, text=True, timeout=30, check=False)
        return out.stdout + out.stderr

    def running(self, container: str) -> bool:
        out = subprocess.run(["podman", "inspect", "--format", "{{.State.Running}}", container],
                             capture_output=True, text=True, timeout=30, check=False)
        return out.stdout.strip() == "true"

    def stop(self) -> None:
        for c in self.containers:
            subprocess.run(["podman", "rm", "--force", "--time", "10", c], capture_output=True, timeout=60, check=False)
        self.containers.clear()

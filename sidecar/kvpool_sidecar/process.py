"""Run a sidecar as a child process: for ``kvpool demo``, the benchmarks and the tests.

:class:`SidecarProcess` writes a settings file, starts ``python -m kvpool_sidecar``, waits
for its ``ready`` line (with a deadline; a daemon that exits early raises with its log
tail) and stops it with SIGTERM, then SIGKILL if the drain overruns.

Where ``$KVPOOL_SIDECAR_LOGS`` names a directory, each sidecar's log is copied into it when
the sidecar stops, as ``NODE-PID.log``: the benches run their sidecars in temporary
directories, and a run on a borrowed machine (``scripts/gpu_check.sh``) keeps what they said.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from kvpool_sidecar.errors import SidecarError


#: The directory (an environment variable names it) where stopped sidecars' logs are kept.
LOGS_ENV = "KVPOOL_SIDECAR_LOGS"


class SidecarProcess:
    """A sidecar daemon in a child process."""

    def __init__(self, config: dict[str, Any], *, workdir: str | os.PathLike[str] | None = None,
                 env: dict[str, str] | None = None, prefix: Sequence[str] = ()) -> None:
        #: Words before the interpreter, e.g. ``ip netns exec NAME`` for a test host.
        self.prefix = list(prefix)
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="kvpool-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        cfg = dict(config)
        api = dict(cfg.get("api") or {})
        api.setdefault("socket_path", str(self.workdir / "kvpool.sock"))
        api.setdefault("http_port", 0)
        cfg["api"] = api
        cfg.setdefault("dram", {}).setdefault("populate", False)
        self.config = cfg
        self.config_path = self.workdir / "sidecar.yaml"
        self.config_path.write_text(yaml.safe_dump(cfg))
        self.log_path = self.workdir / "sidecar.log"
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen[bytes] | None = None
        self.ready: dict[str, Any] = {}

    @property
    def socket_path(self) -> str:
        return str(self.config["api"]["socket_path"])

    @property
    def pid(self) -> int:
        if self.proc is None:
            raise SidecarError("the sidecar is not running")
        return self.proc.pid

    def start(self, timeout: float = 30.0) -> SidecarProcess:
        log = open(self.log_path, "ab")  # noqa: SIM115 - owned by the child's lifetime
        self.proc = subprocess.Popen(
            [*self.prefix, sys.executable, "-m", "kvpool_sidecar", "--config", str(self.config_path)],
            stdout=subprocess.PIPE, stderr=log, env=self.env, cwd=self.workdir,
        )
        log.close()
        if self.proc.stdout is None:
            raise SidecarError("no pipe to the sidecar's stdout")
        deadline = time.monotonic() + timeout
        line = b""
        while time.monotonic() < deadline:
            r, _, _ = select.select([self.proc.stdout], [], [], 0.1)
            if r:
                line = self.proc.stdout.readline()
                if line.startswith(b"{"):
                    self.ready = json.loads(line)
                    return self
            if self.proc.poll() is not None:
                break
        self.kill()
        self._keep_log()
        raise SidecarError(f"sidecar did not become ready (exit {self.proc.returncode}): {self.log_tail()}")

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, timeout: float = 15.0) -> int:
        """SIGTERM and wait for the drain; SIGKILL after ``timeout``. Returns the exit code."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._keep_log()
        return self.proc.returncode

    def _keep_log(self) -> None:
        """Copy the log into ``$KVPOOL_SIDECAR_LOGS`` (of the sidecar's environment) where
        that names a directory."""
        where = self.env.get(LOGS_ENV, "").strip()
        if not where or self.proc is None:
            return
        name = f"{self.config.get('node_name', 'sidecar')}-{self.proc.pid}.log"
        try:
            os.makedirs(where, exist_ok=True)
            shutil.copyfile(self.log_path, os.path.join(where, name))
        except OSError as e:  # a diagnosis aid: never the reason a run fails
            print(f"kvpool: could not keep the sidecar's log in {where}: {e}", file=sys.stderr)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> SidecarProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

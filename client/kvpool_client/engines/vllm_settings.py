"""The vLLM connector's settings (``kv_connector_extra_config``) and the vLLM settings it
refuses to start under.

:class:`ConnectorSettings` reads and checks the connector's own settings;
:func:`check_load_failure_policy` refuses a vLLM that fails the requests whose blocks did
not load. The connector itself is :class:`~kvpool_client.engines.vllm.KVPoolConnector`.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

from kvpool_client.engines.blockio import STAGE_BYTES
from kvpool_client.engines.vllm_keys import ConnectorConfigError

#: The KV cache layout the connector asks of vLLM unless ``kv_cache_layout`` says otherwise:
#: a block of every layer is one contiguous run.
DEFAULT_LAYOUT = "BLNHC"


#: The most seconds ``timeout_s`` and ``lookup_timeout_s`` may be: a socket takes no timeout
#: past about 1e9 s (larger ones, infinity among them, had failed every call with an
#: OverflowError, which is no KVPoolError), and a call of the engine's waiting longer than a
#: minute for its sidecar serves it worse than the miss it would become.
MAX_TIMEOUT_S = 60.0


@dataclass(frozen=True, slots=True)
class ConnectorSettings:
    socket_path: str
    tenant: str = "default"
    timeout_s: float = 10.0
    lookup_timeout_s: float = 1.0
    model_id: str = ""
    namespace: str = ""
    save: bool = True
    max_pending_save_bytes: int = 1 << 30
    #: Device memory a step's loads, and its saves, stage blocks in (about; see blockio).
    max_stage_bytes: int = STAGE_BYTES
    #: The operator's word that the engine's weights never change while it runs: a reset of
    #: the connector's cache (sleep mode and pauses reset it too) then leaves its pool use on.
    weights_fixed: bool = False

    @classmethod
    def from_extra(cls, extra: dict[str, Any]) -> ConnectorSettings:
        known = {"socket_path", "tenant", "timeout_s", "lookup_timeout_s", "model_id", "namespace", "save",
                 "max_pending_save_bytes", "max_stage_bytes", "kv_cache_layout", "weights_fixed"}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ConnectorConfigError(f"unknown kv_connector_extra_config keys for KVPoolConnector: {unknown}")
        for flag in ("save", "weights_fixed"):  # (bool("false") is True)
            if not isinstance(extra.get(flag, False), bool):
                raise ConnectorConfigError(f"{flag} must be true or false")
        try:
            out = cls(
                socket_path=str(extra.get("socket_path") or os.environ.get("KVPOOL_SOCKET_PATH")
                                or "/run/kvpool/kvpool.sock"),
                tenant=str(extra.get("tenant", "default")),
                timeout_s=float(extra.get("timeout_s", 10.0)),
                lookup_timeout_s=float(extra.get("lookup_timeout_s", 1.0)),
                model_id=str(extra.get("model_id", "")),
                namespace=str(extra.get("namespace", "")),
                save=extra.get("save", True),
                max_pending_save_bytes=int(extra.get("max_pending_save_bytes", 1 << 30)),
                max_stage_bytes=int(extra.get("max_stage_bytes", STAGE_BYTES)),
                weights_fixed=extra.get("weights_fixed", False),
            )
        except (TypeError, ValueError) as e:
            raise ConnectorConfigError(f"bad kv_connector_extra_config for KVPoolConnector ({sorted(extra)}): {e}") from e
        if out.max_stage_bytes <= 0 or out.max_pending_save_bytes <= 0:
            raise ConnectorConfigError("max_stage_bytes and max_pending_save_bytes must be positive "
                                       "(save: false turns saving off)")
        for name in ("timeout_s", "lookup_timeout_s"):  # (a negative, NaN or huge one failed every call, raising)
            seconds = getattr(out, name)
            if isinstance(extra.get(name), bool) or not (math.isfinite(seconds) and 0 < seconds <= MAX_TIMEOUT_S):
                raise ConnectorConfigError(f"{name} must be a finite number of seconds above 0 and at most "
                                           f"{MAX_TIMEOUT_S:g}, got {extra.get(name)!r}")
        return out


def check_load_failure_policy(kv_transfer_config: Any) -> None:
    """Refuse a vLLM that fails a request whose blocks did not load (``kv_load_failure_policy``
    other than ``recompute``: vLLM's default is ``fail``). A block evicted between the lookup
    and the load, or a sidecar that stops, is a load failure the connector counts on vLLM to
    recompute. A vLLM without the setting (older ones) always recomputed."""
    policy = getattr(kv_transfer_config, "kv_load_failure_policy", None)
    if policy is not None and str(policy) != "recompute":
        raise ConnectorConfigError(
            "KVPoolConnector needs vLLM to recompute blocks that fail to load (a block evicted between the lookup "
            f"and the load, a sidecar that stopped), but kv_load_failure_policy is {policy!r}, which fails the "
            "user's request instead: set kv_load_failure_policy: recompute (\"kv_load_failure_policy\": "
            "\"recompute\" in --kv-transfer-config)")


__all__ = ["DEFAULT_LAYOUT", "MAX_TIMEOUT_S", "ConnectorSettings", "check_load_failure_policy"]

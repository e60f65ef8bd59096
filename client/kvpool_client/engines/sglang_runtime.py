"""What the SGLang HiCache backend reads of the SGLang process it runs in, and what that adds
to its pages' fingerprint.

SGLang's runtime context (its server arguments, the config bags it resolved, the weights'
version), its version and the platform's fp8 type, read where the storage config does not
say: the model's source (:func:`model_source`), what changes its KV under one name
(:data:`WEIGHT_ARGS`, :func:`engine_weights`), what a page's values mean (:func:`engine_kv`),
the LoRA adapters it starts with (:func:`engine_adapters`), a speculative draft whose layers
the pages hold (:data:`DRAFT_ARGS`, :func:`engine_draft`), whether each backup passes its
prefix (:func:`prefix_keys_passed`) and the version of the weights it runs now
(:func:`weight_version`). The backend is
:class:`~kvpool_client.engines.sglang.KVPoolHiCacheStorage`; the fingerprint and the keys are
:mod:`~kvpool_client.engines.sglang_keys`.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from kvpool_client.engines.sglang_keys import (
    SGLangConfigError,
    StorageSettings,
    adapters_identity,
    kv_values,
    start_adapters,
)
from kvpool_client.engines.weights import load_format_tag, weights_identity

#: The backend's logger (these are its messages).
logger = logging.getLogger("kvpool_client.engines.sglang")


def engine_version() -> str:
    """The version of SGLang this process runs."""
    from sglang.version import __version__

    return str(__version__)


#: The server arguments that change a model's KV under the same name: its weights'
#: quantization (and ModelOpt's, applied as it loads, or restored from a checkpoint of its
#: own, and FlashRL's profile), its KV scales, its config overrides (rope scaling among them,
#: and a decrypted config in place of the model's), its weights' revision, a loader of the
#: user's own and its loader's settings, the dtype it computes in (which the page dtype does
#: not say where ``--kv-cache-dtype`` is set apart), the implementation of the model it runs,
#: and the version of the weights it starts with.
WEIGHT_ARGS = ("quantization", "modelopt_quant", "modelopt_checkpoint_restore_path", "quantization_param_path",
               "json_model_override_args", "revision", "custom_weight_loader", "weight_version", "dtype",
               "rl_quant_profile", "model_impl", "model_loader_extra_config", "decrypted_config_file")
#: What names a speculative draft model whose layers the host pool packs into its pages (an
#: MTP or EAGLE draft's KV is stored beside the target's): its algorithm, the draft's path
#: (its files key it, as the target's), revision, quantization, load format and config.
DRAFT_ARGS = ("speculative_algorithm", "speculative_draft_model_path", "speculative_draft_model_revision",
              "speculative_draft_model_quantization", "speculative_draft_load_format", "decrypted_draft_config_file")
#: Settings that are JSON text: compared by their content, not their spelling.
_JSON_ARGS = ("json_model_override_args", "model_loader_extra_config")


def weight_version() -> str | None:
    """The version of the weights SGLang runs now, as its runtime context says (a weight
    update moves it); None where it cannot be read."""
    try:
        from sglang.srt.runtime_context import get_serving

        return str(get_serving().weight_version)
    except (ImportError, AttributeError, LookupError, ValueError, RuntimeError):
        return None


def _server_args() -> Any | None:
    """SGLang's server arguments, as its runtime context holds them in a scheduler process
    (None where the context is not set in this process)."""
    try:
        from sglang.srt.runtime_context import get_server_args

        return get_server_args()
    except (ImportError, AttributeError, LookupError, ValueError, RuntimeError):
        return None


def _resolved(args: Any, bag: str, name: str) -> Any:
    """What SGLang resolved for the server argument ``name``: the published config bag
    ``bag`` it runs with (a model's hooks may change ``--kv-cache-dtype``, and parsing turns
    ``--lora-paths`` into records), else the resolution recorded on ``args``, else the raw
    argument."""
    try:
        from sglang.srt import runtime_context

        return getattr(getattr(runtime_context, "get_" + bag)(), name)
    except (ImportError, AttributeError, LookupError, ValueError, RuntimeError):
        pass
    try:
        from sglang.srt.arg_groups.overrides import resolution_result

        return resolution_result(args, name, getattr(args, name, None))
    except (ImportError, AttributeError, LookupError, ValueError, TypeError):
        return getattr(args, name, None)


def _platform_fp8() -> str:
    """The platform's fp8 e4m3 type as SGLang picks it (``float8_e4m3fnuz`` on ROCm MI300)."""
    try:
        from sglang.kernels.ops.quantization.fp8_kernel import fp8_dtype

        return str(fp8_dtype)
    except (ImportError, AttributeError, RuntimeError, OSError):
        import torch

        hip = getattr(torch.version, "hip", None)
        return f"rocm-{hip}-unknown" if hip else str(torch.float8_e4m3fn)


def engine_kv(page_dtype: str) -> str:
    """What the fingerprint says of a page's values where its dtype does not
    (:func:`~kvpool_client.engines.sglang_keys.kv_values`)."""
    args = _server_args()
    kv = None if args is None else _resolved(args, "model", "kv_cache_dtype")
    return kv_values(page_dtype, str(kv) if kv else None, _platform_fp8)


def engine_adapters(settings: StorageSettings) -> str:
    """The fingerprint's ``lora`` entry: "" with LoRA off (or the runtime context not set,
    which :func:`engine_weights` warns of), else the identity of the adapters SGLang loads
    at start; refuses LoRA kvpool cannot key safely
    (:func:`~kvpool_client.engines.sglang_keys.adapters_identity`)."""
    args = _server_args()
    if args is None:
        return ""
    enabled, paths = _resolved(args, "lora", "enable_lora"), _resolved(args, "lora", "lora_paths")
    # as SGLang reads them: --lora-paths turn LoRA on unless --enable-lora says false
    if not (enabled or (enabled is None and paths)):
        return ""
    return adapters_identity(start_adapters(paths), settings)


def engine_weights(settings: StorageSettings) -> str:
    """What SGLang runs the model with that changes its KV (:data:`WEIGHT_ARGS`, and a load
    format that does not read the checkpoint's own weights), as its runtime context says.
    Where the context is not set in this process, refused unless ``model_id`` names the
    weights: the name SGLang gives the backend is its served name, which two fine-tunes
    often share, and quantized weights, overrides and adapters would not be seen."""
    args = _server_args()
    if args is None:
        if not settings.model_id:
            raise SGLangConfigError("kvpool HiCache backend: SGLang's server arguments cannot be read in this process, "
                                    "so nothing tells which weights, quantization, overrides or LoRA adapters the "
                                    "model runs with: set model_id in --hicache-storage-backend-extra-config to a name "
                                    "that changes whenever any of them does (and do not enable LoRA)")
        logger.warning("kvpool HiCache backend: SGLang's server arguments cannot be read here: the model is keyed "
                       "by model_id alone; quantized weights, config overrides and LoRA adapters are not seen")
        return ""
    weights = ";".join(f"{name}={_spelled(name, getattr(args, name, None))!r}" for name in WEIGHT_ARGS)
    load = load_format_tag(getattr(args, "load_format", None))
    return f"{weights};load_format={load!r}" if load else weights


def model_source() -> tuple[str, str, str | None]:
    """The path (or hub name) SGLang loaded the model from, its ``--revision`` and its
    ``--download-dir`` (the hub cache a hub name's snapshot is in; None: the hub library's
    default). SGLang names the model to its storage backend by ``--served-model-name`` where
    one is given, and two deployments of different fine-tunes are often served under one
    name: the path's files tell them apart."""
    args = _server_args()
    if args is None:
        return "", "", None
    return (str(getattr(args, "model_path", None) or ""), str(getattr(args, "revision", None) or ""),
            _download_dir(args))


def _download_dir(args: Any) -> str | None:
    return str(getattr(args, "download_dir", None) or "") or None


def engine_draft(pool: Any, settings: StorageSettings) -> str:
    """What the fingerprint adds where the host pool packs a speculative draft model's layers
    into its pages (``layer_num`` past ``target_layer_num``): the draft's :data:`DRAFT_ARGS`
    and its files (a local path's, or a hub name's snapshot), "" where it packs none. Two
    engines of one target with other drafts had shared those pages. Refused where the
    draft's files cannot be found, unless ``model_id`` names the weights."""
    layers, target = getattr(pool, "layer_num", None), getattr(pool, "target_layer_num", None)
    if not (isinstance(layers, int) and isinstance(target, int) and layers > target):
        return ""
    args = _server_args()
    if args is None:  # (refused unless model_id names the weights: engine_weights)
        return ""
    spec = {name: _resolved(args, "spec", name) for name in DRAFT_ARGS}
    path = str(spec["speculative_draft_model_path"] or "")
    revision = str(spec["speculative_draft_model_revision"] or "")
    files = "" if settings.model_id or not path else weights_identity(path, revision, _download_dir(args))
    if not files and not settings.model_id:
        raise SGLangConfigError(f"the host pool stores the layers of a speculative draft model ({layers - target} of "
                                f"{layers}) in every page, and kvpool cannot tell which weights the draft "
                                f"{path or '(no --speculative-draft-model-path)'!r} holds (no local path, no "
                                "snapshot of it in the hub cache): set model_id in "
                                "--hicache-storage-backend-extra-config to a name that changes whenever the target's "
                                "or the draft's weights do")
    named = ";".join(f"{name}={value if value is None else str(value)!r}" for name, value in spec.items())
    return f"draft=({named};files={files!r})"


def _prefix_keys_passed(args: Any) -> bool | None:
    """Whether the launch's ``--hicache-storage-backend-extra-config`` turns on
    ``hicache_storage_pass_prefix_keys`` (SGLang takes it out of the config before the
    backend sees it); None where that cannot be told (no such config, or a file)."""
    raw = _resolved(args, "memory", "hicache_storage_backend_extra_config")
    if not isinstance(raw, str) or not raw or raw.startswith("@"):
        return None
    try:
        config = json.loads(raw)
    except ValueError:
        return None
    return config.get("hicache_storage_pass_prefix_keys") is True if isinstance(config, dict) else None


def _spelled(name: str, value: Any) -> Any:
    """One spelling of an argument: a JSON setting's keys sorted (two nodes that write the
    same overrides in another order, or spacing, derive the same keys)."""
    if name not in _JSON_ARGS or not isinstance(value, str):
        return value
    try:
        return json.dumps(json.loads(value or "{}"), sort_keys=True)
    except ValueError:
        return value


def prefix_keys_passed() -> bool | None:
    """Whether the launch's ``--hicache-storage-backend-extra-config`` turns on
    ``hicache_storage_pass_prefix_keys`` (:func:`_prefix_keys_passed`); None where that
    cannot be told (no such config, a file, or no server arguments in this process)."""
    args = _server_args()
    return None if args is None else _prefix_keys_passed(args)


__all__ = ["DRAFT_ARGS", "WEIGHT_ARGS", "engine_adapters", "engine_draft", "engine_kv", "engine_version",
           "engine_weights", "model_source", "prefix_keys_passed", "weight_version"]

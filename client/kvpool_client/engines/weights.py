"""What tells apart the weights an engine loaded from a local path.

An engine names its model by what it was given: a hub name (with a revision) or a path. In
Kubernetes the path is often the same mount (``/model``) in every deployment, whatever
fine-tune it holds: keyed by the path alone, two deployments serving different weights of
one architecture would read each other's KV, whose checksums are right and whose values are
wrong. So where a model is a local path and no ``model_id`` vouches for its weights, the key
also carries :func:`local_weights_identity`, a digest of the path's weight and config files
made of their bytes alone (never their times or where they lie), so that every node and
every rank of an instance, holding copies of the same files, agree on it:

- files up to :data:`SMALL_FILE` (configs, tokenizers) count by all their bytes;
- larger ones (the weights) by their size and pieces of :data:`SAMPLE_BYTES` read at
  evenly spaced places, at most :data:`MOST_SAMPLES` pieces a file and
  :data:`TOTAL_SAMPLES` in all (256 MiB read at start at most). Two fine-tunes that differ
  in a share ``f`` of their bytes read alike in every piece with a probability of about
  ``(1 - f) ** pieces``: below 1e-7 for ``f`` of 1% in a file read in 1,024 pieces. Weights
  that differ in fewer bytes than that (a fine-tune of the layer norms alone) may share
  keys: ``model_id`` is the way to name them apart.

A hub name is keyed by the commit of the snapshot of it the node's hub cache holds
(:func:`weights_identity`), and a LoRA adapter by its path's files, read again when they
change (:class:`AdapterIdentities`).
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import stat
from collections.abc import Hashable

logger = logging.getLogger(__name__)

#: Files whose change changes the KV the model computes: weights, configs, tokenizers, and the
#: model's own code (``trust_remote_code`` runs the directory's ``modeling_*.py``).
SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".json", ".model", ".tiktoken", ".txt", ".py")
#: Entries of a directory read at most: past them it has no identity (logged), as a hub name.
MAX_ENTRIES = 65536
#: Files up to this size count by all their bytes.
SMALL_FILE = 1 << 20
#: A larger file counts by pieces of this size ...
SAMPLE_BYTES = 16 << 10
#: ... at most this many of one file ...
MOST_SAMPLES = 1024
#: ... and this many of all the files together (each large file gets its share, at least 16).
TOTAL_SAMPLES = 16384


def _small(path: str) -> bytes:
    with open(path, "rb") as f:
        return hashlib.blake2b(f.read(SMALL_FILE + 1), digest_size=16).digest()


def _sampled(path: str, size: int, pieces: int) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    fd = os.open(path, os.O_RDONLY)
    try:
        last = size - SAMPLE_BYTES
        for i in range(pieces):
            h.update(os.pread(fd, SAMPLE_BYTES, last * i // (pieces - 1)))
    finally:
        os.close(fd)
    return h.digest()


def _files(path: str) -> list[tuple[str, str]] | None:
    """``(name, path)`` of the files that count, sorted by name; None where there are too many
    entries to read."""
    if os.path.isfile(path):
        return [(os.path.basename(path), path)]
    out: list[tuple[str, str]] = []
    with os.scandir(path) as entries:
        for n, entry in enumerate(entries):
            if n >= MAX_ENTRIES:
                logger.warning("kvpool: %s holds more than %d entries: its files are not part of the model's "
                               "key; set model_id to name its weights", path, MAX_ENTRIES)
                return None
            if entry.name.endswith(SUFFIXES) and entry.is_file():  # (through a hub cache's symlinks)
                out.append((entry.name, entry.path))
    return sorted(out)


def local_weights_identity(path: str) -> str:
    """A digest (hex) of the weight and config files of ``path`` (a model directory, or one
    weights file) from their names, sizes and bytes (see the module); ``""`` where ``path``
    is not a local file or directory (a hub name) or cannot be read."""
    if not path or not os.path.exists(path):
        return ""
    try:
        files = _files(path)
        if files is None:
            return ""
        sizes = [os.stat(p).st_size for _, p in files]
        large = sum(1 for n in sizes if n > SMALL_FILE)
        pieces = min(MOST_SAMPLES, max(16, TOTAL_SAMPLES // max(1, large)))
        h = hashlib.blake2b(digest_size=16, person=b"kvpool-weights")
        for (name, p), size in zip(files, sizes):
            what = _small(p) if size <= SMALL_FILE else _sampled(p, size, pieces)
            h.update(name.encode("utf-8", "surrogateescape") + b"\0" + str(size).encode() + b"\0" + what)
    except OSError as e:
        logger.warning("kvpool: cannot read the files of %s (%s): they are not part of the model's key", path, e)
        return ""
    return h.hexdigest()


#: A hub repository's name (``org/name`` or ``name``), and a commit.
_REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?")
_COMMIT = re.compile(r"[0-9a-f]{40}")


def hub_commit(name: str, revision: str = "", cache_dir: str | None = None) -> str:
    """The commit of ``name`` at ``revision`` (a branch, a tag or a commit; ``main`` if none)
    whose snapshot the local Hugging Face cache holds (``cache_dir``, else the hub's
    default), as the hub library lays it out (``models--org--name/refs/<revision>`` naming
    ``snapshots/<commit>``); ``""`` where it holds none. Only the cache's references are
    read: not the snapshot's files (an engine downloads only those it loads, so two nodes
    at one commit hold different ones), and nothing is downloaded."""
    rev = revision or "main"
    if not _REPO_ID.fullmatch(name) or ".." in name or ".." in rev.split("/") or rev.startswith("/"):
        return ""
    if cache_dir is None:
        try:
            from huggingface_hub import constants
        except ImportError:
            return ""
        cache_dir = str(constants.HF_HUB_CACHE)
    root = os.path.join(cache_dir, "models--" + name.replace("/", "--"))
    commit = rev
    if not _COMMIT.fullmatch(rev):
        try:  # a plain file, as the hub library writes refs (a FIFO there would hang the engine's start)
            fd = os.open(os.path.join(root, "refs", rev), os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
            try:
                commit = os.read(fd, 64).decode("ascii").strip() if stat.S_ISREG(os.fstat(fd).st_mode) else ""
            finally:
                os.close(fd)
        except (OSError, ValueError):
            return ""
    return commit if _COMMIT.fullmatch(commit) and os.path.isdir(os.path.join(root, "snapshots", commit)) else ""


def weights_identity(name: str, revision: str = "", cache_dir: str | None = None) -> str:
    """What names the weights an engine loads as ``name``: a local path's
    :func:`local_weights_identity`; for a hub name, ``hub:<commit>`` of the snapshot the
    local Hugging Face cache holds (:func:`hub_commit`), which a node that downloaded the
    name before its repository changed holds at another commit, the same on every node and
    process that loads that commit; ``""`` where neither is there."""
    if not name or os.path.exists(name):
        return local_weights_identity(name)
    commit = hub_commit(name, revision, cache_dir)
    if not commit:
        logger.info("kvpool: no local snapshot of %s: its name and revision key it alone", name)
    return "hub:" + commit if commit else ""


#: Load formats that read a checkpoint's own weights as they are: an engine that loads with one
#: of them computes the KV another computes with any other of them. Any other format (random
#: ``dummy`` weights, a quantizing ``bitsandbytes`` or ``gguf`` load, a format this list does not
#: know) goes into the key, so that its KV never meets the checkpoint's.
SAME_WEIGHTS_FORMATS = frozenset({"auto", "pt", "safetensors", "npcache", "fastsafetensors", "instanttensor",
                                  "runai_streamer", "runai_streamer_sharded", "sharded_state", "mistral", "remote"})


def load_format_tag(load_format: object) -> str:
    """What the engine's load format adds to a model's key: ``""`` for the formats of
    :data:`SAME_WEIGHTS_FORMATS` (and none given), else its name."""
    name = str(getattr(load_format, "value", load_format) or "").strip().lower()
    return "" if name in SAME_WEIGHTS_FORMATS or name in ("", "none") else name


def _stamp(path: str) -> tuple[tuple[str, int, int, int, int], ...] | None:
    """The names, sizes, inodes and change times of the files of ``path`` that count: an
    adapter rewritten in place, or replaced by another, changes it (the inode change time
    moves with every write, and a copy that keeps its source's modification time cannot set it)."""
    try:
        files = _files(path)
        if files is None:
            return None
        stats = [(name, os.stat(p)) for name, p in files]
    except OSError:
        return None
    return tuple((name, st.st_size, st.st_ino, st.st_mtime_ns, st.st_ctime_ns) for name, st in stats)


class AdapterIdentities:
    """:func:`local_weights_identity` of adapters (LoRA), pinned per adapter for the engine's
    life: an engine names an adapter by its name and path, and the same path can hold other
    weights on another deployment, or after an update in place.

    An engine loads an adapter's weights once per adapter id and keeps them (vLLM reloads
    only for a new id, or a request that asks it to), so the identity is read when an
    adapter is first seen and kept. Where the files under its path change after that
    (:func:`_stamp`), nobody outside the engine knows which weights it runs with now: the
    adapter is :attr:`changed`, and :meth:`pin` answers None for it from then on (its
    requests neither load nor save) until the engine restarts. An adapter given by a hub
    name gets None as well: the engine downloads the newest commit when it first loads it,
    after the scheduler keyed its first requests, so no file here says which weights it runs
    (its name alone had keyed nodes at two commits alike). At most :attr:`most`
    adapters are pinned; past them, None as well."""

    def __init__(self, most: int = 65536) -> None:
        self.most = most
        self._pinned: dict[Hashable, tuple[object, str]] = {}
        #: adapters whose files changed after they were pinned
        self.changed: set[Hashable] = set()

    def pin(self, adapter: Hashable, path: str) -> str | None:
        """The identity (hex) of ``adapter``'s files under ``path`` as first seen, or None
        (see the class)."""
        if adapter in self.changed:
            return None
        stamp = _stamp(path) if path and os.path.exists(path) else None
        known = self._pinned.get(adapter)
        if known is None:
            if len(self._pinned) >= self.most:
                return None
            if stamp is None:
                return None  # (a hub name: see the class; asked again with its next request, unpinned)
            identity = local_weights_identity(path)
            self._pinned[adapter] = (stamp, identity)
            return identity
        if known[0] != stamp:
            self.changed.add(adapter)
            logger.warning("kvpool: the files of LoRA adapter %s changed under a running engine, which may still "
                           "run their earlier weights: its requests use no pool blocks until the engine restarts",
                           path)
            return None
        return known[1]


__all__ = ["SAME_WEIGHTS_FORMATS", "AdapterIdentities", "load_format_tag", "local_weights_identity",
           "weights_identity"]

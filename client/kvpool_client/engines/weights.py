"""What tells apart the weights an engine loaded from a local directory.

An engine names its model by what it was given: a hub name (with a revision) or a path. In
Kubernetes the path is often the same mount (``/model``) in every deployment, whatever
fine-tune it holds: keyed by the path alone, two deployments serving different weights of
one architecture would read each other's KV, whose checksums are right and whose values are
wrong. So where a model is a local directory and no ``model_id`` vouches for its weights,
the key also carries :func:`local_weights_identity`: a digest of the directory's weight and
config files, the small ones (configs, tokenizers) by their bytes, the large ones by name,
size and modification time (reading many gigabytes at every start would cost more than it
saves; a fine-tune of the same architecture has the same sizes, but not the same times).
Nodes that copied the same weights at different times, or a pod that copies them afresh at
every start, then share nothing until ``model_id`` names the weights.
"""

from __future__ import annotations

import hashlib
import os

#: Files whose change changes the KV the model computes: weights, configs, tokenizers.
SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".json", ".model", ".tiktoken", ".txt")
#: Entries of one directory read at most (a directory of more is described by these).
MAX_ENTRIES = 4096
#: Files up to this size count by their bytes; larger ones by their size and time.
SMALL_FILE = 1 << 20


def local_weights_identity(path: str) -> str:
    """A digest (hex) of the weight and config files directly in directory ``path``: each
    one's name and size, and its bytes (up to :data:`SMALL_FILE`) or its modification time
    in nanoseconds; ``""`` where ``path`` is not a local directory (a hub name) or cannot be
    read."""
    if not path or not os.path.isdir(path):
        return ""
    rows: list[str] = []
    try:
        with os.scandir(path) as entries:
            for n, entry in enumerate(entries):
                if n >= MAX_ENTRIES:
                    break
                if not entry.name.endswith(SUFFIXES):
                    continue
                try:
                    st = entry.stat()  # through a symlink (a hub cache's snapshot links its blobs)
                    if st.st_size <= SMALL_FILE:
                        with open(entry.path, "rb") as f:
                            what = hashlib.blake2b(f.read(SMALL_FILE + 1), digest_size=16).hexdigest()
                    else:
                        what = f"t{st.st_mtime_ns}"
                except OSError:
                    continue
                rows.append(f"{entry.name}\0{st.st_size}\0{what}")
    except OSError:
        return ""
    h = hashlib.blake2b(digest_size=16, person=b"kvpool-weights")
    for row in sorted(rows):
        h.update(row.encode("utf-8", "surrogateescape") + b"\n")
    return h.hexdigest()


__all__ = ["local_weights_identity"]

"""The bounds on a local client's request frame: how large it may be and how much it may
decode into, before the client said HELLO (a stranger's frame, decoded before anything is
known of it, stays small) and after (a full batch of puts with their engine identities
fits, a decode bomb does not). :class:`~kvpool_sidecar.api.connection.LocalConnection`
applies them as it takes frames off its buffer.
"""

from __future__ import annotations

from kvpool_sidecar.api.blockinfo import MAX_EXTRA_KEYS

__all__ = ["MAX_MAP_ITEMS", "NUMBERS_PER_BATCH_KEY", "OBJECTS_PER_BATCH_ITEM", "PRE_HELLO_FRAME_BYTES",
           "PRE_HELLO_OBJECTS"]

#: The largest frame read from a client that has not said HELLO (a HELLO is a version, a
#: tenant name and a token: well under this). A stranger's frame is decoded before anything
#: else is known of it, so it must stay small: a few MiB of msgpack decode into millions of
#: objects and stall the event loop for seconds.
PRE_HELLO_FRAME_BYTES = 16 << 10

#: The most objects (lists, maps, their items) a frame before HELLO may decode into: a HELLO
#: is a list of five. 16 KiB of empty lists had held the loop 1.2 ms a frame, from clients
#: that need no token.
PRE_HELLO_OBJECTS = 16

#: The most entries a map of a request may hold (hints and engine identities have a few).
MAX_MAP_ITEMS = 64

#: The numbers one frame may hold in lists of more than 16 (a block's tokens), per key of a
#: full batch: a put of ``api.max_batch`` blocks of 256 tokens each, with their engine
#: identities, fits (real engines' blocks are 16 to 64 tokens). 56 MiB of token ids had
#: decoded into 503 MiB and held the loop for 0.9 s.
NUMBERS_PER_BATCH_KEY = 256

#: Objects a frame may hold per block of a full batch (see ``LocalConnection._max_objects``
#: in :mod:`~kvpool_sidecar.api.connection`): a put with engine identities of as many extra
#: keys as an identity may have (``MAX_EXTRA_KEYS``) fits. A frame of ``api.max_batch``
#: (4,096) times this many short strings decodes in about 0.15 s on the development machines.
OBJECTS_PER_BATCH_ITEM = 17 + MAX_EXTRA_KEYS

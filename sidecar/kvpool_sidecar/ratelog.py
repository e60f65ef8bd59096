"""One log line per cause per minute, however many clients or peers hit it.

A flood (refused connections, strangers that never authenticate, forged handshakes) must
not become a flood of log lines: the first occurrence is logged, the rest of the minute
is counted and the count goes with the next line.
"""

from __future__ import annotations

import logging
import time

_last: dict[str, float] = {}
_skipped: dict[str, int] = {}
#: Causes remembered at most: some name what others wrote (a node's name in Redis), so their
#: number is not ours to bound; past it the memory starts again (a cause may log early once).
MAX_CAUSES = 4096


def warn_once(logger: logging.Logger, cause: str, msg: str, *args: object, every_s: float = 60.0) -> None:
    """``logger.warning(msg, *args)`` at most once per ``every_s`` for ``cause``."""
    now = time.monotonic()
    if now - _last.get(cause, -every_s) < every_s:
        _skipped[cause] = _skipped.get(cause, 0) + 1
        return
    if len(_last) >= MAX_CAUSES:
        _last.clear()
        _skipped.clear()
    _last[cause] = now
    skipped = _skipped.pop(cause, 0)
    if skipped:
        logger.warning(msg + " (and %d more like it in the last %.0f s)", *args, skipped, every_s)
    else:
        logger.warning(msg, *args)

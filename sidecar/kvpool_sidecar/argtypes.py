"""argparse types for the numbers the ``kvpool`` command takes: each checked as it is parsed,
so that a bad one is a line naming its option (exit 2), not a traceback from deep inside."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


def count(least: int) -> Callable[[str], int]:
    """A whole number of at least ``least``."""
    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"wants a whole number, not {text!r}") from None
        if n < least:
            raise argparse.ArgumentTypeError(f"wants a whole number of at least {least}, not {n}")
        return n
    return parse


def finite(zero: bool) -> Callable[[str], float]:
    """A finite number above 0, or of at least 0 where ``zero``."""
    least = "of at least 0" if zero else "above 0"

    def parse(text: str) -> float:
        try:
            x = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"wants a number, not {text!r}") from None
        if not (0 <= x < math.inf) or (x == 0 and not zero):
            raise argparse.ArgumentTypeError(f"wants a finite number {least}, not {text}")
        return x
    return parse

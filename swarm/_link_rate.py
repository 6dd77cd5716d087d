"""Link rates as people write them: ``20mbit``, ``100mbit``, ``2.5MB/s``.

A home link is sold in bits per second and a download window shows bytes per
second, so both are accepted; what comes out is always bytes per second, the
unit the averager works in (``AveragerConfig.upload_rate``). Bits are written
the way ``tc`` writes them (``kbit``, ``mbit``, ``gbit``, optionally with
``/s``); bytes with a capital ``B`` and ``/s`` (``kB/s`` or ``KB/s``, ``MB/s``, ``GB/s``).
Prefixes are decimal (a megabit is 10**6 bits), as providers count. Forms that
people read both ways (``mbps``, ``Mb/s``, ``MBps``) are refused rather than
guessed: a factor of eight the wrong way would pace a link at an eighth of
its speed, or eight times past it.
"""

from __future__ import annotations

import math
import re

from ._errors import ConfigError

__all__ = ["parse_link_rate"]

_RATE = re.compile(
    r"(?P<number>[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*"
    r"(?:(?P<bits>[kmgKMG]?)bit(?:/s)?|(?P<bytes>[kKMG]?)B/s)"
)
_PREFIX = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9}


def parse_link_rate(text: str) -> float:
    """Bytes per second of a rate such as ``20mbit``, ``1.5gbit/s`` or ``2.5MB/s``.

    Raises ``ConfigError`` naming the accepted forms for anything else,
    including a rate that is not positive and finite.
    """
    match = _RATE.fullmatch(text.strip())
    if match is None:
        raise ConfigError(
            f"rate {text!r} is not a rate such as 20mbit, 1.5gbit or 2.5MB/s (bits as "
            "kbit/mbit/gbit, bytes as kB/s, MB/s, GB/s)"
        )
    number = float(match["number"])
    if match["bits"] is not None:
        rate = number * _PREFIX[match["bits"].lower()] / 8
    else:
        rate = number * _PREFIX[match["bytes"].lower()]
    if not (math.isfinite(rate) and rate > 0):
        raise ConfigError(f"rate {text!r} must be positive and finite")
    return rate

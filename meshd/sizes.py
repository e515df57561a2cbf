"""Human byte sizes: ``parse_size("4GiB") == 4 * 2**30`` and back.

Used by ``meshd join --memory 4GiB`` and by the assignment planner's
messages. Grammar (case-insensitive, spaces between number and unit allowed)::

    size  := number [unit]
    number:= digits ["." digits]             (no sign, no exponent)
    unit  := "b" | "k"|"kb" | "m"|"mb" | "g"|"gb" | "t"|"tb"      powers of 1000
           | "ki"|"kib" | "mi"|"mib" | "gi"|"gib" | "ti"|"tib"    powers of 1024

Decimal units follow SI ("4GB" is 4e9 bytes) and binary ones IEC, like
Kubernetes quantities; a bare number is bytes. Fractions are rounded down to
whole bytes. Anything else raises ``SizeError`` (a ``ValueError`` too, so
argparse ``type=parse_size`` prints a clean usage error).
"""
from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

from meshd.errors import SizeError

# 1 PiB: beyond any home machine's memory; keeps sizes inside int64/uint64.
MAX_SIZE_BYTES = 1 << 50
# A size written by a human is short; refuse to regex-scan anything longer.
MAX_SIZE_TEXT = 32

_UNITS: dict[str, int] = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6,
    "g": 10**9, "gb": 10**9, "t": 10**12, "tb": 10**12,
    "ki": 2**10, "kib": 2**10, "mi": 2**20, "mib": 2**20,
    "gi": 2**30, "gib": 2**30, "ti": 2**40, "tib": 2**40,
}
_SIZE_RE = re.compile(r"([0-9]+(?:\.[0-9]+)?)[ \t]*([a-z]*)", re.ASCII)


def parse_size(text: str) -> int:
    """Bytes denoted by a human size such as ``"4GiB"``, ``"512 MB"``, ``"1.5gi"``."""
    if not isinstance(text, str):
        raise SizeError(f"a size must be text, got {type(text).__name__}")
    if len(text) > MAX_SIZE_TEXT:
        raise SizeError(f"size {text[:MAX_SIZE_TEXT]!r}... is longer than {MAX_SIZE_TEXT} characters")
    match = _SIZE_RE.fullmatch(text.strip().lower()) if text.isascii() else None
    if match is None or match.group(2) not in _UNITS:
        raise SizeError(f"cannot read {text!r} as a size; write e.g. 4GiB, 512MiB, 8GB or 1073741824")
    try:
        value = int(Decimal(match.group(1)) * _UNITS[match.group(2)])
    except InvalidOperation as exc:  # pragma: no cover - the regex admits only plain decimals
        raise SizeError(f"cannot read {text!r} as a size") from exc
    if value > MAX_SIZE_BYTES:
        raise SizeError(f"{text!r} is more than {format_size(MAX_SIZE_BYTES)}; is the unit right?")
    return value


def format_size(n: int) -> str:
    """Shortest binary rendering: 4294967296 -> "4GiB", 1536 -> "1.5KiB"."""
    if n < 0:
        raise SizeError(f"negative size {n}")
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            if n % scale == 0:
                return f"{n // scale}{unit}"
            return f"{n / scale:.2f}".rstrip("0").rstrip(".") + unit
    return f"{n}B"

"""What a long-running node writes to its log: one filter on the one stderr handler.

``RepeatFilter`` sits on the handler ``setup_logging`` installs, so it sees every record that
reaches the user, ours and the libraries' alike (a filter on a logger would miss the records its
children propagate). For each record it:

* fills an empty reason: an exception argument whose text is empty (py-libp2p logs
  ``"Failed to read DHT message from stream: %s"`` with such exceptions, 20+ times a second on
  a busy relay) is shown by its type name; a message still ending in ``:`` gets
  ``(no reason given)``;
* lets at most one record per ``REPEAT_INTERVAL_S`` through per kind of message, and tells the
  count of those it held back on the next one it lets through. A kind is the logger, the level
  and the text with peer ids, addresses and numbers blanked, because the library formats peer
  ids into its messages (one flood from many peers is still one kind).

DEBUG records pass untouched: whoever asked for them (``-vv``) wants every line.

State: per kind, when its last record went out and how many were held back since; at most
``MAX_KINDS`` kinds (the least recently emitted is forgotten first), so a stream of distinct
messages cannot grow it. The clock is injectable for tests.
"""
from __future__ import annotations

import logging
import re
import time
from collections import OrderedDict
from collections.abc import Callable

__all__ = ["RepeatFilter", "REPEAT_INTERVAL_S", "MAX_KINDS", "kind_of"]

# One line per second per kind of message keeps a flood readable (and a relay's log small: the
# 20-27 lines a second of one library warning become 1) while a new kind shows at once.
REPEAT_INTERVAL_S = 1.0
# Kinds remembered; far more than the distinct warnings a node emits, small in memory.
MAX_KINDS = 1024
NO_REASON = "(no reason given)"

# Peer ids (CIDv0 Qm... and the base58 identity ids 12D3KooW... / 16Uiu2...), multiaddrs, hex and
# decimal numbers vary from line to line of one kind.
_VARYING = re.compile(r"(?:Qm|12D3Koo|16Uiu2)[1-9A-HJ-NP-Za-km-z]{20,}|(?:/[\w.-]+)+/?|0x[0-9a-f]+|\d+(?:\.\d+)?")


def kind_of(record: logging.LogRecord, message: str) -> tuple[str, int, str]:
    return record.name, record.levelno, _VARYING.sub("#", message)


def _with_reason(value: object) -> object:
    if isinstance(value, BaseException) and not str(value).strip():
        return type(value).__name__
    return value


class RepeatFilter(logging.Filter):
    def __init__(self, interval_s: float = REPEAT_INTERVAL_S, *, max_kinds: int = MAX_KINDS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.interval_s = interval_s
        self.max_kinds = max_kinds
        self.clock = clock
        self._kinds: OrderedDict[tuple[str, int, str], list] = OrderedDict()  # kind -> [last emit, held back]

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno <= logging.DEBUG:
            return True
        message = self._fill_reason(record)
        kind = kind_of(record, message)
        now = self.clock()
        seen = self._kinds.get(kind)
        if seen is not None and now - seen[0] < self.interval_s:
            seen[1] += 1
            return False
        if seen is not None and seen[1]:
            record.msg = f"{message} [{seen[1]} more like this in the last {now - seen[0]:.0f} s]"
            record.args = ()
        self._kinds[kind] = [now, 0]
        self._kinds.move_to_end(kind)
        while len(self._kinds) > self.max_kinds:
            self._kinds.popitem(last=False)
        return True

    @staticmethod
    def _fill_reason(record: logging.LogRecord) -> str:
        """The record's message with no empty reason in it (the record is rewritten to match)."""
        if isinstance(record.args, tuple) and record.args:
            record.args = tuple(_with_reason(arg) for arg in record.args)
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a malformed record is the handler's to report, as before
            return str(record.msg)
        if message.rstrip().endswith(":"):
            message = f"{message.rstrip()} {NO_REASON}"
            record.msg, record.args = message, ()
        return message

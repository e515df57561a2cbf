"""Token ids in, text deltas out: incremental detokenization with stop strings held back.

Sans-I/O (``decode`` is the tokenizer's ``ids -> str``). Two jobs:

    decode    each new token's text, from a small window of ids (not the
              whole history: O(1) per token) -- a byte-level BPE token may end
              inside a UTF-8 character, so text that ends in U+FFFD waits for
              the next token (the window keeps a little left context so
              tokenizers that drop a leading space see the same text as a
              full decode)
    stops     a client's stop strings (OpenAI ``stop``) never reach the
              client: text that could be the start of a stop string is held
              back until the next token decides; a completed stop string
              (which may span any number of tokens) ends the stream, and
              only the text before it is released

State: the ids so far, the window offsets, the held-back text, whether a
stop string was hit. ``push`` returns what may be sent now; ``finish``
releases whatever was held when the generation ended another way.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

from proto.errors import LocalError

# OpenAI accepts up to 4 stop sequences; we bound their length too.
MAX_STOPS = 4
MAX_STOP_CHARS = 256
_REPLACEMENT = "\ufffd"


def check_stops(stops: Sequence[str]) -> tuple[str, ...]:
    out = tuple(stops)
    if len(out) > MAX_STOPS:
        raise LocalError(f"at most {MAX_STOPS} stop sequences")
    for stop in out:
        if not isinstance(stop, str) or not 0 < len(stop) <= MAX_STOP_CHARS:
            raise LocalError(f"each stop sequence must be a string of 1..{MAX_STOP_CHARS} characters")
    return out


class TextStream:
    def __init__(self, decode: Callable[[list[int]], str], stops: Sequence[str] = ()) -> None:
        self._decode = decode
        self.stops = check_stops(stops)
        self._ids: list[int] = []
        self._prefix = 0      # window start: left context for the next decode
        self._read = 0        # ids whose text has been produced
        self._held = ""       # produced text not yet released (could start a stop string)
        self.stopped = False  # a stop string completed; nothing more is released
        self.text = ""        # everything released so far

    def push(self, token_id: int) -> str:
        """Add one generated token; return the text that may be sent now ("" is common)."""
        if self.stopped:
            return ""
        self._ids.append(token_id)
        before = self._decode(self._ids[self._prefix:self._read])
        after = self._decode(self._ids[self._prefix:])
        if len(after) <= len(before) or after.endswith(_REPLACEMENT):
            return ""  # no new complete character yet
        self._prefix, self._read = self._read, len(self._ids)
        return self._release(after[len(before):])

    def finish(self) -> str:
        """The generation ended (length, end-of-sequence, cancel): release what is held."""
        if self.stopped:
            return ""
        tail = ""
        if self._read < len(self._ids):  # an incomplete character at the very end: best effort
            before = self._decode(self._ids[self._prefix:self._read])
            tail = self._decode(self._ids[self._prefix:])[len(before):]
            self._read = len(self._ids)
        out, self._held = self._held + tail, ""
        self.text += out
        return out

    def _release(self, delta: str) -> str:
        buf = self._held + delta
        if not self.stops:
            self.text += buf
            self._held = ""
            return buf
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            out = buf[:min(hits)]
            self.stopped, self._held = True, ""
            self.text += out
            return out
        keep = _held_suffix(buf, self.stops)
        out, self._held = buf[:len(buf) - keep], buf[len(buf) - keep:]
        self.text += out
        return out


def _held_suffix(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of some stop string."""
    best = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:n]):
                best = n
                break
    return best

"""Incremental detokenization with stop strings, usable by the engine and the gateway."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvmesh.engine.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"
_WINDOW = 6  # tokens of left context re-decoded so merges across tokens render right


@dataclass(frozen=True)
class DetokenizeResult:
    """Text newly safe to show, and whether a stop string ended the output."""

    delta: str
    stopped_on: str | None = None


class IncrementalDetokenizer:
    """Turns output token ids into text deltas; holds back a possible partial stop string.
    `calls_from(text)`, where a reply is read for tool calls, says where its calls begin (-1:
    not yet): stop strings end the content before them, never a call's arguments."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        stop: Sequence[str] = (),
        include_stop: bool = False,
        skip_special_tokens: bool = True,
        prompt_ids: Sequence[int] = (),
        calls_from: Callable[[str], int] | None = None,
    ) -> None:
        self._tok = tokenizer
        self._stop = tuple(stop)
        self._include_stop = include_stop
        self._calls_from = calls_from
        self._calls_begun = False  # once calls begin, no stop string can end the output
        self._skip = skip_special_tokens
        # A few prompt tokens of left context, so the first output token renders as it would inline.
        self._ids: list[int] = list(prompt_ids[-_WINDOW:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.text = ""  # everything decoded so far (truncated at a stop string)
        self._emitted = 0
        self.stopped_on: str | None = None

    def push(self, token_ids: Sequence[int], final: bool = False) -> DetokenizeResult:
        if self.stopped_on is not None:
            return DetokenizeResult("", self.stopped_on)
        for token_id in token_ids:
            self._ids.append(token_id)
            if self._extend(self._decode_new()):
                break
        if final and self.stopped_on is None:  # show a cut-off character as decode() does
            self._extend(self._decode_new(flush=True))
        return DetokenizeResult(self._take(final or self.stopped_on is not None), self.stopped_on)

    def _extend(self, new: str) -> bool:
        """Append decoded text; True when a stop string now ends inside it."""
        searched = len(self.text)
        self.text += new
        return bool(new and self._stop) and not self._calls_begun and self._check_stop(searched)

    def _decode_new(self, flush: bool = False) -> str:
        prefix = self._tok.decode(self._ids[self._prefix_offset : self._read_offset], self._skip)
        full = self._tok.decode(self._ids[self._prefix_offset :], self._skip)
        if len(full) <= len(prefix) or (full.endswith(_REPLACEMENT) and not flush):
            return ""  # an incomplete UTF-8 sequence: wait for more tokens
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return full[len(prefix) :]

    def _check_stop(self, searched: int) -> bool:
        # Text before `searched` held no stop string, so a new hit must end after it.
        start = max(0, searched - max(len(s) for s in self._stop) + 1)
        calls = self._calls_from(self.text) if self._calls_from is not None else -1
        self._calls_begun = calls >= 0
        end = len(self.text) if calls < 0 else calls
        hits = [(self.text.find(s, start, end), s) for s in self._stop]
        hits = [(i, s) for i, s in hits if i >= 0]
        if not hits:
            return False
        index, stop = min(hits)
        self.text = self.text[: index + (len(stop) if self._include_stop else 0)]
        self.stopped_on = stop
        return True

    def _take(self, final: bool) -> str:
        end = len(self.text)
        if not final and self._stop and not self._calls_begun:
            end = max(self._emitted, end - max(len(s) for s in self._stop) + 1)
        delta = self.text[self._emitted : end]
        self._emitted = end
        return delta

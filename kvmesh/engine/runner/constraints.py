"""The logits processors in front of the sampler: grammar masks (llguidance) and logit bias.

The engine that samples a request's tokens owns its grammar state, one matcher per request:
before a step, the mask of the tokens its grammar allows next (and, for a row verifying drafts,
the mask after each draft prefix; drafts are cut at the first token the grammar rejects);
after it, the emitted tokens advance the matcher. A decode worker taking a request over from a
prefill worker replays the first token into a fresh matcher of the same grammar, so the two
never hold diverging states. Requests without processors keep the sampler's greedy fast path.
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
from collections import OrderedDict
from collections.abc import Iterator
from collections.abc import Sequence as Seq
from typing import Any

import numpy as np
import structlog
import torch

from kvmesh.errors import InvalidRequestError

log = structlog.get_logger(__name__)


class Constraints:
    """Grammar matchers by request id, over one tokenizer (its llguidance view built lazily:
    costly for a large vocabulary, paid by the first constrained request only). Compiled grammars
    are cached by hash; `prepare` compiles off the engine thread, `add` then only copies."""

    CACHED = 64  # compiled grammars kept

    def __init__(self, hf_tokenizer: Any, vocab_size: int) -> None:
        self._hf = hf_tokenizer
        self.vocab_size = vocab_size
        self._words = (vocab_size + 31) // 32
        self._lock = threading.Lock()  # prepare runs on worker threads
        self._lltokenizer: Any = None
        self._compiled: OrderedDict[bytes, Any] = OrderedDict()
        self._matchers: dict[str, Any] = {}

    def _tokenizer(self) -> Any:
        with self._lock:
            if self._lltokenizer is None:
                import llguidance.hf

                self._lltokenizer = llguidance.hf.from_tokenizer(self._hf, n_vocab=self.vocab_size)
            return self._lltokenizer

    def prepare(self, grammar: str) -> Any:
        """The compiled grammar, a pristine matcher (never advanced): from the cache, or
        compiled now; InvalidRequestError when llguidance cannot use it."""
        import llguidance

        key = hashlib.sha256(grammar.encode()).digest()
        with self._lock:
            if key in self._compiled:
                self._compiled.move_to_end(key)
                return self._compiled[key]
        matcher = llguidance.LLMatcher(self._tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise InvalidRequestError(f"the grammar cannot be used: {matcher.get_error()}")
        with self._lock:
            self._compiled[key] = matcher
            while len(self._compiled) > self.CACHED:
                self._compiled.popitem(last=False)
        return matcher

    def add(self, seq_id: str, grammar: str) -> None:
        """A new request's matcher: a copy of the compiled grammar."""
        self._matchers[seq_id] = self.prepare(grammar).deep_copy()

    def __contains__(self, seq_id: str) -> bool:
        return seq_id in self._matchers

    def __len__(self) -> int:
        """Requests holding a matcher."""
        return len(self._matchers)

    def release(self, seq_id: str) -> None:
        self._matchers.pop(seq_id, None)

    def allowed_prefix(self, seq_id: str, drafts: Seq[int]) -> int:
        """How many of `drafts`, in order, the grammar accepts next."""
        return self._matchers[seq_id].validate_tokens(list(drafts))

    def surely_allows(self, seq_id: str, prefix: Seq[int], token: int) -> bool:
        """True when the grammar's mask after the (accepted) `prefix` holds `token`, found
        without computing the mask; False when it does not or cannot be told cheaply (where
        the grammar forces bytes, the mask holds only their canonical tokens: ask the mask)."""
        with self._after(seq_id, prefix) as matcher:
            if matcher.is_stopped():  # a finished grammar allows only its end
                return token == self._tokenizer().eos_token
            return not matcher.compute_ff_bytes() and matcher.validate_tokens([token]) == 1

    def mask_after(self, seq_id: str, prefix: Seq[int]) -> torch.Tensor:
        """[1, words] int32 bitmask: the tokens allowed after the (accepted) `prefix`."""
        out = torch.empty((1, self._words), dtype=torch.int32)
        with self._after(seq_id, prefix) as matcher:
            matcher.unsafe_compute_mask_ptr(out[0].data_ptr(), self._words * 4)
        return out

    @contextlib.contextmanager
    def _after(self, seq_id: str, prefix: Seq[int]) -> Iterator[Any]:
        """The request's matcher advanced past `prefix` (drafts it accepts), rolled back after."""
        matcher = self._matchers[seq_id]
        if prefix and not matcher.consume_tokens(list(prefix)):
            raise AssertionError("a prefix the grammar rejects reached a check")
        try:
            yield matcher
        finally:
            if prefix:
                matcher.rollback(len(prefix))

    def commit(self, seq_id: str, tokens: Seq[int]) -> bool:
        """Advance past the emitted tokens; False if the grammar rejects one."""
        matcher = self._matchers.get(seq_id)
        if matcher is None:
            return True
        accepted = matcher.try_consume_tokens(list(tokens))
        if accepted != len(tokens):
            log.error(
                "grammar.rejected",
                request_id=seq_id,
                tokens=list(tokens),
                accepted=accepted,
                error=matcher.get_error(),
            )
            return False
        return True

    def masks(self, seq_id: str, drafts: Seq[int]) -> torch.Tensor:
        """[len(drafts) + 1, words] int32 bitmasks: the tokens allowed next, then after each
        draft prefix (the drafts must be allowed: `allowed_prefix`)."""
        matcher = self._matchers[seq_id]
        out = torch.empty((len(drafts) + 1, self._words), dtype=torch.int32)
        for i in range(len(drafts) + 1):
            matcher.unsafe_compute_mask_ptr(out[i].data_ptr(), self._words * 4)
            if i < len(drafts) and not matcher.consume_token(drafts[i]):
                raise AssertionError("a draft the grammar rejects reached verification")
        if drafts:
            matcher.rollback(len(drafts))
        return out


def apply_masks(rows: torch.Tensor, masks: torch.Tensor) -> None:
    """-inf on every logit of rows [n, V] whose bit in masks [n, words] is clear."""
    bits = np.unpackbits(masks.numpy().view(np.uint8), axis=1, bitorder="little")
    allowed = torch.from_numpy(bits[:, : rows.shape[1]]).bool().to(rows.device)
    rows.masked_fill_(~allowed, float("-inf"))


def apply_bias(rows: torch.Tensor, bias: Seq[tuple[int, float]]) -> None:
    """OpenAI logit_bias: each value added to its token's logit in every row."""
    ids = torch.tensor([token for token, _ in bias], dtype=torch.long, device=rows.device)
    values = torch.tensor([value for _, value in bias], dtype=rows.dtype, device=rows.device)
    rows[:, ids] += values

"""Tokenizer and chat template, built by transformers from GGUF metadata or tokenizer.json."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvmesh.engine.loader.resolve import ModelSource
from kvmesh.errors import InvalidRequestError


class Tokenizer:
    """A thin, typed face over an HF fast tokenizer."""

    def __init__(self, hf: Any, extra_eos: Sequence[int] = ()) -> None:
        self.hf = hf
        eos = {i for i in (hf.eos_token_id,) if i is not None} | set(extra_eos)
        self.eos_token_ids: frozenset[int] = frozenset(eos)
        self.all_special_ids: frozenset[int] = frozenset(hf.all_special_ids)
        self._raw_decode = _raw_decode(hf)

    @classmethod
    def from_source(cls, source: ModelSource, extra_eos: Sequence[int] = ()) -> Tokenizer:
        """The source's tokenizer, from the per-source tokenizer cache when it has one (a GGUF
        parsed by transformers takes seconds; the saved tokenizer loads in a fraction)."""
        from kvmesh.engine.loader import load_hf_tokenizer

        hf = load_hf_tokenizer(source)
        return cls(hf, extra_eos)

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        ids = list(token_ids)
        if self._raw_decode is not None:  # the detokenizers call this twice a token
            return self._raw_decode(ids, skip_special_tokens=skip_special_tokens)
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, token_ids: Sequence[int]) -> list[str]:
        return self.hf.convert_ids_to_tokens(list(token_ids))

    def render_chat(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> str:
        """The chat template over messages; template_kwargs (e.g. tools) go to the template."""
        if not self.hf.chat_template:
            raise InvalidRequestError("this model has no chat template; use a plain prompt")
        _check_messages(messages)
        return self.hf.apply_chat_template(
            list(messages),
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **template_kwargs,
        )

    def encode_chat(self, messages: Sequence[dict[str, Any]], **template_kwargs: Any) -> list[int]:
        """Render the chat template and tokenize it; the template adds special tokens itself."""
        return self.encode(self.render_chat(messages, **template_kwargs), add_special_tokens=False)


def _check_messages(messages: Sequence[dict[str, Any]]) -> None:
    if not messages:
        raise InvalidRequestError("messages must be a non-empty list")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise InvalidRequestError(f"messages[{i}] must be an object with a string 'role'")
        if message["role"] not in ("system", "user", "assistant", "tool", "developer"):
            raise InvalidRequestError(f"messages[{i}].role {message['role']!r} is not supported")


def _raw_decode(hf: Any):
    """The Rust tokenizer's own decode where transformers' decode returns exactly its text (a
    fast tokenizer whose `_decode` is the library's and cleans up no spaces), else None: the
    Python around it cost as much as the decode itself, twice per streamed token."""
    try:
        from transformers import tokenization_utils_tokenizers as fast
    except ImportError:
        return None
    base = getattr(fast, "TokenizersBackend", None) or getattr(
        fast, "PreTrainedTokenizerFast", None
    )
    backend = getattr(hf, "_tokenizer", None)
    if base is None or backend is None or type(hf)._decode is not base._decode:
        return None
    cleans_up = bool(getattr(hf, "clean_up_tokenization_spaces", False))
    if cleans_up and type(backend.model).__name__ == "BPE":  # transformers skips it for BPE...
        forced = "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output"
        cleans_up = bool(getattr(hf, forced, False))  # ...unless told otherwise
    return None if cleans_up else backend.decode

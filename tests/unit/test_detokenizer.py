"""Tokenizer chat template and IncrementalDetokenizer, on the real SmolLM2 tokenizer."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from kvmesh.engine.detokenizer import IncrementalDetokenizer
from kvmesh.engine.tokenizer import Tokenizer
from kvmesh.errors import InvalidRequestError

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "Héllo wörld, ça va? naïve café — crème brûlée",
    "Emoji: 😀🎉 and a family 👩\u200d👩\u200d👧 ok",
    "日本語のテキスト、中文文本，한국어 텍스트",
    "  indented\n\tcode()  {x: 1}\n\n",
]


@pytest.fixture(scope="module")
def tok(default_model_source) -> Tokenizer:
    return Tokenizer.from_source(default_model_source)


def stream(
    tok: Tokenizer, ids: Sequence[int], **options: object
) -> tuple[list[str], IncrementalDetokenizer]:
    """Feed ids one token at a time, then an empty final push; return every delta."""
    detok = IncrementalDetokenizer(tok, **options)
    deltas = [detok.push([i]).delta for i in ids]
    deltas.append(detok.push([], final=True).delta)
    return deltas, detok


def ids_of(tok: Tokenizer, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


# --- plain streaming --------------------------------------------------------------------------


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_concatenate_to_decode(tok: Tokenizer, text: str) -> None:
    ids = ids_of(tok, text)
    deltas, detok = stream(tok, ids)
    assert "".join(deltas) == tok.decode(ids) == text
    assert detok.text == text
    assert all("\ufffd" not in d for d in deltas)  # multi-byte characters are never split


@pytest.mark.parametrize("text", TEXTS[1:4])
def test_cut_off_output_matches_decode(tok: Tokenizer, text: str) -> None:
    """Output cut mid-character (max_tokens) still renders as decode() renders it."""
    ids = ids_of(tok, text)
    for end in range(1, len(ids)):
        deltas, _ = stream(tok, ids[:end])
        assert "".join(deltas) == tok.decode(ids[:end]), end


def test_multi_token_pushes_match_single_token_pushes(tok: Tokenizer) -> None:
    ids = ids_of(tok, TEXTS[2] + TEXTS[3])
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.push(ids[i : i + 3]).delta for i in range(0, len(ids), 3)]
    deltas.append(detok.push([], final=True).delta)
    assert "".join(deltas) == tok.decode(ids)


def test_prompt_context_keeps_leading_space(tok: Tokenizer) -> None:
    prompt = ids_of(tok, "Say hello:")
    output = ids_of(tok, " hello there")
    detok = IncrementalDetokenizer(tok, prompt_ids=prompt)
    text = "".join(detok.push([i]).delta for i in output) + detok.push([], final=True).delta
    assert text == " hello there"


def test_special_tokens_skipped_or_kept(tok: Tokenizer) -> None:
    ids = ids_of(tok, "Hi") + [tok.hf.eos_token_id]
    assert "".join(stream(tok, ids)[0]) == "Hi"
    kept = "".join(stream(tok, ids, skip_special_tokens=False)[0])
    assert kept == "Hi" + tok.hf.eos_token


# --- stop strings -----------------------------------------------------------------------------


def spanning_stop(tok: Tokenizer, ids: list[int], at: int) -> str:
    """A stop string made of the end of token `at - 1` and the start of token `at`."""
    left, right = tok.decode(ids[:at]), tok.decode(ids[: at + 1])
    stop = left[-2:] + right[len(left) :][:2]
    assert len(stop) == 4 and stop in tok.decode(ids)
    return stop


@pytest.mark.parametrize("include_stop", [False, True])
def test_stop_string_spanning_two_tokens(tok: Tokenizer, include_stop: bool) -> None:
    text = "The weather today is sunny and warm, with a light breeze."
    ids = ids_of(tok, text)
    stop = spanning_stop(tok, ids, 5)
    expected = text[: text.index(stop) + (len(stop) if include_stop else 0)]

    detok = IncrementalDetokenizer(tok, stop=[stop], include_stop=include_stop)
    results = [detok.push([token_id]) for token_id in ids[:6]]
    assert [r.stopped_on for r in results] == [None] * 5 + [stop]  # the 6th token completes it
    assert detok.stopped_on == stop
    assert "".join(r.delta for r in results) == expected == detok.text
    assert detok.push(ids[6:], final=True).delta == ""  # nothing after a stop


def test_stop_inside_one_multi_token_push(tok: Tokenizer) -> None:
    text = "alpha beta gamma delta epsilon"
    detok = IncrementalDetokenizer(tok, stop=["gamma", "delta"])
    result = detok.push(ids_of(tok, text))
    assert (result.delta, result.stopped_on) == ("alpha beta ", "gamma")


def test_earliest_stop_wins(tok: Tokenizer) -> None:
    ids = ids_of(tok, "one two three four")
    deltas, detok = stream(tok, ids, stop=["four", "two th"])
    assert "".join(deltas) == "one "
    assert detok.stopped_on == "two th"


def test_stop_reaching_back_before_a_long_token(tok: Tokenizer) -> None:
    """A token that adds many characters at once must not hide a stop string ending in it."""
    hashes = tok.hf.convert_tokens_to_ids("#" * 80)
    assert tok.decode([hashes]) == "#" * 80
    ids = ids_of(tok, "Heading c") + [hashes] + ids_of(tok, " more text")
    deltas, detok = stream(tok, ids, stop=["c##"])
    assert "".join(deltas) == "Heading "
    assert detok.stopped_on == "c##"


@pytest.mark.parametrize("text", TEXTS[:4])
def test_no_delta_contains_the_stop_string(tok: Tokenizer, text: str) -> None:
    ids = ids_of(tok, text)
    for at in range(1, len(ids)):
        left, right = tok.decode(ids[:at]), tok.decode(ids[: at + 1])
        stop = left[-1:] + right[len(left) :][:1]
        if len(stop) < 2 or "\ufffd" in stop:
            continue
        deltas, detok = stream(tok, ids, stop=[stop])
        joined = "".join(deltas)
        assert all(stop not in d for d in deltas)
        assert stop not in joined
        assert joined == text[: text.index(stop)]


def test_partial_stop_is_held_back_then_released_on_final(tok: Tokenizer) -> None:
    ids = ids_of(tok, "Good morning, everyone")
    detok = IncrementalDetokenizer(tok, stop=["everyone!"])
    shown = "".join(detok.push([i]).delta for i in ids)
    assert shown != "Good morning, everyone"
    assert "Good morning, everyone".startswith(shown)
    assert len("Good morning, everyone") - len(shown) <= len("everyone!") - 1
    final = detok.push([], final=True)
    assert shown + final.delta == "Good morning, everyone"
    assert final.stopped_on is None


def test_final_push_with_tokens_releases_everything(tok: Tokenizer) -> None:
    ids = ids_of(tok, "the end is near")
    detok = IncrementalDetokenizer(tok, stop=["nearby"])
    first = detok.push(ids[:-1]).delta
    last = detok.push(ids[-1:], final=True).delta
    assert first + last == "the end is near"


# --- chat template ----------------------------------------------------------------------------


def test_encode_chat_uses_the_template(tok: Tokenizer) -> None:
    im_start = tok.hf.convert_tokens_to_ids("<|im_start|>")
    im_end = tok.hf.convert_tokens_to_ids("<|im_end|>")
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "What is 2+2?"},
    ]
    ids = tok.encode_chat(messages)
    assert ids.count(im_start) == 5  # four messages plus the generation prompt
    assert ids.count(im_end) == 4
    assert ids[0] == im_start
    assert ids[-4:] == [im_start, *ids_of(tok, "assistant\n")]
    text = tok.decode(ids, skip_special_tokens=False)
    assert text.endswith("<|im_start|>assistant\n")
    for message in messages:
        assert f"<|im_start|>{message['role']}\n{message['content']}<|im_end|>" in text


def test_render_chat_without_generation_prompt(tok: Tokenizer) -> None:
    text = tok.render_chat([{"role": "user", "content": "hi"}], add_generation_prompt=False)
    assert not text.endswith("<|im_start|>assistant\n")
    assert text.rstrip().endswith("<|im_end|>")


@pytest.mark.parametrize(
    "messages",
    [
        [],
        [{"content": "no role"}],
        [{"role": None, "content": "x"}],
        [{"role": "wizard", "content": "x"}],
        [{"role": "user", "content": "ok"}, "not a dict"],
    ],
    ids=["empty", "missing-role", "role-not-str", "unknown-role", "not-a-dict"],
)
def test_invalid_messages(tok: Tokenizer, messages: list) -> None:
    with pytest.raises(InvalidRequestError):
        tok.encode_chat(messages)


def test_eos_ids(tok: Tokenizer) -> None:
    assert tok.eos_token_ids == {2}
    assert tok.hf.convert_tokens_to_ids("<|im_end|>") == 2
    assert tok.vocab_size == 49152


def test_decode_takes_the_rust_tokenizers_own_path_with_transformers_text(tok):
    """SmolLM2's fast tokenizer cleans up no spaces, so decode skips transformers' Python wrapper
    (the detokenizers call it twice a token); the text is transformers' for any ids."""
    import random

    assert tok._raw_decode is not None
    rng = random.Random(0)
    specials = sorted(tok.all_special_ids)
    for _ in range(500):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 10))]
        ids.insert(rng.randrange(len(ids) + 1), rng.choice(specials))
        for skip in (True, False):
            assert tok.decode(ids, skip) == tok.hf.decode(ids, skip_special_tokens=skip)
    for text in TEXTS:
        assert tok.decode(ids_of(tok, text)) == text


def test_a_tokenizer_that_cleans_up_spaces_keeps_transformers_decode(tok, monkeypatch):
    from kvmesh.engine import tokenizer

    monkeypatch.setattr(tok.hf, "clean_up_tokenization_spaces", True)
    monkeypatch.setattr(
        tok.hf,
        "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output",
        True,
        raising=False,
    )
    assert tokenizer._raw_decode(tok.hf) is None

"""Greedy rows under a grammar are checked, not masked (engine/runner/sample_step.py): the tokens
chosen, with and without drafts, equal those of rows masked before the argmax, over the
default model's tokenizer; a row whose argmax the grammar allows is never masked."""

from __future__ import annotations

import random

import pytest
import torch

from kvmesh.agent import grammars
from kvmesh.engine.runner.constraints import Constraints, apply_masks
from kvmesh.engine.runner.sample_step import _grammar_checked
from kvmesh.engine.spec.verify import verify_greedy

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}},
    },
    "required": ["name", "age"],
}
ANSWER = '{"name": "Ada", "age": 36, "tags": ["a", "b"]}'


@pytest.fixture(scope="module")
def constraints(tok) -> Constraints:
    return Constraints(tok.hf, len(tok.hf))


def _masked_choice(constraints: Constraints, rows: torch.Tensor, draft: list[int]) -> list[int]:
    """The reference: every row masked before the argmax, then verified."""
    rows = rows.clone()
    apply_masks(rows, constraints.masks("s", draft))
    return verify_greedy(rows, draft)


def _checked_choice(constraints: Constraints, rows: torch.Tensor, draft: list[int]) -> list[int]:
    rows = rows.clone()
    return _grammar_checked(constraints, "s", rows, tuple(draft), rows.argmax(-1).tolist())


def test_checked_choices_equal_masked_ones_with_and_without_drafts(tok, constraints):
    """At every state along a valid answer, rows whose top tokens are random (mostly rejected
    by the grammar) with the drafts' tokens sometimes raised: the same tokens either way."""
    constraints.add("s", grammars.json_schema(SCHEMA, "t"))
    path = tok.hf.encode(ANSWER) + [tok.hf.eos_token_id]
    rnd = random.Random(7)
    vocab = len(tok.hf)
    masked_rows = split = 0
    try:
        for at in range(len(path) - 1):
            for _ in range(6):
                draft = path[at : min(at + rnd.randint(0, 3), len(path) - 1)]
                if draft and rnd.random() < 0.3:  # a draft cut byte by byte: not canonical
                    draft = _split_first(tok, constraints, draft)
                    split += draft[0] != path[at]
                rows = torch.randn(len(draft) + 1, vocab)
                for i, token in enumerate(draft):
                    if rnd.random() < 0.7:  # the draft second or first in its row
                        rows[i, token] = rows[i].max() + rnd.choice((-0.5, 0.5))
                if rnd.random() < 0.5:  # the answer's next token on top of its row
                    rows[len(draft), path[at + len(draft)]] = rows[len(draft)].max() + 1
                want = _masked_choice(constraints, rows, draft)
                assert _checked_choice(constraints, rows, draft) == want, (at, draft)
                masked_rows += want != verify_greedy(rows, draft)
            assert constraints.commit("s", [path[at]])
    finally:
        constraints.release("s")
    assert masked_rows > 20  # the grammar changed many choices: the check was exercised
    assert split > 3  # drafts the mask leaves out were offered


def _split_first(tok, constraints: Constraints, draft: list[int]) -> list[int]:
    """The draft with its first token's first character as a token of its own, where that
    is another token the grammar accepts byte by byte (`{` for `{"`)."""
    text = tok.hf.decode(draft[:1])
    first = tok.hf.encode(text[:1]) if len(text) > 1 else []
    if len(first) == 1 and constraints.allowed_prefix("s", first) == 1:
        return first
    return draft


def test_a_row_whose_argmax_the_grammar_allows_is_left_as_it_is(tok, constraints):
    constraints.add("s", grammars.choice(["yes", "no"], "c"))
    try:
        rows = torch.zeros(1, len(tok.hf))
        yes = tok.hf.encode("yes")[0]
        rows[0, yes] = 5.0
        assert _grammar_checked(constraints, "s", rows, (), [yes]) == [yes]
        assert not bool(torch.isinf(rows).any())  # no mask computed
        rows[0, tok.hf.encode("maybe")[0]] = 9.0
        chosen = _grammar_checked(constraints, "s", rows, (), [int(rows.argmax())])
        assert chosen == [yes] and bool(torch.isinf(rows).any())
    finally:
        constraints.release("s")


def test_after_its_end_a_grammar_allows_only_eos(tok, constraints):
    constraints.add("s", grammars.choice(["yes", "no"], "c"))
    try:
        assert constraints.commit("s", tok.hf.encode("yes"))
        eos = tok.hf.eos_token_id
        assert constraints.surely_allows("s", [], eos)
        assert not constraints.surely_allows("s", [], tok.hf.encode("no")[0])
    finally:
        constraints.release("s")


def test_where_the_grammar_forces_bytes_only_their_canonical_token_is_chosen(tok, constraints):
    """`{"` is forced at the start: the mask holds only that token, though `{` alone is a
    valid start byte by byte; the model's `{` on top gives way as the mask would have it, and
    a draft `{` (drafts are cut byte by byte) is rejected though the row's argmax is it."""
    constraints.add("s", grammars.json_schema(SCHEMA, "t"))
    try:
        brace, canonical = tok.hf.encode("{")[0], tok.hf.encode('{"')[0]
        assert brace != canonical
        rows = torch.zeros(1, len(tok.hf))
        rows[0, brace], rows[0, canonical] = 9.0, 5.0
        assert _checked_choice(constraints, rows, []) == _masked_choice(constraints, rows, [])
        assert _checked_choice(constraints, rows, []) == [canonical]
        drafted = torch.zeros(2, len(tok.hf))
        drafted[0, brace], drafted[0, canonical], drafted[1, canonical] = 9.0, 5.0, 9.0
        assert constraints.allowed_prefix("s", [brace]) == 1
        assert _checked_choice(constraints, drafted, [brace]) == [canonical]
        assert _masked_choice(constraints, drafted, [brace]) == [canonical]
    finally:
        constraints.release("s")

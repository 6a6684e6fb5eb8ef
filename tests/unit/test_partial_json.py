"""partial_json: the longest valid reading of JSON cut short (a tool call hit max_tokens)."""

from __future__ import annotations

import json

import pytest

from kvmesh.agent.partial_json import partial_json

CASES = [
    ('{"city": "Par', {"city": "Par"}),  # an open value string keeps its text
    ('{"city": "Paris", "uni', {"city": "Paris"}),  # a dangling key is dropped
    ('{"city": "Paris", "units":', {"city": "Paris"}),
    ('{"a": [1, 2,', {"a": [1, 2]}),
    ('{"a": {"b": tr', {"a": {}}),  # an unfinished literal is dropped
    ('{"a": 12', {"a": 12}),
    ('{"a": "x\\u00', {"a": "x"}),  # an escape cut in the middle
    ('{"a": [{"b": "c"}, {"d"', {"a": [{"b": "c"}, {}]}),
    ("{", {}),
    ("", None),
    ("not json", None),
]


@pytest.mark.parametrize(("text", "want"), CASES)
def test_cut_json_reads_as_far_as_it_goes(text, want) -> None:
    assert partial_json(text) == want


def test_every_cut_of_a_whole_document_reads() -> None:
    whole = {"q": 'a "quoted" \u00e9 word \\ end', "n": [1, -2.5e3, True, None], "o": {"k": [[]]}}
    text = json.dumps(whole)
    for cut in range(1, len(text) + 1):
        value = partial_json(text[:cut])
        assert isinstance(value, dict), text[:cut]
    assert partial_json(text) == whole

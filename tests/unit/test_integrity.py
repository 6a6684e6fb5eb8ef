"""The pool-side tag check: one batched compare finds exactly the sequences with a bad page."""

from __future__ import annotations

import pytest
import torch

from kvmesh.engine.faults import FaultPlan
from kvmesh.engine.integrity import PENDING, PageTags, as_int32
from kvmesh.engine.sampling_params import SamplingParams
from kvmesh.engine.sequence import Sequence


def _seq(name: str, pages: list[int], tags: list[int]) -> Sequence:
    seq = Sequence(name, [1, 2, 3], SamplingParams())
    seq.block_table, seq.page_tags = list(pages), list(tags)
    return seq


def test_mismatched_reports_each_bad_sequence_with_its_pages():
    tags = PageTags(torch.zeros(8, dtype=torch.int32))
    tags.stamp([(0, 5), (1, 6), (2, 7), (3, (1 << 32) - 1)])
    a, b, c = _seq("a", [0, 1], [5, 6]), _seq("b", [2, 3], [7, (1 << 32) - 1]), _seq("c", [], [])
    assert tags.mismatched([a, b, c]) == []  # uint32 tags above 2**31 compare right too
    tags.stamp([(1, 9)])  # page 1 went to another owner
    tags.stamp([(3, 4)], pending=True)  # page 3 reserved for a remote writer
    assert tags.tags[3] == PENDING
    assert tags.mismatched([a, b, c]) == [(a, [1]), (b, [3])]
    assert tags.failures == 2


def test_as_int32_keeps_the_bit_pattern():
    assert as_int32([1, (1 << 31), (1 << 32) - 1]).tolist() == [1, -(1 << 31), -1]


def test_fault_plan_parsing():
    assert FaultPlan.parse("reassign@3, drop_transfer@1").every == {
        "reassign": 3,
        "drop_transfer": 1,
    }
    for bad in ("reassign", "explode@2", "overwrite@0"):
        with pytest.raises(ValueError, match="KVMESH_FAULTS"):
            FaultPlan.parse(bad)

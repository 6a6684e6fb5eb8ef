"""The pool-side tag check: one batched compare finds exactly the sequences with a bad page."""

from __future__ import annotations

import pytest
import torch

from kvmesh.engine.core.faults import FaultPlan
from kvmesh.engine.core.step import StepDiffer
from kvmesh.engine.pool.block_tables import BlockTables
from kvmesh.engine.pool.integrity import PENDING, PageTags, as_int32


def _tables(rows: dict[str, tuple[list[int], list[int]]]) -> BlockTables:
    tables = BlockTables(null_page=7, rows=2, width=1)  # grows on demand
    for req_id, (pages, tags) in rows.items():
        tables.add(req_id, pages, tags)
    return tables


def test_mismatched_reports_each_bad_request_with_its_pages():
    tags = PageTags(torch.zeros(8, dtype=torch.int32))
    tags.stamp([(0, 5), (1, 6), (2, 7), (3, (1 << 32) - 1)])
    tables = _tables({"a": ([0, 1], [5, 6]), "b": ([2, 3], [7, (1 << 32) - 1]), "c": ([], [])})
    assert tags.mismatched(tables, ["a", "b", "c"]) == []  # uint32 tags above 2**31 too
    tags.stamp([(1, 9)])  # page 1 went to another owner
    tags.stamp([(3, 4)], pending=True)  # page 3 reserved for a remote writer
    assert tags.tags[3] == PENDING
    assert tags.mismatched(tables, ["c", "b", "a"]) == [(1, [3]), (2, [1])]
    assert tags.failures == 2
    assert tags.mismatched(tables, ["c"]) == []


def test_a_page_given_back_at_the_same_place_is_expected_with_its_new_tag():
    """A trim frees a request's last page and the next allocation hands the same page id
    back at the same place with a new tag: the step's diff must carry it (else every check
    after it fails), and a row that shrinks holds the null page past its pages."""
    differ = StepDiffer()
    differ.plan([("r", [1, 2], [4, 5], [10, 11])], ())
    diff = differ.plan([("r", [1, 2, 3], [4, 5], [10, 12])], ()).diffs[0]
    assert (diff.num_blocks_kept, diff.new_block_ids, diff.new_page_tags) == (1, (5,), (12,))
    tables = _tables({"r": ([4, 5], [10, 11])})
    tables.update("r", diff.num_blocks_kept, diff.new_block_ids, diff.new_page_tags)
    tags = PageTags(torch.zeros(8, dtype=torch.int32))
    tags.stamp([(4, 10), (5, 12)])
    assert tags.mismatched(tables, ["r"]) == []
    tables.update("r", 1, (), ())
    assert tables.table("r") == (4,) and tables.gather(tables.rows(["r"]), 3).tolist() == [
        [4, 7, 7]
    ]


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

"""Scheduler: chunked prefill under one token budget, preemption, stops, aborts (no model)."""

from __future__ import annotations

import itertools

import pytest

from kvmesh.engine.core.sampling_params import SamplingParams
from kvmesh.engine.core.scheduler import Scheduler, SchedulerLimits, SchedulerOutput
from kvmesh.engine.core.sequence import FinishReason, SeqStatus, Sequence
from kvmesh.engine.kv import BlockHasher, BlockManager, BlockManagerConfig
from kvmesh.errors import CapacityError, ContextLengthError

PS = 4
EOS = 2


def make_sched(
    num_pages: int = 64,
    budget: int = 2048,
    max_seqs: int = 64,
    max_model_len: int = 8192,
    caching: bool = True,
) -> Scheduler:
    bm = BlockManager(BlockManagerConfig(num_pages, PS, caching), BlockHasher(PS, 99))
    config = SchedulerLimits(max_seqs, budget, max_model_len)
    return Scheduler(config, bm, frozenset({EOS}))


def make_seq(seq_id: str, num_prompt: int, **params: object) -> Sequence:
    base = 1000 * (1 + sum(map(ord, seq_id)))  # distinct prompts: no accidental prefix hits
    prompt = [base + i for i in range(num_prompt)]
    return Sequence(seq_id, prompt, SamplingParams(**params))


_tokens = itertools.count(500)


def step(sched: Scheduler, tokens: dict[str, int] | None = None) -> tuple[SchedulerOutput, list]:
    """One engine step with fake sampling; checks pool invariants afterwards."""
    out = sched.schedule()
    sampled = {c.seq.seq_id: next(_tokens) for c in out.chunks if c.sample}
    sampled.update(tokens or {})
    finished = sched.update(out, {seq_id: [token] for seq_id, token in sampled.items()})
    holding = [s for s in sched.waiting if s.block_table]  # prefilled elsewhere, waiting
    sched.block_manager.check_integrity([*sched.running, *holding])
    assert all(s.num_computed_tokens == s.num_prompt_tokens for s in holding)
    return out, finished


def plan(out: SchedulerOutput) -> list[tuple[str, int, int, bool]]:
    return [(c.seq.seq_id, c.start, c.num_tokens, c.sample) for c in out.chunks]


def test_config_validated() -> None:
    good = {"max_num_seqs": 8, "max_num_batched_tokens": 64, "max_model_len": 256}
    SchedulerLimits(**good)
    for bad in ({"max_num_seqs": 0}, {"max_num_batched_tokens": 0}, {"max_model_len": 1}):
        with pytest.raises(ValueError):
            SchedulerLimits(**(good | bad))


def test_chunked_prefill_exact_chunks() -> None:
    sched = make_sched(budget=8)
    sched.add(make_seq("a", 20, max_tokens=2))
    assert plan(step(sched)[0]) == [("a", 0, 8, False)]
    assert plan(step(sched)[0]) == [("a", 8, 8, False)]
    out, _ = step(sched)
    assert plan(out) == [("a", 16, 4, True)] and out.num_batched_tokens == 4
    seq = sched.get("a")
    assert seq is not None and seq.num_output_tokens == 1 and seq.block_table == [0, 1, 2, 3, 4]
    out, finished = step(sched)
    assert plan(out) == [("a", 20, 1, True)] and finished == [seq]
    assert seq.finish_reason is FinishReason.LENGTH and not sched.has_unfinished()
    assert sched.schedule().is_empty


def test_decodes_share_the_step_with_a_prefill() -> None:
    sched = make_sched(budget=8)
    sched.add(make_seq("a", 4, max_tokens=10))
    assert plan(step(sched)[0]) == [("a", 0, 4, True)]
    sched.add(make_seq("b", 20, max_tokens=10))
    out, _ = step(sched)
    assert plan(out) == [("a", 4, 1, True), ("b", 0, 7, False)] and out.num_batched_tokens == 8
    assert plan(step(sched)[0]) == [("a", 5, 1, True), ("b", 7, 7, False)]
    assert plan(step(sched)[0]) == [("a", 6, 1, True), ("b", 14, 6, True)]
    assert plan(step(sched)[0]) == [("a", 7, 1, True), ("b", 20, 1, True)]


def test_max_num_seqs_respected() -> None:
    sched = make_sched(max_seqs=2)
    for name in "abc":
        sched.add(make_seq(name, 3, max_tokens=2))
    out, _ = step(sched)
    assert [c.seq.seq_id for c in out.chunks] == ["a", "b"]
    assert (sched.num_running, sched.num_waiting) == (2, 1)
    out, finished = step(sched)
    assert [s.seq_id for s in finished] == ["a", "b"]
    assert plan(step(sched)[0]) == [("c", 0, 3, True)]


def test_preemption_recomputes_the_last_sequence() -> None:
    sched = make_sched(num_pages=4, caching=False)
    sched.add(make_seq("a", 7, max_tokens=4))
    sched.add(make_seq("b", 7, max_tokens=4))
    assert plan(step(sched)[0]) == [("a", 0, 7, True), ("b", 0, 7, True)]
    assert plan(step(sched)[0]) == [("a", 7, 1, True), ("b", 7, 1, True)]
    b = sched.get("b")
    assert b is not None
    b_tokens = list(b.token_ids)
    out, _ = step(sched)  # a needs a 3rd page: b (last) is preempted, nothing admitted
    assert plan(out) == [("a", 8, 1, True)] and out.preempted == ("b",)
    assert (b.status, b.num_computed_tokens, b.num_preemptions, b.block_table) == (
        SeqStatus.WAITING,
        0,
        1,
        [],
    )
    assert sched.waiting[0] is b and sched.get("a").block_table == [0, 1, 2]
    out, finished = step(sched)  # b (9 tokens, 3 pages) does not fit yet
    assert plan(out) == [("a", 9, 1, True)] and [s.seq_id for s in finished] == ["a"]
    out, _ = step(sched)
    assert plan(out) == [("b", 0, 9, True)] and b.token_ids[:9] == b_tokens
    assert b.status is SeqStatus.RUNNING
    out, finished = step(sched)
    assert plan(out) == [("b", 9, 1, True)] and finished == [b] and b.num_output_tokens == 4


def test_preempting_the_sequence_being_scheduled_stops() -> None:
    sched = make_sched(num_pages=4, caching=False)
    sched.add(make_seq("a", 9, max_tokens=8))
    sched.add(make_seq("b", 3, max_tokens=8))
    sched.add(make_seq("c", 1, max_tokens=8))
    step(sched)  # a: pages 0-2, b: page 3, c cannot be admitted
    assert plan(step(sched)[0]) == [("a", 9, 1, True), ("b", 3, 1, True)]
    out, _ = step(sched)  # b needs a 2nd page and is itself the last running seq
    assert plan(out) == [("a", 10, 1, True)] and out.preempted == ("b",)
    assert [s.seq_id for s in sched.waiting] == ["b", "c"]


def test_abort_waiting_and_running_frees_pages() -> None:
    sched = make_sched(num_pages=8, max_seqs=1)
    sched.add(make_seq("a", 10))
    sched.add(make_seq("b", 10))
    out = sched.schedule()
    bm = sched.block_manager
    assert bm.num_used_pages == 3
    running = sched.abort("a")
    assert running is not None and running.finish_reason is FinishReason.ABORT
    assert running.status is SeqStatus.FINISHED and running.block_table == []
    assert sched.update(out, {}) == []  # the aborted seq's chunk is skipped
    waiting = sched.abort("b")
    assert waiting is not None and waiting.status is SeqStatus.FINISHED
    assert sched.abort("b") is None and sched.abort("zzz") is None
    assert bm.num_used_pages == 0 and not sched.has_unfinished()
    bm.check_integrity([])


def test_finish_from_outside() -> None:
    sched = make_sched()
    sched.add(make_seq("a", 5))
    step(sched)
    seq = sched.finish("a", FinishReason.STOP)
    assert seq is not None and seq.finish_reason is FinishReason.STOP
    assert sched.num_running == 0 and sched.block_manager.num_used_pages == 0


@pytest.mark.parametrize(
    ("params", "token", "reason"),
    [
        ({}, EOS, FinishReason.STOP),
        ({"stop_token_ids": (77,)}, 77, FinishReason.STOP),
        ({"ignore_eos": True, "stop_token_ids": (EOS,)}, EOS, FinishReason.STOP),
    ],
)
def test_stop_tokens(params: dict, token: int, reason: FinishReason) -> None:
    sched = make_sched()
    sched.add(make_seq("a", 5, max_tokens=50, **params))
    step(sched, {"a": 7})
    _, finished = step(sched, {"a": token})
    assert [s.finish_reason for s in finished] == [reason]
    assert finished[0].output_token_ids == [7, token]


def test_ignore_eos_keeps_going() -> None:
    sched = make_sched()
    sched.add(make_seq("a", 5, max_tokens=3, ignore_eos=True))
    assert step(sched, {"a": EOS})[1] == [] and step(sched, {"a": EOS})[1] == []
    assert [s.finish_reason for s in step(sched, {"a": EOS})[1]] == [FinishReason.LENGTH]


def test_max_model_len_stops() -> None:
    sched = make_sched(max_model_len=8)
    sched.add(make_seq("a", 6, max_tokens=100))
    assert step(sched)[1] == []
    _, finished = step(sched)
    assert [s.finish_reason for s in finished] == [FinishReason.LENGTH]
    assert finished[0].num_tokens == 8
    with pytest.raises(ContextLengthError):
        sched.add(make_seq("b", 8))


def test_prefix_hit_sets_cached_tokens() -> None:
    sched = make_sched()
    a = make_seq("a", 12, max_tokens=1)
    sched.add(a)
    step(sched)
    b = Sequence("b", a.prompt_token_ids[:8] + [5, 6, 7], SamplingParams(max_tokens=1))
    sched.add(b)
    out = sched.schedule()
    assert plan(out) == [("b", 8, 3, True)]
    assert b.num_cached_tokens == 8 and b.block_table == [0, 1, 3]
    assert sched.update(out, {"b": [9]}) == [b]
    step(sched)  # b ends on a page boundary: one non-sampling step caches its last page
    assert not sched.has_unfinished()
    sched.block_manager.check_integrity([])


def test_capacity_error_for_a_prompt_that_can_never_fit() -> None:
    sched = make_sched(num_pages=4)
    with pytest.raises(CapacityError, match="4"):
        sched.add(make_seq("big", 16))  # 16 + 1 tokens need 5 pages
    sched.add(make_seq("ok", 15))
    assert sched.num_waiting == 1
    with pytest.raises(ValueError):
        sched.add(make_seq("ok", 3))


def test_finish_on_a_page_boundary_computes_and_caches_the_last_page():
    sched = make_sched()
    seq = make_seq("edge", 6, max_tokens=2, temperature=0.0)  # 6 + 2 = 8 tokens = 2 full pages
    sched.add(seq)
    step(sched)  # prefill, first token
    out, finished = step(sched)  # second token: finished, reported now
    assert [s.seq_id for s in finished] == ["edge"] and seq.finish_reason is FinishReason.LENGTH
    assert sched.has_unfinished()  # still computing the last token's KV
    out, finished = step(sched)
    assert [(c.num_tokens, c.sample) for c in out.chunks] == [(1, False)] and finished == []
    assert not sched.has_unfinished()
    again = Sequence("next", list(seq.token_ids) + [7], SamplingParams())
    assert sched.block_manager.match_prefix(again).num_tokens == 8


def test_finish_off_a_page_boundary_frees_at_once():
    sched = make_sched()
    sched.add(make_seq("plain", 5, max_tokens=2, temperature=0.0))  # 7 tokens
    step(sched)
    _, finished = step(sched)
    assert [s.seq_id for s in finished] == ["plain"] and not sched.has_unfinished()


def test_drafts_are_verified_in_one_chunk_and_rejected_pages_trimmed():
    sched = make_sched(num_pages=16)
    bm = sched.block_manager
    seq = make_seq("d", 5, max_tokens=20)
    sched.add(seq)
    step(sched)  # prefill: 5 tokens computed, 1 sampled
    assert (seq.num_tokens, seq.num_computed_tokens) == (6, 5)
    seq.draft_token_ids = [60, 61, 62, 63, 64, 65]
    out = sched.schedule()
    (chunk,) = out.chunks
    assert (chunk.start, chunk.num_tokens, chunk.draft) == (5, 1, (60, 61, 62, 63, 64, 65))
    assert len(seq.block_table) == 3  # positions 5..11 allocated
    sched.update(out, {seq.seq_id: [60, 61, 99]})  # two drafts accepted, then the target's 99
    assert seq.token_ids[-3:] == [60, 61, 99]
    assert (seq.num_tokens, seq.num_computed_tokens) == (9, 8)
    assert len(seq.block_table) == 3  # 9 tokens need 3 pages of 4
    seq.draft_token_ids = [1, EOS, 3]
    out = sched.schedule()
    tokens = {seq.seq_id: [1, EOS, 3, 4]}
    assert sched.update(out, tokens) == [seq]
    assert tokens[seq.seq_id] == [1, EOS]  # nothing after the stop is reported
    assert seq.token_ids[-2:] == [1, EOS] and not sched.running
    bm.check_integrity([])


def test_prefilled_requests_wait_for_a_slot_under_max_num_seqs() -> None:
    sched = make_sched(max_seqs=2)
    for name in ("a", "b"):
        sched.add(make_seq(name, 6, max_tokens=3, ignore_eos=True))
    step(sched)
    remote = make_seq("r", 6, max_tokens=4, ignore_eos=True)
    assert sched.block_manager.allocate(remote, remote.num_tokens)  # as Engine.reserve does
    assert sched.add_prefilled(remote, 77) is None
    assert [s.seq_id for s in sched.running] == ["a", "b"] and sched.waiting[0] is remote
    table = list(remote.block_table)
    finished: list[str] = []
    while True:
        out = sched.schedule()
        assert len(sched.running) <= 2
        mine = [(c.start, c.num_tokens) for c in out.chunks if c.seq is remote]
        if mine:
            break
        done = sched.update(out, {c.seq.seq_id: [500] for c in out.chunks if c.sample})
        finished += [s.seq_id for s in done]
    assert mine == [(6, 1)] and finished  # admitted once a slot freed, decoding at once
    assert remote.block_table[: len(table)] == table  # its prefilled pages were kept

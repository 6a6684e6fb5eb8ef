"""Hand-over states (engine/core/handover.py) with a real block manager and scheduler (no model):
every move of the diagram, the ones it lacks refused, pages freed exactly once."""

from __future__ import annotations

import pytest

from kvmesh.engine.core.handover import MOVES, HandOverError, HandOvers, HandOverState
from kvmesh.engine.core.sampling_params import SamplingParams
from kvmesh.engine.core.scheduler import Scheduler, SchedulerLimits
from kvmesh.engine.core.sequence import FinishReason, Sequence
from kvmesh.engine.kv import BlockHasher, BlockManager, BlockManagerConfig

S = HandOverState
PS = 4


@pytest.fixture
def pool() -> BlockManager:
    return BlockManager(BlockManagerConfig(32, PS, False), BlockHasher(PS, 7))


def _allocated(pool: BlockManager, seq_id: str, tokens: int = 10) -> Sequence:
    seq = Sequence(seq_id, list(range(100, 100 + tokens)), SamplingParams(max_tokens=1))
    assert pool.allocate(seq, tokens)
    return seq


def test_a_reservation_is_committed_cancelled_or_quarantined(pool: BlockManager):
    states = HandOvers(pool)
    states.reserved(_allocated(pool, "r"))
    assert states.state("r") is S.RESERVED and pool.num_used_pages == 3
    states.cancel("r")
    assert states.state("r") is None and pool.num_used_pages == 0
    assert states.cancel("r") is None  # idempotent: nothing left to free

    states.reserved(_allocated(pool, "r"))
    seq = states.committed("r")  # the scheduler's from here: nothing freed
    assert states.state("r") is None and pool.num_used_pages == 3
    pool.free(seq)


def test_a_quarantined_reservation_frees_its_id_and_only_its_ticket_frees_the_pages(pool):
    states = HandOvers(pool)
    states.reserved(_allocated(pool, "r"))
    ticket = states.quarantine("r")
    assert states.state(ticket) is S.QUARANTINED and states.state("r") is None
    assert states.cancel("r") is None and pool.num_used_pages == 3  # a late cancel: nothing
    states.reserved(_allocated(pool, "r"))  # the request retried while the old pages wait
    assert pool.num_used_pages == 6
    states.end_quarantine(ticket)
    assert pool.num_used_pages == 3 and states.state("r") is S.RESERVED
    with pytest.raises(HandOverError):
        states.end_quarantine(ticket)


def _kept(pool: BlockManager, max_tokens: int) -> tuple[HandOvers, Scheduler]:
    """A keep_pages request "k" added (as the engine adds one) and scheduled once."""
    states = HandOvers(pool)
    scheduler = Scheduler(SchedulerLimits(4, 64, 64), pool, frozenset(), states.retired)
    seq = Sequence("k", list(range(100, 110)), SamplingParams(max_tokens=max_tokens))
    seq.keep_pages = True
    scheduler.add(seq)
    states.kept(seq)
    return states, scheduler


def test_kept_pages_are_held_after_finishing_until_released(pool: BlockManager):
    states, scheduler = _kept(pool, 1)
    output = scheduler.schedule()
    scheduler.update(output, {"k": [7]})
    assert states.state("k") is S.HELD and pool.num_used_pages == 3
    assert states.counts()[S.HELD] == 1
    assert states.release("k") and pool.num_used_pages == 0
    assert not states.release("k")


def test_an_aborted_kept_request_frees_its_pages_once(pool: BlockManager):
    states, scheduler = _kept(pool, 4)
    scheduler.schedule()
    scheduler.abort("k")  # the scheduler frees them
    assert pool.num_used_pages == 0 and states.state("k") is S.KEPT
    assert states.release("k") and pool.num_used_pages == 0


def test_a_request_prefilled_again_while_held_supersedes_and_release_frees_oldest_first(pool):
    states = HandOvers(pool)
    first = _allocated(pool, "p")
    states.kept(first)
    states.retired(first, FinishReason.LENGTH)
    second = _allocated(pool, "p")
    states.kept(second)  # a migration's prefill of the same request
    assert states.seq("p") is second and states.counts()[S.HELD] == 1
    states.retired(second, FinishReason.LENGTH)
    assert states.release("p") and pool.num_used_pages == 3  # the first's pages
    assert states.seq("p") is second
    assert states.release("p") and pool.num_used_pages == 0


def test_moves_outside_the_diagram_are_refused(pool: BlockManager):
    states = HandOvers(pool)
    with pytest.raises(HandOverError):
        states.committed("nobody")
    with pytest.raises(HandOverError):
        states.quarantine("nobody")
    states.reserved(_allocated(pool, "r"))
    with pytest.raises(HandOverError):
        states.reserved(_allocated(pool, "r"))  # RESERVED twice
    assert not states.retired(states.seq("r"), FinishReason.STOP)  # not KEPT: nothing kept
    assert (S.HELD, S.KEPT) not in MOVES and (None, S.HELD) not in MOVES

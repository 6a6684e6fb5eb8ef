"""A simulated prefill or decode worker: the engine's own Scheduler and BlockManager; only the
time a step takes comes from the cost model. Work from outside (a new request, a reservation,
pages written by a prefill worker) runs between steps, as the engine thread's calls do."""

from __future__ import annotations

from collections.abc import Callable

from kvmesh.engine.core.handover import HandOvers
from kvmesh.engine.core.sampling_params import SamplingParams
from kvmesh.engine.core.scheduler import Scheduler, SchedulerLimits
from kvmesh.engine.core.sequence import Sequence
from kvmesh.engine.kv import BlockHasher, BlockManager, BlockManagerConfig
from kvmesh.mesh.kv_events import PrefixIndex, events_to_pb
from kvmesh.mesh.worker_info import WorkerInfo
from kvmesh.proto.v1 import decode_pb2
from kvmesh_apps.sim.clock import Clock
from kvmesh_apps.sim.cost import StepShape
from kvmesh_apps.sim.presets import Preset

# (sequence, the token it sampled, whether that token ends it)
TokenCallback = Callable[[Sequence, int, bool], None]


class SimWorker:
    def __init__(self, info: WorkerInfo, preset: Preset, clock: Clock, index: PrefixIndex) -> None:
        spec = preset.worker
        hasher = BlockHasher.salted(preset.model, spec.page_size, preset.kv_dtype)
        self.pool = BlockManager(BlockManagerConfig(spec.kv_pages, spec.page_size), hasher)
        limits = SchedulerLimits(spec.max_num_seqs, spec.max_num_batched_tokens, spec.max_model_len)
        self.handovers = HandOvers(self.pool)  # a prefill's kept pages, as the engine's
        self.scheduler = Scheduler(limits, self.pool, frozenset(), self.handovers.retired)
        self.info, self.spec, self.cost = info, spec, preset.cost
        self.clock, self.index = clock, index
        self._calls: list[Callable[[], None]] = []
        self._busy = self._woken = False
        self._replies: dict[str, list[int]] = {}
        self._listeners: dict[str, TokenCallback] = {}
        self.neighbours: list[SimWorker] = []  # workers on the same host (cost: shared_slowdown)
        self.busy_s = 0.0
        self.steps = self.tokens_computed = self.preemptions = 0

    @property
    def worker_id(self) -> str:
        return self.info.worker_id

    def call(self, fn: Callable[[], None]) -> None:
        """Run `fn` between steps (at once when idle)."""
        self._calls.append(fn)
        if not self._busy and not self._woken:
            self._woken = True
            self.clock.after(0.0, self._next)

    def add(self, seq: Sequence, reply: list[int], listener: TokenCallback) -> None:
        """Queue `seq` (inside a call); it samples `reply`'s tokens in order."""
        self._replies[seq.seq_id] = reply
        self._listeners[seq.seq_id] = listener
        self.scheduler.add(seq)
        if seq.keep_pages:
            self.handovers.kept(seq)

    def join(self, seq: Sequence, reply: list[int], listener: TokenCallback) -> bool:
        """A reserved sequence whose prompt KV arrived joins the batch with reply[0] (inside a
        call); False when that token already ends it."""
        self._replies[seq.seq_id] = reply
        self._listeners[seq.seq_id] = listener
        if self.scheduler.add_prefilled(seq, reply[0]) is not None:
            self._forget(seq.seq_id)
            return False
        return True

    def reserve(self, seq: Sequence) -> int | None:
        """Pages for seq's prompt, the cached prefix taken (a decode worker's reservation):
        the number of prefix pages, or None when the pool is full now."""
        prefix = self.pool.match_prefix(seq)
        if not self.pool.allocate(seq, seq.num_tokens - prefix.num_tokens, prefix):
            return None
        self.pool.take_stamps()
        return len(prefix.page_ids)

    def import_prefix(self, seq_id: str, tokens: list[int], hashes: list[int], pages: int) -> int:
        """Register the first `pages` pages of `tokens` in this pool, as a prefill worker does
        with the pages it reads from the decode worker (plan_import); skipped when full.
        Returns the pages read (those it did not hold already)."""
        page_size = self.spec.page_size
        # one token past the pages: match_prefix leaves a token to compute
        probe = Sequence(
            f"{seq_id}:import",
            tokens[: pages * page_size + 1],
            SamplingParams(),
            block_hashes=hashes[:pages],
        )
        have = self.pool.match_prefix(probe)
        need = pages * page_size - have.num_tokens
        if need <= 0 or not self.pool.allocate(probe, need, have):
            return 0
        probe.num_computed_tokens = pages * page_size
        self.pool.cache_full_pages(probe, probe.num_computed_tokens)
        self.pool.free(probe)
        self.pool.take_stamps()
        self._publish()
        return need // page_size

    def release(self, seq_id: str) -> None:
        self.handovers.release(seq_id)
        self._publish()

    def load_tokens(self) -> tuple[int, int]:
        return self.scheduler.token_loads()

    def _next(self) -> None:
        self._woken = False
        while self._calls:
            calls, self._calls = self._calls, []
            for fn in calls:
                fn()
        output = self.scheduler.schedule()
        self.preemptions += len(output.preempted)
        self.pool.take_stamps()
        self._publish()
        if output.is_empty:
            return
        shape = StepShape.of(output)
        took = self.cost.step_s(shape)
        if any(w._busy for w in self.neighbours):
            took *= 1 + self.cost.shared_slowdown(self.info.role)
        self._busy = True
        self.clock.after(took, self._done, output, took, shape.tokens)

    def _done(self, output, took: float, tokens: int) -> None:
        sampled: dict[str, list[int]] = {}
        for chunk in output.chunks:
            if chunk.sample:
                seq = chunk.seq
                reply = self._replies[seq.seq_id]
                sampled[seq.seq_id] = [reply[min(seq.num_output_tokens, len(reply) - 1)]]
        self.scheduler.update(output, sampled)
        self._publish()
        self.busy_s += took
        self.steps += 1
        self.tokens_computed += tokens
        for chunk in output.chunks:
            token = sampled.get(chunk.seq.seq_id)
            listener = self._listeners.get(chunk.seq.seq_id)
            if token is not None and listener is not None:
                ends = chunk.seq.finish_reason is not None
                if ends:
                    self._forget(chunk.seq.seq_id)
                listener(chunk.seq, token[0], ends)
        self._busy = False
        self._next()

    def _forget(self, seq_id: str) -> None:
        self._replies.pop(seq_id, None)
        self._listeners.pop(seq_id, None)

    def _publish(self) -> None:
        """This step's KV events into the router's prefix index (the gateway follows every
        worker's SubscribeKvEvents stream into the same PrefixIndex)."""
        events = self.pool.take_events()
        if events:
            batch = decode_pb2.KvEventBatch(worker_id=self.worker_id, events=events_to_pb(events))
            self.index.apply(batch)

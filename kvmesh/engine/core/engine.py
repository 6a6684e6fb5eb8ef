"""The token-level engine: add requests, step, abort. generate -> step -> schedule -> run -> update."""

from __future__ import annotations

import itertools
import time
from collections import abc
from typing import Any

import structlog
import torch

from kvmesh import env
from kvmesh.config import EngineConfig
from kvmesh.engine.attention import get_backend
from kvmesh.engine.core.admission import Admission
from kvmesh.engine.core.engine_setup import TORCH_DTYPES, engine_platform, load_engine_model
from kvmesh.engine.core.faults import FaultInjector
from kvmesh.engine.core.handover import HandOvers, HandOverState
from kvmesh.engine.core.handover_ops import EngineHandOver
from kvmesh.engine.core.integrity_check import IntegrityCheck
from kvmesh.engine.core.listeners import EngineListeners
from kvmesh.engine.core.outputs import Reservation, TokenOutput
from kvmesh.engine.core.sampling_params import SamplingParams
from kvmesh.engine.core.scheduler import Scheduler, SchedulerLimits
from kvmesh.engine.core.sequence import FinishReason, Sequence
from kvmesh.engine.core.step import ChunkPlan, StepPlan
from kvmesh.engine.kv import BlockHasher, BlockManager, BlockManagerConfig
from kvmesh.engine.loader import load_weights
from kvmesh.engine.parallel.leader import LeaderRunner
from kvmesh.engine.parallel.ranks import start_ranks
from kvmesh.engine.parallel.shard import TensorShard
from kvmesh.engine.pool.integrity import PageTags
from kvmesh.engine.pool.kv_cache import PagedKVCache
from kvmesh.engine.pool.kv_pages import KvPages, StagedKvPages
from kvmesh.engine.pool.page_io import PageIO
from kvmesh.engine.runner.constraints import Constraints
from kvmesh.engine.runner.runner import ModelRunner, RunnerOptions
from kvmesh.engine.runner.sample_step import sample_step
from kvmesh.engine.runner.sampler import Sampler
from kvmesh.engine.runner.warm_up import padding_pass
from kvmesh.engine.serving.kv_event_fanout import KvEventFanOut
from kvmesh.engine.spec.proposer import DraftSource
from kvmesh.engine.spec.speculator import build_speculator
from kvmesh.errors import CapacityError

__all__ = ["Engine", "Reservation", "TokenOutput"]
log = structlog.get_logger(__name__)
_score_ids = itertools.count()


class Engine:
    """Add requests, step, abort; the P/D hand-over (reserve / commit / release) is
    `engine.handover` (handover_ops.py), its states handover.py's."""

    def __init__(
        self,
        config: EngineConfig,
        draft: DraftSource | None = None,
        listeners: EngineListeners | None = None,
    ) -> None:
        """`draft`: where EAGLE drafts come from when they are not drafted in process (the
        mesh's draft service); `listeners`: what the host hears (metrics)."""
        self.listeners = listeners or EngineListeners()
        started = time.perf_counter()
        ranks = config.parallel.world_size  # each rank a share of the CPUs given
        torch.set_num_threads(max(1, env.serve_threads() // ranks))  # KVMESH_NUM_THREADS, else CPUs
        serve_threads = torch.get_num_threads()
        torch.set_num_threads(env.load_threads() or serve_threads)  # see docs/benchmarks.md
        torch.manual_seed(config.load.seed)
        self.config = config
        self.platform = engine_platform(config)  # checked before a long load
        # load_weights by name: a bench may substitute it (kv.py converts once per run)
        shard = TensorShard.of(config, 0) if ranks > 1 else None
        loaded = load_engine_model(config, load_weights, shard, self.platform)
        # the other ranks load after rank 0 (a converted model is then in the cache for them)
        self.ranks = (
            start_ranks(config, loaded, serve_threads, self.platform) if ranks > 1 else None
        )
        try:  # a failure from here on must not leave the other ranks running
            self._build(config, loaded, serve_threads, draft)
        except BaseException:
            self.close()
            raise
        log.info(
            "engine.ready",
            model=self.source.name,
            dtype=config.compute_dtype,
            weights=config.load.weights,
            kv_dtype=self.kv_dtype,
            kv_integrity=config.cache.kv_integrity,
            pages=self.kv_cache.num_pages,
            capacity_tokens=self.kv_cache.capacity_tokens,
            init_s=round(time.perf_counter() - started, 3),
        )

    def _build(
        self, config: EngineConfig, loaded: Any, serve_threads: int, draft: DraftSource | None
    ) -> None:
        """Everything past the weights and the ranks: pages, scheduler, runner, sampler."""
        ranks = config.parallel.world_size
        self.source, self.model_config = loaded.source, loaded.config
        self.tokenizer, model = loaded.tokenizer, loaded.model
        self.max_model_len = loaded.max_model_len
        dtype = TORCH_DTYPES[config.compute_dtype]
        self.kv_dtype = config.resolved_kv_dtype
        spec = model.kv_spec(config.cache.page_size, self.kv_dtype)
        self.kv_spec = spec
        platform = self.platform
        backend = get_backend(config.device.attention_backend, spec.layers[0].kind, platform)
        if self.ranks is None:
            num_pages = config.cache.num_pages
            if not num_pages:  # sized from the budget (a GPU's: after a warm-up pass)
                rows = config.scheduler.max_num_batched_tokens  # the largest step's
                warm_up = padding_pass(model, spec, backend, rows, dtype, platform)
                num_pages = spec.pages_for_budget(
                    platform.kv_budget(config.cache.kv_cache_bytes, warm_up)
                )
            pool = platform.new_pool(spec, num_pages, config.cache.kv_hugepages)
            self.kv_cache = PagedKVCache(spec, num_pages, dtype, pool=pool)
            staged = platform.kv_transfer(config.device.kv_transfer) == "staged"
            # what transfers see of the pool
            self.kv_pages = (StagedKvPages.single if staged else KvPages.whole)(self.kv_cache)
        else:  # every rank's pages in memory rank 0 maps too
            self.kv_cache, self.kv_pages = self.ranks.kv_pool(loaded.config, config, dtype)
        num_pages = self.kv_cache.num_pages
        torch.set_num_threads(serve_threads)
        self.page_tags = PageTags(self.kv_cache.tags)
        self.faults = FaultInjector.from_env(self.listeners.fault_injected)  # tests only
        # A sequence longer than the whole pool could never be rescheduled after preemption.
        self.max_model_len = min(self.max_model_len, self.kv_cache.capacity_tokens)
        self.block_manager = BlockManager(
            BlockManagerConfig(
                num_pages, config.cache.page_size, config.cache.enable_prefix_caching
            ),
            BlockHasher.salted(self.source.name, config.cache.page_size, self.kv_dtype),
        )
        self.page_io = PageIO(self.block_manager, self.kv_pages)  # to / from a KV store
        self.handovers = HandOvers(self.block_manager)
        self.scheduler = Scheduler(
            SchedulerLimits(
                config.scheduler.max_num_seqs,
                config.scheduler.max_num_batched_tokens,
                self.max_model_len,
            ),
            self.block_manager,
            self.tokenizer.eos_token_ids,
            on_retire=self._retired,
        )
        self.speculator = build_speculator(
            config,
            self.source.name,
            model,
            self.max_model_len,
            draft,
            self.listeners.speculation,
        )
        options = RunnerOptions(
            # ranks meet inside a pass: they step eager
            platform.decode_step(config.device.decode_step) if ranks == 1 else "eager",
            config.scheduler.max_num_seqs,
            self.max_model_len,
            config.parallel.micro_batches,
            self.speculator.capture if self.speculator else (),
            platform.graph_recorder(),
        )
        self.runner = (
            LeaderRunner(model, self.kv_cache, backend, options, self.ranks)
            if self.ranks
            else ModelRunner(model, self.kv_cache, backend, options)
        )
        self.sampler = Sampler()
        self.constraints = Constraints(self.tokenizer.hf, self.model_config.vocab_size)
        self.admission = Admission(
            self.model_config.vocab_size,
            self.max_model_len,
            loaded.context_note,
            self.constraints,
            self.sampler,
            self._in_use,
        )
        self.handover = EngineHandOver(
            self.handovers,
            self.admission,
            self.block_manager,
            self.scheduler,
            self.page_tags,
            self.speculator,
        )
        self.integrity_check = IntegrityCheck(
            self.page_tags,
            self.block_manager,
            self.scheduler,
            config.cache.kv_integrity_action == "recompute",
            self.abort,
            self.listeners.integrity_failure,
        )
        # the prefix cache's stored/removed events after each step, to whoever follows them
        self.kv_events = KvEventFanOut()

    @property
    def rank_pids(self) -> list[int]:
        """The other tensor-parallel ranks' processes (none for one rank)."""
        return [] if self.ranks is None else self.ranks.pids

    def serviceable(self) -> bool:
        """False once a tensor-parallel rank is gone: no pass can run again."""
        return self.ranks is None or self.ranks.alive()

    def close(self) -> None:
        """Stop the other ranks of a tensor-parallel engine (nothing to do for one rank)."""
        if self.ranks is not None:
            self.ranks.close()

    @property
    def model_name(self) -> str:
        return self.source.name

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        keep_pages: bool = False,
        cache_salt: str = "",
        resumed: abc.Sequence[int] = (),
    ) -> None:
        """Queue a request. With keep_pages its pages outlive it until `release` (prefill).
        `resumed`: output tokens another worker already sent (a migrated request goes on)."""
        seq = self.admission.sequence(request_id, prompt_token_ids, params, cache_salt, resumed)
        seq.keep_pages = keep_pages
        try:
            self.scheduler.add(seq)
        except BaseException:
            self.admission.forget(request_id)
            raise
        if keep_pages:
            self.handovers.kept(seq)

    def _in_use(self, request_id: str) -> bool:
        running = self.scheduler.get(request_id) is not None
        return running or self.handovers.state(request_id) is HandOverState.RESERVED

    def _retired(self, seq: Sequence, reason: FinishReason) -> bool:
        """The scheduler's, as a sequence ends: True when a hand-over keeps its pages; else a
        finished one's pages are exported (to a KV store, when one is attached)."""
        if self.handovers.retired(seq, reason):
            return True
        if reason is not FinishReason.ABORT:
            self.page_io.retired(seq)
        return False

    def score(self, token_ids: list[int]) -> torch.Tensor:
        """Logits [T, V] at every position of `token_ids` through the paged path (perplexity)."""
        self.admission.validate(token_ids)
        seq = Sequence(f"score-{next(_score_ids)}", list(token_ids), SamplingParams(max_tokens=1))
        if not self.block_manager.allocate(seq, len(token_ids)):
            raise CapacityError(f"{len(token_ids)} tokens do not fit in the free KV pages")
        chunk = ChunkPlan(seq.seq_id, 0, len(token_ids), True)
        try:
            return self.runner.score(
                StepPlan.one_shot(seq.seq_id, token_ids, seq.block_table, seq.page_tags, chunk)
            )
        finally:
            self.block_manager.free(seq)

    def abort(self, request_id: str) -> bool:
        """Stop a waiting or running request and free its pages. Pages a finished keep_pages
        request holds stay: a transfer or a store offer may still read them (see `drop`)."""
        seq = self.scheduler.abort(request_id)
        self.admission.forget(request_id)
        if self.speculator is not None:
            self.speculator.release([request_id])
        return seq is not None

    def drop(self, request_id: str) -> bool:
        """Abort, and free the pages it keeps after finishing: for a consumer that went away
        before it read them (nobody else holds a keep_pages request's pages)."""
        aborted = self.abort(request_id)
        released = self.handover.release(request_id)
        return aborted or released

    def finish(self, request_id: str, reason: FinishReason) -> None:
        """End a request early (e.g. a stop string found by the detokenizer)."""
        self.scheduler.finish(request_id, reason)
        self.admission.forget(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[TokenOutput]:
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running)
            if self.constraints:  # some request has a grammar
                self._cut_drafts()
        output = self.scheduler.schedule()
        self.page_tags.stamp(self.block_manager.take_stamps())
        failed: list[TokenOutput] = []
        if self.faults is not None:
            self.faults.before_check(self.block_manager, self.kv_cache, output)
        self.runner.apply(output.step)  # its block tables are what the check reads
        if self.config.cache.kv_integrity and not output.is_empty:
            output, failed = self.integrity_check(output, self.runner.tables)
        if output.is_empty:
            return failed
        result = self.runner.execute(output.step.chunks)
        drafts, stats = {}, None
        if self.speculator is not None:  # only a speculator's requests carry drafts
            drafts = {c.seq.seq_id: c.draft for c in output.chunks if c.draft}
            stats = self.speculator.stats
        by_id = {c.seq.seq_id: c.seq for c in output.chunks}
        seqs = [by_id[req_id] for req_id in result.req_ids]
        tokens, logprobs = (
            sample_step(result, seqs, self.sampler, drafts, stats, self.constraints)
            if seqs
            else ({}, {})
        )
        finished = {s.seq_id for s in self.scheduler.update(output, tokens)}
        if self.constraints:  # a finished one's last token may be EOS, which ends no grammar
            for seq in seqs:
                if seq.seq_id in self.constraints and seq.seq_id not in finished:
                    self.constraints.commit(seq.seq_id, tokens[seq.seq_id])
        for seq_id in finished:
            self.admission.forget(seq_id)
        if self.speculator is not None:
            self.speculator.observe(output.chunks, self.runner)
            self.speculator.release(finished)
        events = self.block_manager.take_events()
        if events:
            self.kv_events.publish(events)
        outputs = []
        for seq in seqs:  # no call per row here: host work per step is one of issue 14's bars
            seq_id, done = seq.seq_id, seq.seq_id in finished
            emitted = tokens[seq_id]
            outputs.append(
                TokenOutput(
                    seq_id,
                    emitted,
                    logprobs[seq_id][: len(emitted)],
                    done,
                    seq.finish_reason if done else None,
                    len(seq.prompt_token_ids),
                    seq.num_cached_tokens,
                )
            )
        return outputs + failed

    def _cut_drafts(self) -> None:
        """Drafts of a constrained request end before the first token its grammar rejects."""
        for seq in self.scheduler.running:
            if seq.draft_token_ids and seq.seq_id in self.constraints:
                keep = self.constraints.allowed_prefix(seq.seq_id, seq.draft_token_ids)
                del seq.draft_token_ids[keep:]

"""The simulated gateway: the real Router (policy, load estimates, prefix index) picks the
workers; session pins, reservations, the prefill hand-over and the token stream follow
services/gateway/mesh_backend.py and services/decode/worker.py step by step, each service hop
taking the cost model's `rpc_s`."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

from kvmesh.engine.core.sampling_params import SamplingParams
from kvmesh.engine.core.sequence import Sequence
from kvmesh.engine.kv import BlockHasher
from kvmesh.mesh.error_mapping import WorkerUnavailableError
from kvmesh.routing.prefix import PromptKey
from kvmesh.routing.router import Router
from kvmesh.routing.sessions import Pin
from kvmesh_apps.sim.clock import Clock
from kvmesh_apps.sim.presets import Preset
from kvmesh_apps.sim.worker import SimWorker
from kvmesh_apps.sim.workload import Session

RESERVE_POLL_S = 0.05  # as services/decode/worker.py
RESERVE_TIMEOUT_S = 30.0


@dataclass
class Record:
    """One request as its client saw it."""

    session_id: str
    turn: int
    sent_s: float
    prompt_tokens: int
    cached_tokens: int = 0
    token_times: list[float] = field(default_factory=list)
    decode: str = ""
    prefill: str = ""
    error: str = ""

    @property
    def ttft_s(self) -> float | None:
        return self.token_times[0] - self.sent_s if self.token_times else None

    @property
    def tpot_s(self) -> float | None:
        times = self.token_times
        return (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None


@dataclass
class _Flight:
    record: Record
    prompt: list[int]
    key: PromptKey
    reply: list[int]
    decode: SimWorker
    prefill: SimWorker | None
    done: Callable[[list[int] | None], None]
    holds: contextlib.ExitStack
    prefilling: contextlib.ExitStack
    affinity_id: str | None
    seq: Sequence | None = None
    skip_pages: int = 0
    tokens: list[int] = field(default_factory=list)
    waited_s: float = 0.0


class SimGateway:
    def __init__(
        self, clock: Clock, router: Router, workers: dict[str, SimWorker], preset: Preset
    ) -> None:
        self.clock, self.router, self.workers = clock, router, workers
        self.preset = preset
        self.rpc_s = preset.cost.rpc_s
        self.pins: dict[str, Pin] = {}
        self.records: list[Record] = []
        self._ids = 0
        self._layout = (preset.worker.page_size, preset.kv_dtype)
        self._hasher = BlockHasher.salted(preset.model, *self._layout)
        self._hashes: dict[str, list[int]] = {}

    def send(self, session: Session, done: Callable[[list[int] | None], None]) -> None:
        """Route the session's next turn; `done` gets the reply tokens (None: it failed)."""
        prompt, reply = session.prompt(), session.replies[session.turn]
        record = Record(session.session_id, session.turn + 1, self.clock.now, len(prompt))
        self.records.append(record)
        refused = self._refused(len(prompt), len(reply))
        if refused:  # what the worker would answer (ContextLengthError / CapacityError)
            record.error = refused
            done(None)
            return
        key = self._key(session.session_id, prompt)
        pin = self.pins.get(session.affinity_id or "")
        try:
            decode = self.router.pick(
                "decode", len(prompt) + len(reply), (), pin and pin.decode, key
            ).worker
        except WorkerUnavailableError as exc:
            record.error = str(exc)
            done(None)
            return
        prefill = self._pick_prefill(key, decode, pin and pin.prefill)
        holds, prefilling = contextlib.ExitStack(), contextlib.ExitStack()
        holds.enter_context(self.router.holding(decode.worker_id, len(prompt) + len(reply)))
        if prefill is not None:
            prefilling.enter_context(self.router.holding(prefill.worker_id, len(prompt)))
        record.decode, record.prefill = decode.worker_id, prefill.worker_id if prefill else ""
        flight = _Flight(
            record,
            prompt,
            key,
            reply,
            self.workers[decode.worker_id],
            self.workers[prefill.worker_id] if prefill else None,
            done,
            holds,
            prefilling,
            session.affinity_id,
        )
        self.clock.after(self.rpc_s, self._at_decode, flight)

    def _refused(self, prompt: int, reply: int) -> str:
        spec = self.preset.worker
        if prompt + 1 > spec.max_model_len:
            return f"context length: {prompt} prompt tokens, max_model_len {spec.max_model_len}"
        if -(-(prompt + 1) // spec.page_size) > spec.kv_pages:
            return f"capacity: {prompt} prompt tokens need more than {spec.kv_pages} pages"
        return ""

    def _key(self, session_id: str, prompt: list[int]) -> PromptKey:
        """The prompt's key, its page hashes extended from the session's previous prompt (a
        prefix of this one): hashing every prompt whole was most of the simulator's time."""
        hashes = self._hashes.setdefault(session_id, [])
        self._hasher.extend(prompt, hashes)
        return PromptKey(self.preset.model, prompt, "", {self._layout: list(hashes)})

    def _sequence(self, seq_id: str, f: _Flight, params: SamplingParams, **kw) -> Sequence:
        hashes = list(f.key.hashes(*self._layout))
        return Sequence(seq_id, f.prompt, params, block_hashes=hashes, **kw)

    def _pick_prefill(self, key: PromptKey, decode, preferred: str | None):
        try:
            return self.router.pick(
                "prefill", len(key.token_ids), (), preferred or None, key, paired_with=decode
            ).worker
        except WorkerUnavailableError:
            return None

    def _new_id(self) -> str:
        self._ids += 1
        return f"r{self._ids}"

    def _at_decode(self, f: _Flight) -> None:
        params = SamplingParams(max_tokens=len(f.reply), ignore_eos=True)
        f.seq = self._sequence(self._new_id(), f, params)
        local = len(f.prompt) <= f.decode.spec.local_prefill_tokens
        if f.prefill is None or local:
            f.decode.call(lambda: f.decode.add(f.seq, f.reply, self._listener(f)))
        else:
            f.decode.call(lambda: self._reserve(f))

    def _reserve(self, f: _Flight) -> None:
        skip = f.decode.reserve(f.seq)
        if skip is None:
            f.waited_s += RESERVE_POLL_S
            if f.waited_s > RESERVE_TIMEOUT_S:
                self._fail(f, "overloaded: no free KV pages on the decode worker")
            else:
                self.clock.after(RESERVE_POLL_S, f.decode.call, lambda: self._reserve(f))
            return
        f.skip_pages = skip
        self.clock.after(self.rpc_s, self._at_prefill, f)

    def _at_prefill(self, f: _Flight) -> None:
        """The prefill worker registers the prefix pages the decode worker holds beyond its own
        (read over the transfer engine: the time of those pages), then computes the rest and
        samples the first token."""
        prefill = f.prefill
        params = SamplingParams(max_tokens=1, ignore_eos=True)
        seq = self._sequence(f.seq.seq_id + ":p", f, params, keep_pages=True)
        add = lambda: prefill.add(seq, f.reply, lambda s, t, e: self._prefilled(f, s, t))  # noqa: E731

        def read_then_add() -> None:
            read = prefill.import_prefix(seq.seq_id, f.prompt, seq.block_hashes, f.skip_pages)
            read_s = self.preset.cost.transfer_s(read, prefill.spec.page_size)
            self.clock.after(read_s, prefill.call, add)

        prefill.call(read_then_add if f.skip_pages else add)

    def _prefilled(self, f: _Flight, seq: Sequence, token: int) -> None:
        """The prompt's first token: the worker asks its engine for the pages (`pages_of`, an
        engine call) -- by then the engine thread is in its next step, so the call waits for
        that step to end -- then writes them to the decode worker."""
        self.clock.after(0.0, f.prefill.call, lambda: self._hand_over(f, seq))

    def _hand_over(self, f: _Flight, seq: Sequence) -> None:
        page_size = f.decode.spec.page_size
        pages = -(-len(f.prompt) // page_size) - f.skip_pages
        moved_s = self.preset.cost.transfer_s(pages, page_size)
        self.clock.after(moved_s, f.prefill.call, lambda: f.prefill.release(seq.seq_id))
        cached = seq.num_cached_tokens
        self.clock.after(moved_s + self.rpc_s, f.decode.call, lambda: self._commit(f, cached))

    def _commit(self, f: _Flight, cached: int) -> None:
        f.seq.num_cached_tokens = max(f.seq.num_cached_tokens, cached)
        listener = self._listener(f)
        ends = not f.decode.join(f.seq, f.reply, listener)
        listener(f.seq, f.reply[0], ends)

    def _listener(self, f: _Flight):
        def on_token(seq: Sequence, token: int, ends: bool) -> None:
            cached = seq.num_cached_tokens
            late = self.preset.cost.finish_s if ends else 0.0
            self.clock.after(self.rpc_s + late, self._arrive, f, token, ends, cached)

        return on_token

    def _arrive(self, f: _Flight, token: int, ends: bool, cached: int) -> None:
        record = f.record
        if not f.tokens:
            record.cached_tokens = cached
            decode, prefill = f.decode.info, f.prefill.info if f.prefill else None
            self.router.prefilled(f.key, decode, prefill, cached)
            f.prefilling.close()
            if f.affinity_id:
                self.pins[f.affinity_id] = Pin(
                    prefill.worker_id if prefill else "", decode.worker_id
                )
        f.tokens.append(token)
        record.token_times.append(self.clock.now)
        if ends:
            f.holds.close()
            f.done(f.tokens)

    def _fail(self, f: _Flight, error: str) -> None:
        f.record.error = error
        f.prefilling.close()
        f.holds.close()
        f.done(None)

"""Timed batches of requests for `kvmesh bench kv`: one engine's run as a whole, or several
engines' runs in lockstep; each records the running queue's peak, preemptions and the time
inside the integrity check."""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Iterator
from dataclasses import dataclass

from kvmesh_apps.benchmarks.lockstep import lockstep

_ids = itertools.count()


@dataclass(frozen=True)
class Run:
    """One timed batch of requests."""

    tokens: int
    seconds: float
    max_running: int  # most sequences in the running queue after any schedule()
    preemptions: int
    check_seconds: float  # inside PageTags.mismatched
    check_calls: int

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds


@contextlib.contextmanager
def traced(engine) -> Iterator[dict]:
    """Instance-level wrappers that record the scheduler's running queue (peak size,
    preemptions) and the time spent in the integrity check, while the block runs."""
    schedule, mismatched = engine.scheduler.schedule, engine.page_tags.mismatched
    seen: dict[str, object] = {}
    stats: dict = {"peak": 0, "check": 0.0, "calls": 0, "seen": seen}

    def traced_schedule():
        out = schedule()
        stats["peak"] = max(stats["peak"], len(engine.scheduler.running))
        seen.update((seq.seq_id, seq) for seq in engine.scheduler.running)
        return out

    def timed_mismatched(*args):
        start = time.perf_counter()
        try:
            return mismatched(*args)
        finally:
            stats["check"] += time.perf_counter() - start
            stats["calls"] += 1

    engine.scheduler.schedule, engine.page_tags.mismatched = traced_schedule, timed_mismatched
    try:
        yield stats
    finally:
        del engine.scheduler.schedule, engine.page_tags.mismatched


def _run(stats: dict, tokens: int, seconds: float) -> Run:
    preemptions = sum(seq.num_preemptions for seq in stats["seen"].values())
    return Run(tokens, seconds, stats["peak"], preemptions, stats["check"], stats["calls"])


def _params(max_tokens: int):
    from kvmesh import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def timed_run(llm, prompts: list[list[int]], max_tokens: int) -> Run:
    """Generate for all prompts at once, timed as a whole."""
    llm.engine.block_manager.reset_prefix_cache()
    with traced(llm.engine) as stats:
        start = time.perf_counter()
        outs = llm.generate_ids(prompts, _params(max_tokens))
        seconds = time.perf_counter() - start
    errors = [o.error for o in outs if o.error is not None]
    if errors:
        raise RuntimeError(f"{len(errors)} request(s) failed, e.g. {errors[0]}")
    return _run(stats, sum(len(o.token_ids) for o in outs), seconds)


def lockstep_runs(llms: dict, prompts: list[list[int]], max_tokens: int) -> dict[str, Run]:
    """The same prompts on every engine at once, the engines stepped in lockstep
    (benchmarks/lockstep.py); each run's seconds are its own engine's steps."""
    tokens = dict.fromkeys(llms, 0)

    def collect(name: str, outputs: list) -> None:
        for out in outputs:
            if out.error is not None:
                raise RuntimeError(f"request {out.request_id} failed: {out.error}")
            tokens[name] += len(out.new_token_ids)

    params = _params(max_tokens)
    with contextlib.ExitStack() as stack:
        stats = {name: stack.enter_context(traced(llm.engine)) for name, llm in llms.items()}
        for name, llm in llms.items():
            llm.engine.block_manager.reset_prefix_cache()
            for i, prompt in enumerate(prompts):
                llm.engine.add_request(f"kv-{name}-{next(_ids)}-{i}", prompt, params)
        spent = lockstep({name: llm.engine for name, llm in llms.items()}, collect)
    return {name: _run(stats[name], tokens[name], spent[name].seconds) for name in llms}

"""An engine whose page pool holds two contexts of `prompts`, so running them all preempts."""

from __future__ import annotations

from kvmesh import LLM, SamplingParams


def generate_under_preemption(prompts: list[list[int]], params: SamplingParams):
    """(the outputs, the engine) of `prompts` run where the pool forces preemption; asserts
    that it did."""
    need = max(map(len, prompts)) + params.max_tokens
    tiny = LLM(dtype="fp32", num_pages=(2 * need) // 16 + 2, max_num_batched_tokens=32)
    preempted: list[str] = []
    schedule = tiny.engine.scheduler.schedule

    def spy():
        out = schedule()
        preempted.extend(out.preempted)
        return out

    tiny.engine.scheduler.schedule = spy
    outputs = tiny.generate_ids(prompts, params)
    assert preempted, "the page budget was meant to force preemption"
    return outputs, tiny.engine

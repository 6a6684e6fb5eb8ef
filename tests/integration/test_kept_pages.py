"""A prefill keeps its pages after finishing (keep_pages) until they are handed over and
released; when its caller goes away first (the stream closed before the last output was taken)
they are freed too -- a chaos run found 24 pages held on a prefill worker. An Abort leaves them:
the worker's transfer or KV-store offer may still be reading them."""

from __future__ import annotations

import asyncio

from kvmesh import SamplingParams
from kvmesh.engine.core.handover import HandOverState
from kvmesh.engine.serving.async_engine import AsyncEngine

ASK = [{"role": "user", "content": "Name three rivers of Europe."}]


def test_drop_frees_the_pages_a_finished_prefill_keeps_abort_does_not(llm):
    engine = llm.engine
    prompt = llm.tokenizer.encode_chat(ASK)
    before = engine.block_manager.num_used_pages
    engine.add_request("kept-abort", prompt, SamplingParams(max_tokens=1), keep_pages=True)
    while engine.has_unfinished():
        engine.step()
    assert engine.handovers.state("kept-abort") is HandOverState.HELD
    held = engine.block_manager.num_used_pages
    assert held > before
    assert not engine.abort("kept-abort")  # an Abort: a transfer may still read the pages
    assert engine.block_manager.num_used_pages == held
    assert engine.drop("kept-abort")  # the consumer is gone: nobody reads them
    assert engine.block_manager.num_used_pages == before
    assert not engine.drop("kept-abort")  # nothing left


def test_a_prefill_stream_closed_before_its_last_output_frees_its_pages(llm):
    engine = llm.engine
    prompt = llm.tokenizer.encode_chat(ASK)
    before = engine.block_manager.num_used_pages

    async def closed_early() -> None:
        runner = AsyncEngine(engine)
        runner.start()
        try:
            params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
            stream = runner.generate("kept-closed", prompt, params, True)
            assert not (await stream.__anext__()).finished
            while engine.handovers.state("kept-closed") is not HandOverState.HELD:  # finished
                await asyncio.sleep(0.01)
            await stream.aclose()  # the caller went away (a cancelled Prefill call)
            assert engine.block_manager.num_used_pages == before
        finally:
            runner.stop()

    asyncio.run(asyncio.wait_for(closed_early(), 60))

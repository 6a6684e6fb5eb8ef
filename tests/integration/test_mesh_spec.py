"""Speculative decoding through the mesh (real processes, openai client): greedy answers equal
the single-process engine's without speculation, for the n-gram proposer and for the EAGLE
head on the draft service (with the prefill worker handing its window to decode)."""

from __future__ import annotations

import asyncio
import functools
import urllib.request

import pytest

from kvmesh import SamplingParams
from kvmesh.engine.spec.prompts import chat_prompts, split, structured_prompts
from kvmesh.mesh.launcher import UpOptions, list_workers
from kvmesh.mesh.up_config import worker_configs
from tests.integration.chat_client import chat_text, client_for
from tests.integration.mesh_probes import running_mesh

pytestmark = pytest.mark.timeout(600)
SETUPS = {
    "ngram": ("--speculative", "ngram"),
    "eagle-remote": ("--speculative", "eagle", "--draft", "remote"),
}

# Two drafts a step, always (the adaptive policy may turn drafting off on a slow, loaded machine,
# and these tests are about answers under drafts; the policy has its own tests): 3 rows a request.
DRAFTS = ("--speculative-policy", "fixed", "--num-speculative-tokens", "2")
IN_FLIGHT = 10  # 30 rows a step: agent_schemas.mesh_answers


@pytest.fixture(scope="module", params=sorted(SETUPS))
def mesh(request):
    args = (*SETUPS[request.param], *DRAFTS, "--kv-cache-memory", "64MiB")
    with running_mesh(
        UpOptions(workers=worker_configs(*args), prefill=1, decode=1, kvstore="none")
    ) as running:
        yield request.param, running


# A prompt whose drafts the target accepts (copying the prompt), so acceptance > 0 is certain.
COPY = (
    'Copy this JSON exactly, nothing else: {"name": "Ada Lovelace", "born": 1815, '
    '"fields": ["mathematics", "computing"], "city": "London"}'
)


def _metric(address: str, name: str) -> float:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as r:
        text = r.read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


def test_greedy_through_the_mesh_equals_the_engine_without_speculation(mesh, llm):
    name, running = mesh
    client = client_for(running)
    _, held = split(chat_prompts() + structured_prompts(), 24)
    prompts = [COPY] + [p for p in held if p in set(structured_prompts())][:2] + held[:1]
    for i, prompt in enumerate(prompts):
        messages = [{"role": "user", "content": prompt}]
        want = _engine_answer(llm, prompt)
        got = chat_text(
            client,
            bool(i % 2),
            model="smollm2-135m",
            messages=messages,
            max_tokens=48,
            temperature=0.0,
        )
        assert got == want, (name, prompt)
    drafted, accepted = _drafts(running)
    assert drafted > 0 and 0 < accepted <= drafted, (name, drafted, accepted)
    if name == "eagle-remote":
        workers = asyncio.run(list_workers(running.etcd.endpoint, "default"))
        assert any(w.role == "draft" for w in workers)


@functools.cache
def _engine_answer(llm, prompt: str) -> str:
    """The engine's greedy answer without speculation, computed once for both meshes."""
    llm.engine.block_manager.reset_prefix_cache()
    messages = [{"role": "user", "content": prompt}]
    return llm.chat(messages, SamplingParams(max_tokens=48, temperature=0.0))[0].text


def _drafts(running) -> tuple[float, float]:
    """The decode worker's (drafted, accepted) token counts so far."""
    workers = asyncio.run(list_workers(running.etcd.endpoint, "default"))
    decode = next(w for w in workers if w.role == "decode")
    return tuple(
        _metric(decode.metrics_address, f"kvmesh_spec_{kind}_tokens_total")
        for kind in ("draft", "accepted")
    )


def test_schema_suite_with_speculation_equals_the_engine(mesh, llm):
    """The structured-output suite with drafts (n-gram; EAGLE on the draft service), each
    drafting method half of its cases in turn (every case under drafts once): drafts cut at the
    grammar's first rejection, answers equal to the engine's without speculation; drafts were
    made and accepted during the suite (under its grammars)."""
    from tests.integration import agent_schemas

    name, running = mesh
    half = sorted(SETUPS).index(name)
    cases = agent_schemas.cases()[half::2]
    want = agent_schemas.suite_reference(llm)[half::2]
    before = _drafts(running)
    got = agent_schemas.mesh_answers(
        client_for(running), [agent_schemas.body(case) for case in cases], IN_FLIGHT
    )
    for case, answer, expected in zip(cases, got, want, strict=True):
        assert answer == expected, (name, case["name"])
        agent_schemas.check(case, answer)
    (drafted, accepted), (drafted0, accepted0) = _drafts(running), before
    assert drafted > drafted0 and accepted > accepted0, (name, before, drafted, accepted)

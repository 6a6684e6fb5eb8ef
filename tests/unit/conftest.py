"""Fixtures of the gateway's API tests: the default model's tokenizer, a scripted backend, the
gateway app over it (in process, or on a real server with the official openai client)."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest
from starlette.testclient import TestClient

from kvmesh.engine.loader import resolve_model
from kvmesh.engine.tokenizer import Tokenizer
from tests.unit.fake_backend import FakeBackend, serve_app


@pytest.fixture(scope="session")
def tok() -> Tokenizer:
    return Tokenizer.from_source(resolve_model("smollm2-135m"))


@pytest.fixture
def openai_served(tok: Tokenizer) -> Iterator[tuple[openai.OpenAI, FakeBackend]]:
    """(client, backend): the backend replies token by token what a test scripts."""
    from services.gateway.openai_api import create_app

    backend = FakeBackend(tok, tokens_per_chunk=1)
    with serve_app(create_app(backend, tok)) as url:
        yield openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=30), backend


@pytest.fixture
def backend(tok: Tokenizer) -> FakeBackend:
    return FakeBackend(tok)


@pytest.fixture
def client(backend: FakeBackend, tok: Tokenizer) -> Iterator[TestClient]:
    """The OpenAI REST app over `backend`, in process."""
    from services.gateway.openai_api import create_app

    with TestClient(create_app(backend, tok)) as test_client:
        yield test_client

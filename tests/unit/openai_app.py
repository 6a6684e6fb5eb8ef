"""What the OpenAI REST tests share: the request they send and readers of the replies."""

from __future__ import annotations

import json
from typing import Any

from starlette.testclient import TestClient

MODEL = "smollm2-135m"


MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


CHAT = "/v1/chat/completions"


COMPLETIONS = "/v1/completions"


def client_id(mesh_id: str) -> str:
    """The client's request id inside the mesh id (`unique_request_id`: id + "." + 8 hex)."""
    client_id, dot, suffix = mesh_id.rpartition(".")
    assert dot and len(suffix) == 8, mesh_id
    return client_id


def chat(client: TestClient, **fields: Any) -> Any:
    return client.post(CHAT, json={"model": MODEL, "messages": MESSAGES, **fields})


def events(response: Any) -> list[Any]:
    """The SSE data payloads: JSON objects, and the final "[DONE]" string."""
    assert response.headers["content-type"].startswith("text/event-stream")
    payloads = [line[6:] for line in response.text.split("\n\n") if line.startswith("data: ")]
    return [p if p == "[DONE]" else json.loads(p) for p in payloads]


def metric(client: TestClient, line_prefix: str) -> float:
    lines = client.get("/metrics").text.splitlines()
    return sum(float(line.split()[-1]) for line in lines if line.startswith(line_prefix))

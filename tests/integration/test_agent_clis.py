"""The agents' own command-line clients against a mesh, unchanged but for the base URL: Claude
Code (Anthropic Messages), Codex CLI (OpenAI Responses, its default dialect) and OpenCode (OpenAI
chat completions), the pinned versions `make agentclis` installs with npm. Each completes a turn:
a shell tool call, the tool's output sent back, a final answer. The model is tests/data/tool-caller
(tool_caller.py trained it to do that in these clients' 20-50k-token prompts). Everything runs in
a network namespace with only loopback: nothing the clients send (telemetry included) leaves."""

from __future__ import annotations

import json
import os
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.integration.hosts import unavailable
from tests.integration.tool_caller import OUTPUT, PROMPTS
from tests.integration.up_process import UpRun, until

pytestmark = pytest.mark.timeout(900)
ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "tests" / "data" / "tool-caller"
CLIS = ROOT / ".venv" / "agent-clis" / "node_modules" / ".bin"
WHY = unavailable() or next(
    (
        f"{CLIS / name} is missing (`make agentclis` installs it when npm is there)"
        for name in ("claude", "codex", "opencode")
        if not (CLIS / name).exists()
    ),
    None,
)
if WHY:
    pytest.skip(WHY, allow_module_level=True)


@dataclass(frozen=True)
class AgentMesh:
    namespace: str
    url: str

    def run(self, argv: list[str], env: dict[str, str], home: Path) -> str:
        """A client inside the namespace with HOME=home, in an empty folder; its output
        (stdout then stderr), asserting it exited 0."""
        work = home / "work"
        work.mkdir()
        env = {"PATH": os.environ["PATH"], "LANG": "C.UTF-8", "HOME": str(home), **env}
        started = time.monotonic()
        done = subprocess.run(
            ["ip", "netns", "exec", self.namespace, *argv],
            env=env,
            cwd=work,
            capture_output=True,
            text=True,
            timeout=600,
        )
        out = done.stdout + done.stderr
        print(f"{Path(argv[0]).name}: {time.monotonic() - started:.0f}s")  # in -s / -rP output
        assert done.returncode == 0, out[-4000:]
        return out


@pytest.fixture(scope="module")
def mesh(tmp_path_factory) -> Iterator[AgentMesh]:
    """`kvmesh up` on the tool caller inside the namespace, answering any model id (the clients
    name their own), fp32 so that its choices do not depend on the CPU's bf16 kernels. Every
    worker computes on all CPUs: the clients send one request at a time, and their first
    prompts (20-50k tokens) take the prefill worker's attention most of a turn (on one thread,
    as `kvmesh up` runs it beside a busy decode worker on 2 CPUs, twice as long)."""
    namespace = f"kvm-agents-{uuid.uuid4().hex[:6]}"
    subprocess.run(["ip", "netns", "add", namespace], check=True, capture_output=True)
    run = None
    try:
        lo = ["ip", "netns", "exec", namespace, "ip", "link", "set", "lo", "up"]
        subprocess.run(lo, check=True, capture_output=True)
        options = ("--model", str(MODEL), "--any-model", "--dtype", "fp32")
        wrap = ("ip", "netns", "exec", namespace)
        threads = {"KVMESH_NUM_THREADS": str(os.cpu_count() or 1)}
        run = UpRun.start(tmp_path_factory.mktemp("up"), *options, wrap=wrap, env=threads)
        until(lambda: run.said("kvmesh is up") or run.proc.poll() is not None, timeout=300)
        assert run.said("kvmesh is up"), run.output()
        yield AgentMesh(namespace, f"http://127.0.0.1:{run.http_port}")
    finally:
        if run is not None:
            run.close()
        subprocess.run(["ip", "netns", "delete", namespace], capture_output=True)


def _events(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def test_claude_code(mesh: AgentMesh, tmp_path: Path) -> None:
    env = {
        "ANTHROPIC_BASE_URL": mesh.url,
        "ANTHROPIC_API_KEY": "sk-test",
        "DISABLE_TELEMETRY": "1",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    }
    argv = [
        str(CLIS / "claude"),
        "-p",
        PROMPTS["claude"],
        "--output-format",
        "stream-json",
        "--verbose",
        "--allowedTools",
        "Bash",
    ]
    events = _events(mesh.run(argv, env, tmp_path))
    blocks = [
        b
        for e in events
        if e.get("type") in ("assistant", "user")
        for b in e["message"]["content"]
        if isinstance(b, dict)
    ]
    calls = [b for b in blocks if b["type"] == "tool_use"]
    results = [b for b in blocks if b["type"] == "tool_result"]
    assert [c["name"] for c in calls] == ["Bash"], blocks
    assert OUTPUT in json.dumps(results) and not results[0].get("is_error"), results
    assert events[-1]["type"] == "result" and events[-1]["result"].strip() == OUTPUT, events[-1]


def test_codex(mesh: AgentMesh, tmp_path: Path) -> None:
    (tmp_path / ".codex").mkdir()
    env = {"CODEX_HOME": str(tmp_path / ".codex"), "OPENAI_API_KEY": "sk-test"}
    argv = [
        str(CLIS / "codex"),
        "exec",
        "--skip-git-repo-check",
        "--json",
        "-c",
        f'openai_base_url="{mesh.url}/v1"',
        PROMPTS["codex"],
    ]
    items = [
        e["item"]
        for e in _events(mesh.run(argv, env, tmp_path))
        if e.get("type") == "item.completed"
    ]
    tools = [i for i in items if i.get("type") != "agent_message"]
    messages = [i["text"].strip() for i in items if i.get("type") == "agent_message"]
    assert tools and OUTPUT in json.dumps(tools), items
    assert messages == [OUTPUT], items


def test_opencode(mesh: AgentMesh, tmp_path: Path) -> None:
    served = MODEL.name  # OpenCode names the model it asks for in its own configuration
    provider = {
        "npm": "@ai-sdk/openai-compatible",
        "name": "kvmesh",
        "options": {"baseURL": f"{mesh.url}/v1"},
        "models": {served: {}},
    }
    config = tmp_path / "opencode.json"
    config.write_text(json.dumps({"provider": {"kvmesh": provider}, "model": f"kvmesh/{served}"}))
    argv = [str(CLIS / "opencode"), "run", "--format", "json", PROMPTS["opencode"]]
    events = _events(mesh.run(argv, {"OPENCODE_CONFIG": str(config)}, tmp_path))
    parts = [e["part"] for e in events if "part" in e]
    tools = [p for p in parts if p.get("type") == "tool"]
    texts = [p["text"].strip() for p in parts if p.get("type") == "text"]
    assert [t["tool"] for t in tools] == ["bash"], parts
    assert tools[0]["state"]["status"] == "completed" and OUTPUT in tools[0]["state"]["output"]
    assert texts and texts[-1] == OUTPUT, parts

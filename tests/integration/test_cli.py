"""`kvmesh generate` as a subprocess: the --json contract and one-line errors without tracebacks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

CHAT_ARGS = ["--json", "--chat", "--prompt", "What is the capital of France?"]


def kvmesh(*args: str, home: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run `python -m kvmesh.cli generate ...`; KVMESH_HOME as exported unless `home` is given."""
    env = dict(os.environ)
    if home is not None:
        env["KVMESH_HOME"] = str(home)
    return subprocess.run(
        [sys.executable, "-m", "kvmesh.cli", "generate", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


def assert_user_error(proc: subprocess.CompletedProcess[str], *fragments: str) -> None:
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: ")
    for fragment in fragments:
        assert fragment in lines[0]
    assert proc.stdout == ""


def test_module_runs_main() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvmesh.cli", "generate", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0
    assert "--max-tokens" in proc.stdout


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--max-tokens", "0"], "max_tokens"),
        (["--temperature", "5"], "temperature"),
        (["--top-p", "0"], "top_p"),
        (["--model", "no-such-model"], "no-such-model"),
    ],
    ids=["max-tokens-0", "temperature-5", "top-p-0", "unknown-model"],
)
def test_bad_arguments_are_one_line_errors(tmp_path: Path, args: list[str], fragment: str) -> None:
    assert_user_error(kvmesh(*CHAT_ARGS, *args, home=tmp_path), fragment)


def test_corrupt_gguf_is_a_one_line_error(tmp_path: Path) -> None:
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + os.urandom(2048))
    assert_user_error(kvmesh(*CHAT_ARGS, "--model", str(bad), home=tmp_path), str(bad))


@pytest.mark.slow
def test_prompt_longer_than_context_is_a_one_line_error(default_model_source) -> None:
    proc = kvmesh("--prompt", "hello world " * 40, "--max-model-len", "32", "--max-tokens", "4")
    assert_user_error(proc, "context length is 32")


@pytest.mark.slow
def test_generate_json(default_model_source) -> None:
    proc = kvmesh(*CHAT_ARGS, "--max-tokens", "8", "--temperature", "0")
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1
    out = json.loads(lines[0])

    expected = {"text", "token_ids", "prompt_tokens", "completion_tokens", "finish_reason"}
    assert expected | {"ttft_s", "decode_tokens_per_s"} <= out.keys()
    assert isinstance(out["text"], str) and out["text"].strip()
    assert all(isinstance(t, int) and 0 <= t < 49152 for t in out["token_ids"])
    assert 1 <= len(out["token_ids"]) == out["completion_tokens"] <= 8
    assert out["prompt_tokens"] > 10  # the chat template adds a system prompt
    assert out["finish_reason"] in ("stop", "length")
    if out["completion_tokens"] < 8:
        assert out["finish_reason"] == "stop"
    assert out["ttft_s"] > 0
    assert out["decode_tokens_per_s"] >= 0
    if out["completion_tokens"] > 1:
        assert out["decode_tokens_per_s"] > 0

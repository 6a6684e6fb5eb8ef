"""Decode speed of two commits side by side, in one run: `kvmesh bench offline`'s measurement
(C chat requests at once, `max_tokens` greedy tokens each, EOS ignored, generated tokens per
second of wall time) for each commit's source tree, alternating old/new per round so machine
noise hits both alike; prints the median tok/s and new/old ratio per (dtype, concurrency).

    python scripts/bench_commits.py OLD_REV [NEW_REV=HEAD] --rounds 3 --concurrency 1,8,32

Each commit is checked out into a temporary git worktree and run with it first on PYTHONPATH
(the same venv and model; the editable install's import hook is dropped), in a fresh process
per measurement.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
_MEASURE = """
import json, sys
# the venv's editable install of kvmesh would win over PYTHONPATH: drop its finder
sys.meta_path[:] = [f for f in sys.meta_path if "__editable__" not in getattr(f, "__module__", "")]
from kvmesh import LLM
try:
    from kvmesh_apps.benchmarks.offline import bench_kvmesh, chat_prompts
except ImportError:  # a commit before the apps left the library
    from kvmesh.benchmarks.offline import bench_kvmesh, chat_prompts
import kvmesh
dtype, levels, max_tokens = sys.argv[1], [int(c) for c in sys.argv[2].split(",")], int(sys.argv[3])
llm = LLM(dtype=dtype, max_num_seqs=max(levels))
bench_kvmesh(llm, chat_prompts(2), 8)  # warm-up
out = {c: bench_kvmesh(llm, chat_prompts(c), max_tokens) for c in levels}
print(json.dumps({"source": kvmesh.__file__, "tok_s": out}))
"""


def measure(tree: Path, dtype: str, levels: str, max_tokens: int) -> dict[str, float]:
    env = {"PYTHONPATH": str(tree), "KVMESH_LOG_LEVEL": "ERROR"}
    proc = subprocess.run(
        [sys.executable, "-c", _MEASURE, dtype, levels, str(max_tokens)],
        capture_output=True,
        text=True,
        check=True,
        env={**_base_env(), **env},
        cwd=tree,
    )
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    if not result["source"].startswith(str(tree)):
        raise RuntimeError(f"measured {result['source']}, not the tree {tree}")
    return result["tok_s"]


def _base_env() -> dict[str, str]:
    import os

    return dict(os.environ)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("old")
    parser.add_argument("new", nargs="?", default="HEAD")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="fp32,bf16")
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        trees = {}
        for label, rev in (("old", args.old), ("new", args.new)):
            trees[label] = Path(tmp) / label
            subprocess.run(
                ["git", "-C", str(REPO), "worktree", "add", "--detach", str(trees[label]), rev],
                check=True,
                capture_output=True,
            )
        try:
            runs = _run(trees, args)
        finally:
            for tree in trees.values():
                subprocess.run(
                    ["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)],
                    check=False,
                    capture_output=True,
                )
    print(
        f"{args.old} -> {args.new}: medians of {args.rounds} alternating rounds, "
        f"{args.max_tokens} tokens per request; per-round ratios new / old (each round's "
        "pair ran back to back)\n"
    )
    print(
        "| dtype | concurrency | old tok/s | new tok/s | new / old (medians) | "
        "median of per-round ratios | per-round ratios |"
    )
    print("|---|---:|---:|---:|---:|---:|---|")
    for (dtype, c), by in sorted(runs.items()):
        old, new = statistics.median(by["old"]), statistics.median(by["new"])
        ratios = [n / o for n, o in zip(by["new"], by["old"], strict=True)]
        listed = ", ".join(f"{r:.2f}" for r in ratios)
        print(
            f"| {dtype} | {c} | {old:.1f} | {new:.1f} | {new / old:.3f} | "
            f"{statistics.median(ratios):.3f} | {listed} |"
        )
    return 0


def _run(trees: dict[str, Path], args) -> dict:
    runs: dict = {}
    for round_ in range(args.rounds):
        for dtype in args.dtype.split(","):
            order = ("old", "new") if round_ % 2 == 0 else ("new", "old")
            for label in order:
                for c, tok_s in measure(
                    trees[label], dtype, args.concurrency, args.max_tokens
                ).items():
                    runs.setdefault((dtype, int(c)), {"old": [], "new": []})[label].append(tok_s)
                print(f"round {round_} {dtype} {label} done", file=sys.stderr, flush=True)
    return runs


if __name__ == "__main__":
    raise SystemExit(main())

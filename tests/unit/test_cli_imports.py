"""`kvmesh --help` and every command's `--help` parse flags without importing torch,
transformers or grpc (each command imports what it runs); lazily defined sub-commands still
get their flags when the command line names them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvmesh.cli_args import build_parser

REPO = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "transformers", "grpc", "numpy")
PROBE = """
import json, runpy, sys
heavy = json.loads(sys.argv[2])
sys.argv = ["kvmesh", *json.loads(sys.argv[1])]
try:
    runpy.run_module("kvmesh.cli", run_name="__main__")
except SystemExit as exc:
    code = exc.code
print(json.dumps({"code": code, "heavy": [m for m in heavy if m in sys.modules]}))
"""


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["generate"],
        ["up"],
        ["serve"],
        ["serve", "gateway"],
        ["serve", "prefill"],
        ["status"],
        ["bench"],
        ["bench", "coldstart"],
        ["train-eagle"],
    ],
    ids=lambda argv: " ".join(argv) or "kvmesh",
)
def test_help_imports_no_heavy_module(argv: list[str]) -> None:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps([*argv, "--help"]), json.dumps(HEAVY)],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    result = json.loads(out.strip().splitlines()[-1])
    assert result == {"code": 0, "heavy": []}


def test_a_lazy_sub_command_gets_its_flags_when_named() -> None:
    argv = ["serve", "kvstore", "--etcd", "127.0.0.1:1", "--page-bytes", "4096"]
    args = build_parser(argv).parse_args(argv)
    assert (args.service, args.page_bytes) == ("kvstore", 4096)
    argv = ["bench", "serve", "--workload", "agent"]
    assert build_parser(argv).parse_args(argv).workload == "agent"


def test_without_a_command_line_the_parser_has_every_flag() -> None:
    parser = build_parser()
    assert parser.parse_args(["bench", "coldstart", "--meshes", "2+2"]).meshes == "2+2"
    assert parser.parse_args(["serve", "draft", "--etcd", "x"]).service == "draft"


def test_the_gateway_process_does_not_import_torch() -> None:
    """The gateway tokenizes and routes: torch (seconds of start-up CPU) stays out of it."""
    probe = "import sys, services.gateway.main; print('torch' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "False"


def test_up_serves_in_the_fastest_exact_enough_precision_unless_told(tmp_path):
    """`kvmesh up` alone: bf16, or INT4 for a 4-bit GGUF (the default model) on a CPU without
    a bf16 dot product; any precision flag is taken as it is."""
    from kvmesh.cli_args import build_parser
    from kvmesh.mesh.precision import serving_precision
    from kvmesh.mesh.up_config import settle_precision

    avx2, bf16_dot = {"avx2", "fma"}, {"avx2", "avx512f", "avx512_bf16"}
    held = serving_precision("smollm2-135m", avx2)
    assert (held.dtype, held.weights) == ("bf16", "int4") and "Q4_1 values" in held.why
    assert serving_precision("smollm2-135m", bf16_dot).weights == "auto"
    parser = build_parser()
    args = parser.parse_args(["up"])
    assert "(the default; --dtype fp32 for fp32)" in settle_precision(args)
    assert args.dtype == "bf16" and args.weights in ("int4", "auto")
    (tmp_path / "config.json").write_text("{}")
    args = parser.parse_args(["up", "--model", str(tmp_path)])
    assert "bf16 weights" in settle_precision(args) and args.dtype == "bf16"
    for flags in (["--dtype", "fp32"], ["--weights", "bf16"], ["--decode-weights", "int4"]):
        args = parser.parse_args(["up", *flags])
        assert settle_precision(args) == "" and args.dtype in ("fp32", "auto")

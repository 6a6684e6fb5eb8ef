"""The layers, as a contract: every import in kvmesh/, kvmesh_apps/ and services/ (function-level
ones too; `if TYPE_CHECKING:` blocks aside) is checked against what its layer may not import.
The engine imports no mesh, service or app; the agent layer no engine; the mesh and the routing
core no service or app; the library no service and no app (the CLI aside); services never each
other; the config tree nothing of them (every layer reads it)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CLI = ("kvmesh.cli", "kvmesh.cli_args", "kvmesh.config_show")
APPS = (*CLI, "kvmesh_apps")
SERVICES = (
    "services.gateway",
    "services.prefill",
    "services.decode",
    "services.kvstore",
    "services.draft",
)
# (a module prefix, what modules under it may not import, exempt modules under it)
RULES = [
    (
        "kvmesh.config",
        ("kvmesh.engine", "kvmesh.mesh", "kvmesh.agent", "kvmesh.routing", "services", *APPS),
        (),
    ),
    ("kvmesh.engine", ("kvmesh.mesh", "kvmesh.agent", "services", *APPS), ()),
    ("kvmesh.agent", ("kvmesh.engine", "kvmesh.mesh", "services", *APPS), ()),
    ("kvmesh.mesh", ("services", *APPS), ()),
    ("kvmesh.routing", ("services", *APPS), ()),
    ("kvmesh", ("services", "kvmesh_apps"), CLI),  # the CLI starts the services and the apps
    ("kvmesh_apps", SERVICES, ()),  # apps run the services as processes
    *[(s, tuple(o for o in SERVICES if o != s), ()) for s in SERVICES],
]


def _within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def imports(source: str) -> list[str]:
    """Absolute modules a source imports, outside `if TYPE_CHECKING:` blocks."""
    tree, found = ast.parse(source), []
    skipped = {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for n in ast.walk(node)
    }
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found += [f"{node.module}.{alias.name}" for alias in node.names]
    return found


def violations(root: Path) -> list[str]:
    out = []
    for top in ("kvmesh", "kvmesh_apps", "services"):
        for path in sorted((root / top).rglob("*.py")):
            if "proto" in path.parts:
                continue
            module = ".".join(path.relative_to(root).with_suffix("").parts)
            module = module.removesuffix(".__init__")
            for prefix, banned, exempt in RULES:
                if not _within(module, prefix) or any(_within(module, e) for e in exempt):
                    continue
                for name in imports(path.read_text()):
                    hit = next((b for b in banned if _within(name, b)), None)
                    if hit and not _within(module, hit):
                        out.append(f"{module} imports {name} ({prefix} may not import {hit})")
    return out


def test_the_layers_hold() -> None:
    assert violations(ROOT) == []


def test_an_upward_import_is_caught(tmp_path: Path) -> None:
    for path, text in {
        "kvmesh/engine/runner/runner.py": "def f():\n    from kvmesh.mesh.draft_client import X\n",
        "kvmesh/engine/typed.py": "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from kvmesh.mesh import Y\n",
        "services/decode/worker.py": "import services.gateway.main\n",
        "kvmesh/mesh/ok.py": "from kvmesh.engine import engine\n",
    }.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
    assert violations(tmp_path) == [
        "kvmesh.engine.runner.runner imports kvmesh.mesh.draft_client.X (kvmesh.engine may not "
        "import kvmesh.mesh)",
        "services.decode.worker imports services.gateway.main (services.decode may not "
        "import services.gateway)",
    ]

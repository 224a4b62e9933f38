"""The folder tree is the architecture: imports only point down the layers.

Each package of ``colosync`` has a rank; a module may import its own package and packages of
a lower rank, never a sibling of the same rank or anything above. The core never imports an
optional dependency at module scope, and no library module imports an optional one at
module scope either (they load where they are used). A violation names the module, the line
and the rule.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "colosync"

LAYERS: list[tuple[str, ...]] = [
    ("errors", "_compat"),
    ("workloads", "decoding"),
    ("wire",),
    ("transports",),
    ("sync",),
    ("handoff",),
    ("engines", "sources"),
    ("integrations",),
    ("tools",),
    ("demo",),
]
RANK = {name: rank for rank, names in enumerate(LAYERS) for name in names}
CORE = {"errors", "wire", "transports", "sync"}
CORE_THIRD_PARTY = {"torch", "msgspec", "numpy"}
OPTIONAL = {
    "vllm",
    "ray",
    "megatron",
    "peft",
    "transformers",
    "trl",
    "triton",
    "torch_memory_saver",
    "matplotlib",
    "accelerate",
    "cupy",
    "datasets",
}


def modules() -> list[Path]:
    return sorted(p for p in ROOT.rglob("*.py") if "__pycache__" not in p.parts)


def package_of(path: Path) -> str:
    rel = path.relative_to(ROOT)
    return rel.parts[0].removesuffix(".py") if len(rel.parts) > 1 or rel.name != "__init__.py" else ""


def imports(path: Path) -> list[tuple[int, str, bool]]:
    """(line, imported module, at module scope) for every import in ``path``."""
    tree = ast.parse(path.read_text(), str(path))
    scoped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            scoped.update(id(n) for n in ast.walk(node) if n is not node)
    type_only: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            type_only.update(id(n) for n in ast.walk(node))
    out = []
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        top = id(node) not in scoped
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name, top) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                out.append((node.lineno, "." * node.level + (node.module or ""), top))
            elif node.module == "colosync":
                out += [(node.lineno, f"colosync.{alias.name}", top) for alias in node.names]
            else:
                out.append((node.lineno, node.module or "", top))
    return out


def violations() -> list[str]:
    found = []
    for path in modules():
        rel = path.relative_to(ROOT.parent)
        pkg = package_of(path)
        for line, name, top in imports(path):
            where = f"{rel}:{line} imports {name}"
            if name.startswith("."):
                found.append(f"{where}: use absolute imports (colosync.<layer>...)")
                continue
            root = name.split(".")[0]
            if root in OPTIONAL and top:
                found.append(f"{where} at module scope: optional dependencies load inside the function using them")
            if (
                pkg in CORE
                and top
                and root not in CORE_THIRD_PARTY
                and root != "colosync"
                and root not in sys.stdlib_module_names
            ):
                found.append(
                    f"{where}: the core ({', '.join(sorted(CORE))}) imports only the standard library, "
                    f"{', '.join(sorted(CORE_THIRD_PARTY))} and itself at module scope"
                )
            if root != "colosync" or not pkg:
                continue
            parts = name.split(".")
            if len(parts) == 1:
                found.append(f"{where}: import from the module that defines a name, not the package facade")
                continue
            target = parts[1]
            if target == pkg or target not in RANK or pkg not in RANK:
                continue
            if RANK[target] >= RANK[pkg]:
                found.append(
                    f"{where}: {pkg} (layer {RANK[pkg]}) may import only lower layers; {target} is layer {RANK[target]}"
                )
    return found


def test_every_package_has_a_layer():
    packages = {package_of(p) for p in modules()} - {""}
    assert packages <= set(RANK), f"add {sorted(packages - set(RANK))} to LAYERS"


def test_imports_only_point_down_the_layers():
    found = violations()
    assert not found, "layer rule broken:\n" + "\n".join(found)


@pytest.mark.parametrize(
    "source, message",
    [
        ("from colosync.engines.hf import HFEngine\n", "may import only lower layers"),
        ("import vllm\n", "optional dependencies"),
        ("from . import manifest\n", "absolute imports"),
        ("import rich\n", "the core"),
    ],
)
def test_the_rule_catches_a_violation(tmp_path, monkeypatch, source, message):
    bad = ROOT / "wire" / "_layer_probe.py"
    bad.write_text(source)
    try:
        assert any(message in v and "_layer_probe" in v for v in violations())
    finally:
        bad.unlink()

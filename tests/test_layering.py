"""Layers import downward only (STYLE.md): kernels know nothing of jpaged, the core knows no
model or engine, models never see the scheduler, and pallas_kernels has two importers."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CORE = {"config", "kv_cache", "sampling", "detokenizer", "request", "compat", "parallel",
        "blocks"}
ENGINE = {"engine", "llm", "serve", "main"}
PALLAS_IMPORTERS = {"jpaged/kv_cache.py", "jpaged/models/attention.py"}


def imports_of(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def python_files(folder: str):
    return sorted((ROOT / folder).rglob("*.py"))


def test_kernels_never_import_jpaged():
    for path in python_files("pallas_kernels"):
        assert not any(n.split(".")[0] == "jpaged" for n in imports_of(path)), path


def test_core_imports_no_model_engine_or_kernel():
    for path in python_files("jpaged"):
        rel = path.relative_to(ROOT / "jpaged").parts
        if rel[0].removesuffix(".py") not in CORE:
            continue
        for name in imports_of(path):
            parts = name.split(".")
            assert not (parts[0] == "jpaged" and len(parts) > 1
                        and parts[1] in ENGINE | {"models"}), f"{path.name} imports {name}"


def test_models_do_not_see_the_engine():
    for path in python_files("jpaged/models"):
        for name in imports_of(path):
            parts = name.split(".")
            assert not (parts[0] == "jpaged" and len(parts) > 1 and parts[1] in ENGINE
                        | {"blocks", "request"}), f"{path} imports {name}"


def test_only_kv_cache_and_attention_import_kernels():
    for path in python_files("jpaged"):
        rel = path.relative_to(ROOT).as_posix()
        if any(n.split(".")[0] == "pallas_kernels" for n in imports_of(path)):
            assert rel in PALLAS_IMPORTERS, f"{rel} imports pallas_kernels"

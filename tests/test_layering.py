"""Layers import downward only (STYLE.md): kernels know nothing of jpaged, the core knows no
model or engine, models never see the scheduler, pallas_kernels has two importers, the block
vocabulary stays inside jpaged/blocks, and the engine module is a thin owner of its parts."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CORE = {"config", "hf_config", "rope_config", "experts_config", "kv_cache", "sampling",
        "sampling_params", "logprobs", "detokenizer", "request", "compat", "parallel", "options",
        "blocks", "structured_outputs"}
ENGINE = {"engine", "llm", "serve", "main"}
PALLAS_IMPORTERS = {"jpaged/kv_cache.py", "jpaged/models/attention.py"}
OP_KINDS = {"free", "fork", "retain", "release", "pop", "adopt", "copy", "swap_out", "swap_in",
            "swap_drop"}
MAX_ENGINE_IMPORTS = 7


def imports_of(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def jpaged_modules_imported(path: Path) -> set[str]:
    """The jpaged modules a file imports (`from jpaged.x import Name` counts as jpaged.x)."""
    modules = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            modules.update(a.name for a in node.names if a.name.split(".")[0] == "jpaged")
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "jpaged":
                modules.update(f"jpaged.{a.name}" for a in node.names)
            elif node.module.split(".")[0] == "jpaged":
                modules.add(node.module)
    return modules


def python_files(folder: str):
    return sorted((ROOT / folder).rglob("*.py"))


def package_files_outside_blocks():
    return [path for path in python_files("jpaged")
            if "blocks" not in path.relative_to(ROOT / "jpaged").parts]


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


def test_only_blocks_import_the_mirror():
    for path in package_files_outside_blocks():
        assert not any(n.startswith("jpaged.blocks.mirror") for n in imports_of(path)), path


def test_block_operation_kinds_are_never_strings_outside_blocks():
    """Operations are typed (`jpaged.blocks.ops`): no ("free", slots) tuples, no
    `kind == "fork"` branches anywhere else in the package."""
    for path in package_files_outside_blocks():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in OP_KINDS:
                raise AssertionError(f"{path.relative_to(ROOT)}:{node.lineno} spells the block "
                                     f"operation {node.value!r} as a string")


def test_engine_module_imports_few_jpaged_modules():
    modules = jpaged_modules_imported(ROOT / "jpaged" / "engine" / "llm_engine.py")
    assert len(modules) <= MAX_ENGINE_IMPORTS, sorted(modules)


def test_the_blocks_package_does_not_import_the_engine_or_models():
    for path in python_files("jpaged/blocks"):
        for name in imports_of(path):
            parts = name.split(".")
            assert not (parts[0] == "jpaged" and len(parts) > 1
                        and parts[1] in ENGINE | {"models"}), f"{path} imports {name}"


def test_only_integrations_know_the_libraries_they_adapt():
    """jpaged works without Tunix: only jpaged/integrations imports it, and nothing imports
    jpaged.integrations (a user does)."""
    for path in python_files("jpaged"):
        if "integrations" in path.relative_to(ROOT / "jpaged").parts:
            continue
        for name in imports_of(path):
            assert name.split(".")[0] != "tunix", f"{path} imports {name}"
            assert not name.startswith("jpaged.integrations"), f"{path} imports {name}"

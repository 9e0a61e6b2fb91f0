"""The wheel carries what an installed jpaged needs: built from the checkout and installed into an
empty folder, it imports from there (not from the checkout or an editable install) and finds the
model presets it ships as package data."""

import os
import shutil
import sys
from pathlib import Path

import pytest
from tests import child_process

ROOT = Path(__file__).resolve().parent.parent
# What pyproject.toml builds the wheel from (readme = "README.md" is read too).
PACKAGE_SOURCES = ("pyproject.toml", "README.md", "jpaged", "pallas_kernels")
CHECK = ("import jpaged; from jpaged.config import ModelConfig; print(jpaged.__file__); "
         "print(ModelConfig.preset('llama3-8b').num_hidden_layers)")


def run(args, cwd, env=None):
    result = child_process.run(args, cwd=cwd, env=env, capture_output=True, text=True,
                               timeout=600)
    assert result.returncode == 0, f"{' '.join(map(str, args))}\n{result.stdout}{result.stderr}"
    return result.stdout


def test_installed_wheel_imports_from_itself_and_finds_presets(tmp_path):
    pytest.importorskip("setuptools")   # --no-build-isolation builds with the installed one
    # Build from a copy: setuptools writes build/ (whose stale build/lib would go into the next
    # wheel) and *.egg-info into the source tree.
    source = tmp_path / "source"
    source.mkdir()
    for name in PACKAGE_SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, source / name,
                            ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(ROOT / name, source / name)
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", tmp_path / "dist", "."], cwd=source)
    (wheel,) = (tmp_path / "dist").glob("jpaged-*.whl")
    site = tmp_path / "site"
    run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", site, wheel],
        cwd=tmp_path)
    # PYTHONPATH comes before site-packages (jax, numpy), and before the finder an editable
    # install appends to sys.meta_path: the wheel's copy wins. cwd is outside the checkout.
    (elsewhere := tmp_path / "elsewhere").mkdir()
    out = run([sys.executable, "-c", CHECK], cwd=elsewhere,
              env={**os.environ, "PYTHONPATH": str(site)}).splitlines()
    assert Path(out[-2]) == site / "jpaged" / "__init__.py"
    assert out[-1] == "32"

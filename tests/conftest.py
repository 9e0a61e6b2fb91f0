"""Session fixtures shared across the suite: tiny Hugging Face checkpoints built once per run."""

import atexit
import gc
import importlib.util
import os
import pkgutil
import shutil
import tempfile
from pathlib import Path

import jax
import pytest
from hypothesis import HealthCheck, settings

MAX_MAPPINGS_KEPT = 15_000

# Engines keep compiled programs in the user's cache directory by default: the suite's go to a
# directory of their pytest process (inherited by the servers and workers it starts), never
# ~/.cache. The run's first process (xdist's controller, or pytest alone) makes the directory
# that holds them and removes it when it exits, so no run leaves one behind, even where a
# worker was ended by a test's timeout.
_CACHE_ROOT = "JPAGED_TEST_CACHE_ROOT"
if _CACHE_ROOT not in os.environ:
    os.environ[_CACHE_ROOT] = tempfile.mkdtemp(prefix="jpaged-test-cache-")
    atexit.register(shutil.rmtree, os.environ[_CACHE_ROOT], ignore_errors=True)
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(dir=os.environ[_CACHE_ROOT])

# On a CPU, programs compile with most of XLA's optimisations off (LLVM at -O0), here and in
# every process the suite starts: the tests check tokens, logprobs and bits, never speed, and
# the suite's time is mostly compiling (off, it compiles about a third faster and the Pallas
# kernels' interpreted tests run faster too). A GPU suite (make test-gpu) compiles as users do.
# "A CPU" is told without starting a backend (xdist's controller, which runs no test, would
# hold a GPU context for the whole run): JAX with no accelerator plugin, or JAX_PLATFORMS=cpu.
def _jax_has_only_the_cpu() -> bool:
    if os.environ.get("JAX_PLATFORMS", "").strip().lower() == "cpu":
        return True
    try:
        import jax_plugins     # the namespace JAX's GPU plugins install into
    except ImportError:
        plugins = []
    else:
        plugins = list(pkgutil.iter_modules(jax_plugins.__path__))
    return not plugins and importlib.util.find_spec("libtpu") is None


if _jax_has_only_the_cpu():
    os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "1"
    jax.config.update("jax_disable_most_optimizations", True)

# No example may fail by the time it takes: a slow or busy machine is no bug. (Hypothesis's
# default gives each example 200 ms and calls slow data generation an error.)
settings.register_profile("jpaged", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("jpaged")


@pytest.fixture(autouse=True, scope="module")
def release_compiled_programs():
    """Clear JAX's caches between test modules once the process holds many memory mappings.
    XLA:CPU maps memory for every compiled executable (about six mappings each), and the whole
    suite in one process compiles enough programs to pass the kernel's limit
    (vm.max_map_count, 65530), where XLA crashes with a segmentation fault. Below the
    threshold, modules keep sharing compiled programs (it saves minutes)."""
    yield
    maps = Path(f"/proc/{os.getpid()}/maps")
    if not maps.exists() or maps.read_text().count("\n") > MAX_MAPPINGS_KEPT:
        from jpaged.engine import programs

        jax.clear_caches()
        programs.clear_shared()
        gc.collect()


@pytest.fixture(autouse=True)
def quiet_compile_pool_around_patches(request):
    """A test that patches (a module's function, jax itself) runs with the compile pool idle,
    before the patch and until it is undone: an engine of an earlier test may leave programs
    compiling in the background, and a pool thread tracing one under another test's patch
    would both break that test's count of calls and compile the patched code into a program
    later engines share."""
    if "monkeypatch" not in request.fixturenames:
        yield
        return
    from jpaged.engine import programs

    request.getfixturevalue("monkeypatch")   # set up first, so it is undone after the wait
    programs.wait_idle()
    yield
    programs.wait_idle()


@pytest.fixture(scope="session")
def hf_checkpoints(tmp_path_factory) -> dict[str, str]:
    """{name: directory} of tiny random float32 checkpoints (plus 'llama_bf16'), built once.

    Names: llama_mha, llama_gqa (llama3 RoPE, tokenizer.json, eos [1, 2]), mistral (sliding
    window 64), qwen2 (q/k/v bias, tied embeddings), llama_head_dim (head_dim 32, all biases),
    llama_sharded (several safetensors + index), llama_bf16. See tests/hf_fixtures.py.
    """
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from tests import hf_fixtures

    return hf_fixtures.build_all(tmp_path_factory.mktemp("hf_checkpoints"))

"""Start-up: the persistent compilation cache (where it lives, off, unwritable, corrupt, warm
starts), how many programs a start compiles, and background compilation (a dispatch waits for a
program compiling on the pool and never compiles it twice)."""

import os
import sys
import threading
import warnings
from concurrent.futures import Future
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from jpaged import LLMEngine, SamplingParams
from jpaged.blocks.ops import OPERATIONS
from jpaged.engine import compile_cache, programs, warmup
from jpaged.engine.executable_store import Store
from tests import child_process
from tests.engine_run import greedy_tokens

SMALL = dict(num_kv_blocks=64, max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32,
             warmup=False, preemption_mode="recompute")
GREEDY = SamplingParams(temperature=0.0, max_tokens=4)

_COMPILES = []   # JAX's compile events while a test records them


def _record(name, seconds, **kwargs):
    if name.startswith("/jax/core/compile/backend_compile"):
        _COMPILES.append(name)


jax.monitoring.register_event_duration_secs_listener(_record)


def generate(engine, prompt=(5, 6, 7, 8, 9)) -> list[int]:
    return greedy_tokens(engine, prompt, GREEDY.max_tokens)


def forget_compiled():
    """As a new process would start: no executable in memory, only the persistent cache."""
    programs.clear_shared()
    jax.clear_caches()


def test_first_programs_then_the_rest_in_the_background_with_no_compile_after():
    """compile_programs returns with a first request's programs compiled; the request then
    compiles nothing (the ahead-of-time executables are the ones run). First in the file: the
    tests after it reuse these executables."""
    engine = LLMEngine.from_pretrained(None, compilation_cache_dir=False, **SMALL)
    engine.compile_programs(first_only=True, progress=False)
    count = engine.stats()["num_compilations"]
    assert count == 5 + len(OPERATIONS) - 3   # swap ops run no program of their own
    _COMPILES.clear()
    generate(engine)
    assert _COMPILES == [] and engine.stats()["num_compilations"] == count
    assert not engine.executor.last_step_compiled


def test_default_directory_follows_xdg_cache_home(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert compile_cache.default_directory() == tmp_path / "xdg" / "jpaged"
    engine = LLMEngine.from_pretrained(None, **SMALL)
    assert Path(engine.config.compilation_cache_dir) == tmp_path / "xdg" / "jpaged"
    used = engine.executor.compilation_cache_dir
    assert used.parent == tmp_path / "xdg" / "jpaged"
    device = jax.devices()[0]
    assert jax.__version__ in used.name and device.platform in used.name
    # jpaged keeps its own store there and leaves JAX's process-wide cache alone: an
    # executable JAX's cache supplied cannot be stored again safely (see executable_store).
    assert jax.config.jax_compilation_cache_dir is None
    assert used.is_dir()
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert compile_cache.default_directory() == tmp_path / "home" / ".cache" / "jpaged"


def test_false_turns_the_cache_off():
    engine = LLMEngine.from_pretrained(None, compilation_cache_dir=False, **SMALL)
    assert engine.executor.compilation_cache_dir is None
    assert jax.config.jax_compilation_cache_dir is None


def test_unwritable_directory_warns_once_and_the_engine_works(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    reference = generate(LLMEngine.from_pretrained(None, compilation_cache_dir=False, **SMALL))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = LLMEngine.from_pretrained(None, compilation_cache_dir=str(blocker), **SMALL)
        tokens = generate(engine)
    about_cache = [w for w in caught if "compilation cache" in str(w.message)]
    assert len(about_cache) == 1, [str(w.message) for w in caught]
    assert engine.executor.compilation_cache_dir is None and tokens == reference


def test_warm_start_loads_from_the_cache_and_survives_corrupt_entries(tmp_path):
    directory = tmp_path / "cache"
    forget_compiled()
    cold = LLMEngine.from_pretrained(None, compilation_cache_dir=str(directory), **SMALL)
    reference = generate(cold)
    compiled = cold.executor.programs.num_compiled
    assert compiled > 0 and cold.executor.programs.num_cache_hits == 0
    entries = [path for path in directory.rglob("*") if path.is_file()]
    assert len(entries) >= compiled
    forget_compiled()
    warm = LLMEngine.from_pretrained(None, compilation_cache_dir=str(directory), **SMALL)
    assert generate(warm) == reference
    assert warm.executor.programs.num_cache_hits == warm.executor.programs.num_compiled > 0
    for path in entries:
        path.write_bytes(b"\x00garbage" * 3)
    forget_compiled()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # the store warns once per unreadable entry
        broken = LLMEngine.from_pretrained(None, compilation_cache_dir=str(directory), **SMALL)
        assert generate(broken) == reference
    assert broken.executor.programs.num_cache_hits == 0


def test_default_configuration_compiles_a_bounded_number_of_programs():
    """109 programs at warm-up before (buckets x samplers x logprobs, block operations in 7
    sizes each); one program per block operation and no "random" logprobs loops now."""
    engine = LLMEngine.from_pretrained(None, num_kv_blocks=64, max_num_seqs=256,
                                       max_num_batched_tokens=2048, warmup=False,
                                       compilation_cache_dir=False, preemption_mode="recompute")
    calls = warmup.program_calls(engine.executor, max_steps=1, max_model_len=128)
    keys = {key for _, (key, *_) in calls}
    assert len(keys) == len(calls)
    # Seven block operations run a program (the swap ones compile their transfers themselves).
    assert len(calls) + 7 <= 66
    first = [key for is_first, (key, *_) in calls if is_first]
    assert len(first) == 5 and all(key[-1] == 0 or key[-2] == 0 for key in first)


class SlowProgram:
    """A jitted function whose lowering waits for `release`: a compile still running."""

    def __init__(self):
        self.release = threading.Event()
        self.jitted = jax.jit(lambda x: x * 2)
        self.num_lowered = 0

    def lower(self, *args, **kwargs):
        self.num_lowered += 1
        assert self.release.wait(30)
        return self.jitted.lower(*args, **kwargs)


def test_a_dispatch_waits_for_its_program_compiling_in_the_background():
    table, program = programs.Programs(), SlowProgram()
    x = jnp.arange(4.0)
    future = table.submit(("double",), program, (x,), {})
    results = []
    waiter = threading.Thread(target=lambda: results.append(
        table.executable(("double",), program, (x,), {})))
    waiter.start()
    waiter.join(0.5)
    assert waiter.is_alive() and not future.done() and len(table.pending()) == 1
    program.release.set()
    waiter.join(30)
    executable, is_new = results[0]
    assert not is_new and program.num_lowered == 1 and table.num_compiled == 1
    assert executable(x).tolist() == [0.0, 2.0, 4.0, 6.0]
    table.strict = True
    with pytest.raises(RuntimeError, match="strict"):
        table.executable(("other",), program, (x,), {})


def test_server_flags_set_or_turn_off_the_cache(tmp_path):
    pytest.importorskip("fastapi")
    from jpaged.serve.cli import parse_args

    assert parse_args([]).compilation_cache_dir is None
    assert parse_args(["--no-compilation-cache"]).compilation_cache_dir is False
    assert parse_args(["--compilation-cache-dir", str(tmp_path)]).compilation_cache_dir == \
        str(tmp_path)


def test_a_warm_start_takes_its_programs_from_the_store_without_lowering(tmp_path,
                                                                          monkeypatch):
    """A second engine on the same directory (as a new process: nothing in memory) loads every
    program from the store, lowers none, and generates the same tokens; a different model
    (another config) finds nothing of the first's; a corrupt entry is dropped with a warning
    and compiled again."""
    directory = tmp_path / "cache"
    forget_compiled()
    cold = LLMEngine.from_pretrained(None, compilation_cache_dir=str(directory), **SMALL)
    reference = generate(cold)
    store = cold.executor.programs.store
    stored = sorted(path for path in store.directory.iterdir() if not path.name.startswith("."))
    assert len(stored) == cold.executor.programs.num_compiled > 0
    lowered = []
    original = jax.stages.Traced.lower
    monkeypatch.setattr(jax.stages.Traced, "lower",
                        lambda self, *a, **k: lowered.append(1) or original(self, *a, **k))
    forget_compiled()
    warm = LLMEngine.from_pretrained(None, compilation_cache_dir=str(directory), **SMALL)
    assert generate(warm) == reference
    programs = warm.executor.programs
    assert programs.num_cache_hits == programs.num_compiled == len(stored) and not lowered

    loaded = []
    load = Store.load
    monkeypatch.setattr(Store, "load", lambda self, key, specs: loaded.append(
        load(self, key, specs)) or loaded[-1])
    forget_compiled()
    other = LLMEngine.from_pretrained(None, compilation_cache_dir=str(directory),
                                      dtype="bfloat16", **SMALL)
    generate(other)
    assert loaded and all(entry is None for entry in loaded) and lowered

    stored[0].write_bytes(b"\x00torn entry")
    forget_compiled()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        again = LLMEngine.from_pretrained(None, compilation_cache_dir=str(directory), **SMALL)
        assert generate(again) == reference
    assert any("unreadable stored program" in str(w.message) for w in caught)


def test_a_dispatch_takes_its_program_from_the_queue_instead_of_waiting_behind_it():
    """A program still queued behind a busy pool (warm-up's later shapes, when a request comes
    in early) is compiled by the dispatch that needs it, at once, and only once: the pool
    skips it when its turn comes."""
    programs.wait_idle()
    release, started = threading.Event(), threading.Semaphore(0)

    def hold():
        started.release()
        release.wait(600)

    programs._POOL.submit(lambda: None)   # the pool's threads exist from the first submit
    num_threads = len(programs._POOL._threads)
    for _ in range(num_threads):
        programs._POOL.submit(hold)
    traced, results = [], []
    program = jax.jit(lambda x: (traced.append(x.shape), x * 2)[1])
    x = jnp.arange(4.0)
    table = programs.Programs()
    try:
        for _ in range(num_threads):   # every pool thread is held
            assert started.acquire(timeout=300)
        future = table.submit(("double",), program, (x,), {})
        waiter = threading.Thread(target=lambda: results.append(
            table.executable(("double",), program, (x,), {})))
        waiter.start()
        waiter.join(300)   # without the take-over it waits for the held pool (600 s)
        assert not waiter.is_alive() and future.done()
    finally:
        release.set()
    programs.wait_idle()
    executable, is_new = results[0]
    assert not is_new and traced == [(4,)] and table.num_compiled == 1
    assert executable(x).tolist() == [0.0, 2.0, 4.0, 6.0]


def test_the_pool_lowers_a_bounded_number_at_once_and_a_dispatch_never_waits(monkeypatch):
    """Pool threads trace and lower at most LOWERING_THREADS programs at a time (here 1, so
    even a 2-core machine's two pool threads would overlap without the bound); a program
    compiled on demand by the dispatching thread lowers even while the pool holds every turn."""
    monkeypatch.setattr(programs, "_LOWERING", threading.BoundedSemaphore(1))
    lowering, most = [], []
    lock = threading.Lock()

    def slow(x, *, tag):
        with lock:
            lowering.append(tag)
            most.append(len(lowering))
        threading.Event().wait(0.05)   # tracing takes a while (runs while the jit traces)
        with lock:
            lowering.remove(tag)
        return x + tag

    program = jax.jit(slow, static_argnames="tag")
    pool = programs.Programs()
    futures = [pool.submit(("slow", tag), program, (jnp.zeros(3),), {"tag": tag})
               for tag in range(6)]
    for future in futures:
        future.result()
    assert max(most) == 1 and len(most) == 6

    with programs._LOWERING:   # every pool turn taken: the dispatching thread must not wait
        executable, is_new = pool.executable(("slow", 7), program, (jnp.zeros(3),), {"tag": 7})
    assert is_new and float(executable(jnp.zeros(3))[0]) == 7.0


_EXIT_WHILE_COMPILING = """
import threading
import jax, jax.numpy as jnp, numpy as np
from jpaged.engine.programs import Programs

tracing, proceed = threading.Event(), threading.Event()

@jax.jit
def slow(x):
    tracing.set()   # the first program is on a compile thread: hold it there until told
    assert proceed.wait(120)
    for i in range(300):
        x = jnp.sin(x) * (i + 1.0) + jnp.cos(x[::-1])
    return x

pool = Programs()
futures = [pool.submit(("slow", n), slow, (np.zeros(64 + n, np.float32),), {}) for n in range(8)]
assert tracing.wait(120)
assert not futures[0].done()
proceed.set()   # the script is done while that program (at least) still compiles
print("done", flush=True)
"""


def test_a_process_that_ends_while_programs_compile_exits_cleanly():
    """A script that is done while warm-up still compiles behind it exits with status 0: the
    queued compiles are dropped and the running ones finish (a thread killed inside XLA's
    compiler aborts the process)."""
    done = child_process.run([sys.executable, "-c", _EXIT_WHILE_COMPILING], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout == "done\n" and "terminate called" not in done.stderr


@pytest.mark.skipif(not hasattr(os, "getpriority"), reason="no per-thread priority here")
def test_compile_threads_run_at_a_lower_priority_than_the_process():
    """Compiles behind ready yield the processor to the thread serving requests."""
    base = os.getpriority(os.PRIO_PROCESS, 0)     # this (the calling) thread's
    done = Future()
    programs._POOL.submit(lambda: done.set_result(
        os.getpriority(os.PRIO_PROCESS, threading.get_native_id())))
    assert done.result(timeout=60) == min(19, base + programs.POOL_NICENESS)


def test_wait_idle_returns_once_everything_submitted_has_run():
    """programs.wait_idle (what tests that patch wait on) waits for work queued or running on
    the pool, and returns at once when there is none."""
    programs.wait_idle()
    release, ran = threading.Event(), []
    for index in range(3):
        programs._POOL.submit(lambda index=index: (release.wait(), ran.append(index)))
    waiter = threading.Thread(target=programs.wait_idle)
    waiter.start()
    waiter.join(timeout=0.2)
    assert waiter.is_alive() and ran == []   # it cannot return while the work is held
    release.set()
    waiter.join(timeout=120)
    assert not waiter.is_alive() and sorted(ran) == [0, 1, 2]
    programs.wait_idle()


def test_store_keys_differ_by_compiler_options_and_static_arguments(tmp_path):
    """Two jits of one function that differ only in compiler options (the step's Triton-GEMM
    and cuBLAS variants) or in a static argument never share a stored executable."""
    from jpaged.engine import device_step

    store = Store(tmp_path, context="model")
    step = device_step.step_impl
    triton, cublas = (device_step._STEP_PROGRAMS[flag] for flag in (True, False))
    specs = (jax.ShapeDtypeStruct((4,), jnp.int32),)
    assert triton.__qualname__ == cublas.__qualname__ == step.__qualname__
    assert store.key(triton, specs, {"is_decode": True}) != store.key(cublas, specs,
                                                                      {"is_decode": True})
    assert store.key(triton, specs, {"is_decode": True}) != store.key(triton, specs,
                                                                      {"is_decode": False})
    assert store.key(triton, specs, {"is_decode": True}) == Store(
        tmp_path, context="model").key(triton, specs, {"is_decode": True})

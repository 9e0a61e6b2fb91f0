"""The program store never changes an answer: entries under the wrong key, an executable that
fails when it runs (the one JAX's own cache hands back on XLA:CPU among them), another host
processor, and processes sharing one cache directory all give the tokens of a cold start."""

import json
import pickle
import subprocess
import sys
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import serialize_executable
from jax.experimental.compilation_cache import compilation_cache

from jpaged import LLMEngine, SamplingParams
from jpaged.blocks import ops
from jpaged.engine import executable_store, programs
from jpaged.engine.executable_store import Store
from tests import child_process
from tests.engine_run import greedy_tokens

SMALL = dict(num_kv_blocks=64, max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32,
             warmup=False, preemption_mode="recompute")
GREEDY = SamplingParams(temperature=0.0, max_tokens=6)
# Two full blocks and then some: prefix caching indexes (retains) blocks, so the block
# operations' programs run as well as the step's and the decode loop's.
PROMPT = list(range(5, 45))
ROOT = Path(__file__).resolve().parent.parent


def generate(engine, prompt=PROMPT) -> list[int]:
    return greedy_tokens(engine, prompt, GREEDY.max_tokens)


def new_process_engine(directory, **options) -> LLMEngine:
    """An engine as a new process would build it: nothing compiled in memory."""
    programs.clear_shared()
    jax.clear_caches()
    return LLMEngine.from_pretrained(None, compilation_cache_dir=str(directory),
                                     **{**SMALL, **options})


def entries(store: Store) -> list[Path]:
    return sorted(p for p in store.directory.iterdir() if not p.name.startswith("."))


def read_entry(path: Path) -> dict:
    return pickle.loads(path.read_bytes())


@pytest.fixture(scope="module")
def reference() -> list[int]:
    programs.clear_shared()
    return generate(LLMEngine.from_pretrained(None, compilation_cache_dir=False, **SMALL))


@pytest.mark.gpu_suite
def test_entries_under_each_others_keys_are_dropped_and_compiled(tmp_path, reference):
    """Every entry's bytes moved under another entry's key (a stale, colliding or cross-written
    store): the warm engine loads none of them, warns, and gives the cold tokens (it gave empty
    outputs before entries recorded their keys)."""
    cold = new_process_engine(tmp_path)
    assert generate(cold) == reference
    stored = entries(cold.executor.programs.store)
    assert len(stored) >= 3
    payloads = [path.read_bytes() for path in stored]
    for path, payload in zip(stored, payloads[1:] + payloads[:1]):
        path.write_bytes(payload)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warm = new_process_engine(tmp_path)
        assert generate(warm) == reference
    assert warm.executor.programs.num_cache_hits == 0
    assert sum("stale stored program" in str(w.message) for w in caught) == 1
    assert all(read_entry(path)["key"] == path.name for path in entries(warm.executor.programs.store))


def test_an_entry_whose_signature_is_not_the_callers_is_dropped(tmp_path, reference):
    """An entry that names its key rightly but takes other arguments than the caller passes
    (what a key collision would look like) is not run."""
    cold = new_process_engine(tmp_path)
    generate(cold)
    store = cold.executor.programs.store
    stored = entries(store)
    first, second = read_entry(stored[0]), read_entry(stored[1])
    assert first["signature"] != second["signature"]
    second["key"] = stored[0].name
    stored[0].write_bytes(pickle.dumps(second))
    specs = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype, _, _ in first["signature"][1]]
    in_tree = first["in_tree"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = store.load(stored[0].name, jax.tree_util.tree_unflatten(in_tree, specs)[0])
    assert loaded is None and not stored[0].exists()
    assert any("signature" in str(w.message) for w in caught)


def _reserialized_through_jax_cache(compiled, tmp_path):
    """The same program compiled again with JAX's persistent cache on, so that the second
    compile loads it from there, then serialized: what earlier stores kept."""
    specs = jax.tree_util.tree_map(lambda info: jax.ShapeDtypeStruct(info.shape, info.dtype),
                                   compiled.args_info[0])
    before = jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "jax-cache"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    compilation_cache.reset_cache()
    try:
        ops._RETAIN.lower(*specs).compile()
        jax.clear_caches()
        return serialize_executable.serialize(ops._RETAIN.lower(*specs).compile())
    finally:
        jax.config.update("jax_compilation_cache_dir", before)
        compilation_cache.reset_cache()


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's serialization defect")
def test_a_program_from_jax_cache_serialized_again_is_recovered_at_its_first_run(tmp_path,
                                                                                 reference):
    """The defect behind a store that failed every request ("Function ... not found" at
    dispatch): an executable JAX's persistent cache supplied, serialized again, loads but
    cannot run. Planted as the block operation's entry (the defect's own program), it is
    dropped at its first run, compiled, and run again on its inputs: the tokens are the cold
    start's and the entry is replaced by a good one."""
    cold = new_process_engine(tmp_path)
    generate(cold)
    store = cold.executor.programs.store
    retain = [path for path in entries(store)
              if read_entry(path)["program"].endswith("retain_blocks")]
    assert len(retain) == 1, [read_entry(path)["program"] for path in entries(store)]
    entry = read_entry(retain[0])
    good = serialize_executable.deserialize_and_load(entry["executable"], entry["in_tree"],
                                                     entry["out_tree"])
    entry["executable"], _, _ = _reserialized_through_jax_cache(good, tmp_path)
    retain[0].write_bytes(pickle.dumps(entry))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warm = new_process_engine(tmp_path)
        assert generate(warm) == reference
    assert any("first run failed" in str(w.message) for w in caught), \
        [str(w.message) for w in caught]
    again = new_process_engine(tmp_path)
    assert generate(again) == reference
    programs_again = again.executor.programs
    assert programs_again.num_cache_hits == programs_again.num_compiled


class _FailingOnce:
    """A stored executable whose run fails as a device failure would: its donated inputs
    deleted, an error raised."""

    def __init__(self, compiled):
        self._compiled = compiled

    def __getattr__(self, name):
        return getattr(self._compiled, name)

    def __call__(self, *args):
        infos = jax.tree_util.tree_leaves(self._compiled.args_info)
        for leaf, info in zip(jax.tree_util.tree_leaves(args), infos):
            if info.donated:
                leaf.delete()
        raise RuntimeError("INTERNAL: injected dispatch failure")


@pytest.mark.gpu_suite
def test_an_injected_failure_of_every_stored_program_is_recovered(tmp_path, monkeypatch,
                                                                  reference):
    """Every program loaded from the store fails its first run (donated inputs deleted): each is
    dropped, compiled and run again; nothing reaches the request."""
    generate(new_process_engine(tmp_path))
    load = Store.load
    failing = []

    def load_failing(self, key, specs):
        compiled = load(self, key, specs)
        if compiled is not None:
            failing.append(key)
            return _FailingOnce(compiled)
        return None

    monkeypatch.setattr(Store, "load", load_failing)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        warm = new_process_engine(tmp_path)
        assert generate(warm) == reference
    assert len(failing) >= 3
    assert warm.executor.programs.num_cache_hits == len(failing)


def test_the_store_keeps_no_executable_that_jax_cache_supplied(tmp_path, reference):
    """jpaged leaves JAX's persistent cache off; a process that turned it on itself keeps it,
    and programs that came from it are not stored, even after another library cleared every
    JAX event listener (Tunix's metrics logger does when it closes)."""
    new_process_engine(tmp_path / "store")
    jax.monitoring.clear_event_listeners()
    assert jax.config.jax_compilation_cache_dir is None
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "jax-cache"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    compilation_cache.reset_cache()
    try:
        generate(new_process_engine(tmp_path / "first"))       # fills JAX's cache
        second = new_process_engine(tmp_path / "second")        # compiles from it
        assert generate(second) == reference
        assert second.executor.programs.num_cache_hits > 0
        assert entries(second.executor.programs.store) == []
    finally:
        jax.config.update("jax_compilation_cache_dir", None)
        compilation_cache.reset_cache()


def test_the_key_covers_the_host_processor(tmp_path, monkeypatch):
    """XLA:CPU code is built for the host processor: another processor never finds it."""
    store = Store(tmp_path, "model")
    specs = (jax.ShapeDtypeStruct((4,), jnp.int32),)
    program = jax.jit(lambda x: x + 1)
    here = store.key(program, specs, {})
    if Path("/proc/cpuinfo").exists():
        assert "flags" in executable_store.host_processor() or \
            "Features" in executable_store.host_processor()
    monkeypatch.setattr(executable_store, "host_processor", lambda: "another processor")
    executable_store._install_fingerprint.cache_clear()
    try:
        assert store.key(program, specs, {}) != here
    finally:
        monkeypatch.undo()
        executable_store._install_fingerprint.cache_clear()
    assert store.key(program, specs, {}) == here


OPTION_SETS = [dict(), dict(max_num_seqs=8), dict(enable_prefix_caching=False,
                                                    num_kv_blocks=96)]
_WORKER = """
import json, sys
from jpaged import LLMEngine, SamplingParams
options = json.loads(sys.argv[2])
engine = LLMEngine.from_pretrained(None, compilation_cache_dir=sys.argv[1], **options)
engine.add_request("r", prompt_token_ids=list(range(5, 45)),
                   params=SamplingParams(temperature=0.0, max_tokens=6))
while engine.has_unfinished():
    for output in engine.step():
        if output.finished:
            print(json.dumps({"tokens": list(output.outputs[0].token_ids),
                              "stored": engine.executor.programs.num_cache_hits}))
"""


def _start(directory, options):
    return child_process.popen([sys.executable, "-c", _WORKER, str(directory),
                             json.dumps({**SMALL, **options})], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _result(process) -> dict:
    out, err = child_process.communicate(process, 600)
    assert process.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def test_processes_starting_at_once_on_one_directory_all_answer_rightly(tmp_path):
    """Three processes with different options start at once on one cache directory, then a
    fourth starts warm: every one gives the tokens of an engine with no cache."""
    programs.clear_shared()
    expected = [generate(LLMEngine.from_pretrained(
        None, compilation_cache_dir=False, **{**SMALL, **options})) for options in OPTION_SETS]
    started = [_start(tmp_path, options) for options in OPTION_SETS]
    results = [_result(process) for process in started]
    assert [result["tokens"] for result in results] == expected
    warm = _result(_start(tmp_path, OPTION_SETS[0]))
    assert warm["tokens"] == expected[0] and warm["stored"] > 0

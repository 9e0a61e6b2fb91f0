"""Multi-step decode: K decode iterations in one device loop that allocates and frees on the
device block manager, against K = 1, other batch mixes, and the host mirror."""

import collections
import functools
import time

import jax
import jax.extend
from jax.experimental.compilation_cache import compilation_cache
import numpy as np
import pytest

from jpaged import LLM, LLMEngine, SamplingParams
from tests.test_engine import prompts_of, run_to_completion


def engine(path, k, **options):
    defaults = dict(num_kv_blocks=96, max_model_len=128, max_num_seqs=8,
                    max_num_batched_tokens=64, num_scheduler_steps=k)
    return LLMEngine.from_pretrained(path, **(defaults | options))


def assert_mirror_matches_device(engine):
    """With no decode loop in flight, the device allocator equals the mirror once the block
    operations the ledger queued (they land before the next program) are applied."""
    assert engine.pipeline.in_flight is None
    engine.apply_block_ops()
    state = jax.device_get(engine.executor.manager)
    mirror = engine.ledger.mirror
    assert int(state.num_free) == mirror.num_free
    assert list(state.free_stack[:mirror.num_free]) == mirror.free_stack
    np.testing.assert_array_equal(state.refcounts, mirror.refcounts)
    np.testing.assert_array_equal(state.seq_lens, mirror.seq_lens)
    for slot in range(state.block_tables.shape[0]):
        assert list(state.block_tables[slot]) == mirror.padded_table(slot)


def requests(seed=0):
    """Greedy and seeded requests of mixed lengths; outputs cross block boundaries in-loop."""
    prompts = prompts_of([5, 30, 17, 12, 3], seed=seed)
    params = [SamplingParams(temperature=0, max_tokens=25, ignore_eos=True),
              SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=12, max_tokens=9, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=33, ignore_eos=True),
              SamplingParams(temperature=0.7, top_k=20, seed=13, max_tokens=21,
                             ignore_eos=True)]
    return prompts, params


def generate(path, k, order=None, **options):
    prompts, params = requests()
    order = list(range(len(prompts))) if order is None else order
    llm = LLM(path, num_kv_blocks=96, max_model_len=128, max_num_seqs=8,
              max_num_batched_tokens=64, num_scheduler_steps=k, **options)
    outputs = llm.generate(prompt_token_ids=[prompts[i] for i in order],
                           sampling_params=[params[i] for i in order], use_tqdm=False)
    by_request = {i: out.outputs[0].token_ids for i, out in zip(order, outputs)}
    assert_mirror_matches_device(llm.engine)
    assert llm.stats()["num_free_blocks"] == 95
    return [by_request[i] for i in range(len(prompts))], llm


def test_outputs_identical_for_k_1_4_16_and_batch_mixes(hf_checkpoints):
    path = hf_checkpoints["llama_gqa"]
    baseline, _ = generate(path, 1)
    for k in (4, 16):
        assert generate(path, k)[0] == baseline, k
    assert generate(path, 4, order=[3, 1, 4, 0, 2])[0] == baseline
    # A different mix: one request alone gives the same tokens as in the batch.
    prompts, params = requests()
    alone = LLM(path, num_kv_blocks=96, max_model_len=128, max_num_seqs=8,
                num_scheduler_steps=16).generate(prompt_token_ids=[prompts[1]],
                                                 sampling_params=params[1], use_tqdm=False)
    assert alone[0].outputs[0].token_ids == baseline[1]


def test_device_state_after_loops_equals_single_steps(hf_checkpoints):
    """Mid-run, after loops that crossed block boundaries and retired sequences on the device,
    the device manager equals the host mirror, which replays them one iteration at a time."""
    eng = engine(hf_checkpoints["llama_gqa"], 8, async_scheduling=False)
    prompts, params = requests(seed=1)
    for index, (prompt, param) in enumerate(zip(prompts, params)):
        eng.add_request(f"r{index}", prompt_token_ids=prompt, params=param)
    steps_with_loops = 0
    while eng.has_unfinished():
        before = sum(len(r.live_sequences) for r in eng.scheduler.running)
        eng.step()
        assert_mirror_matches_device(eng)
        steps_with_loops += before > 0
    assert eng.num_steps < sum(p.max_tokens for p in params) // 4  # loops really ran K steps


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_pool_running_dry_mid_loop_stops_cleanly_and_preempts(hf_checkpoints, async_scheduling):
    path = hf_checkpoints["llama_gqa"]
    prompts = prompts_of([20, 18, 25, 9], seed=2)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    expected = LLM(path, num_kv_blocks=96, max_model_len=128, max_num_seqs=8).generate(
        prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    small = LLM(path, num_kv_blocks=12, max_model_len=128, max_num_seqs=8,
                num_scheduler_steps=16, async_scheduling=async_scheduling)
    got = small.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    assert small.stats()["num_preemptions"] > 0
    assert small.stats()["num_loops_out_of_blocks"] > 0  # a loop ran dry, then the host preempted
    assert_mirror_matches_device(small.engine)



@pytest.mark.parametrize("async_scheduling", [False, True])
def test_loops_evict_cached_blocks_instead_of_running_dry(hf_checkpoints, async_scheduling):
    """A pool mostly held by the prefix cache: loops (and loops chained behind a loop in
    flight) evict cached blocks ahead of time, so none stops early for lack of blocks."""
    path = hf_checkpoints["llama_gqa"]
    llm = LLM(path, num_kv_blocks=96, max_model_len=128, max_num_seqs=8, num_scheduler_steps=8,
              async_scheduling=async_scheduling)
    first = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm.generate(prompt_token_ids=prompts_of([90] * 8, seed=3), sampling_params=first,
                 use_tqdm=False)
    assert llm.stats()["num_cached_blocks"] >= 40 and llm.engine.ledger.mirror.num_free <= 55
    prompts = prompts_of([15] * 8, seed=4)
    params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    got = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    expected = LLM(path, num_kv_blocks=96, max_model_len=128, max_num_seqs=8).generate(
        prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    assert llm.stats()["num_loops_out_of_blocks"] == 0
    assert llm.stats()["num_preemptions"] == 0
    assert_mirror_matches_device(llm.engine)

def test_stops_inside_the_loop(hf_checkpoints):
    path = hf_checkpoints["llama_gqa"]
    prompt = prompts_of([8], seed=7)[0]
    free_run = LLM(path, num_kv_blocks=64, max_model_len=128, max_num_seqs=4).generate(
        prompt_token_ids=[prompt], sampling_params=SamplingParams(
            temperature=0, max_tokens=30, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    stop_token = free_run.token_ids[9]
    llm = LLM(path, num_kv_blocks=64, max_model_len=128, max_num_seqs=4, num_scheduler_steps=16)
    outs = llm.generate(prompt_token_ids=[prompt, prompt], sampling_params=[
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                       stop_token_ids=[stop_token]),
        SamplingParams(temperature=0, max_tokens=13, ignore_eos=True)], use_tqdm=False)
    first = free_run.token_ids.index(stop_token)
    assert outs[0].outputs[0].token_ids == free_run.token_ids[:first + 1]
    assert outs[0].outputs[0].finish_reason == "stop"
    assert outs[1].outputs[0].token_ids == free_run.token_ids[:13]
    assert outs[1].outputs[0].finish_reason == "length"
    text = LLM(path, num_kv_blocks=64, max_model_len=128, max_num_seqs=4).generate(
        ["The quick"], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
        use_tqdm=False)[0].outputs[0].text
    stop = text[3:5]
    out = llm.generate(["The quick"], SamplingParams(temperature=0, max_tokens=20,
                                                     ignore_eos=True, stop=stop),
                       use_tqdm=False)[0].outputs[0]
    assert out.text == text[:text.index(stop)] and out.finish_reason == "stop"
    assert llm.stats()["num_free_blocks"] == 63
    assert_mirror_matches_device(llm.engine)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_parallel_samples_fork_then_loop(hf_checkpoints, async_scheduling):
    path = hf_checkpoints["llama_gqa"]
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=20, ignore_eos=True)
    prompt = prompts_of([21], seed=3)[0]
    one = LLM(path, num_kv_blocks=64, max_model_len=128, max_num_seqs=8).generate(
        prompt_token_ids=[prompt], sampling_params=params, use_tqdm=False)[0]
    multi = LLM(path, num_kv_blocks=64, max_model_len=128, max_num_seqs=8,
                num_scheduler_steps=8, async_scheduling=async_scheduling)
    many = multi.generate(prompt_token_ids=[prompt], sampling_params=params, use_tqdm=False)[0]
    assert [c.token_ids for c in many.outputs] == [c.token_ids for c in one.outputs]
    assert_mirror_matches_device(multi.engine)


def test_waiting_requests_get_single_steps(hf_checkpoints):
    """While a request waits, decode loops run one iteration so it joins at the next step."""
    eng = engine(hf_checkpoints["llama_gqa"], 16, max_num_seqs=1)
    prompts = prompts_of([6, 6], seed=4)
    for index, prompt in enumerate(prompts):
        eng.add_request(f"r{index}", prompt_token_ids=prompt, params=SamplingParams(
            temperature=0, max_tokens=10, ignore_eos=True))
    eng.step()  # r0's prompt; r1 waits (one sequence slot)
    outputs = eng.step()
    assert len(outputs[0].outputs[0].token_ids) == 2  # one iteration only
    run_to_completion(eng)


@pytest.mark.parametrize("bad", [0, -1])
def test_num_scheduler_steps_validated(hf_checkpoints, bad):
    with pytest.raises(ValueError, match="num_scheduler_steps"):
        engine(hf_checkpoints["llama_gqa"], bad)


def test_no_compilation_after_warmup_over_300_mixed_requests(hf_checkpoints, tmp_path):
    """Strict mode: warm-up compiles every bucket; a 300-request mixed run (prefills, chunks,
    decode loops, n > 1 forks, logprobs, stops, frees) then compiles nothing."""
    try:
        check_no_compilation_after_warmup(hf_checkpoints, tmp_path)
    finally:  # the persistent cache is process-wide: later tests must not write to it
        jax.config.update("jax_compilation_cache_dir", None)
        compilation_cache.reset_cache()


_JAX_COMPILE_EVENTS = []   # every trace / lowering / compile JAX reports, while recording


def _record_compile_event(name, seconds, **kwargs):
    if name.startswith("/jax/core/compile/"):
        _JAX_COMPILE_EVENTS.append(name)


jax.monitoring.register_event_duration_secs_listener(_record_compile_event)


def check_no_compilation_after_warmup(hf_checkpoints, tmp_path):
    eng = LLMEngine.from_pretrained(
        hf_checkpoints["llama_gqa"], num_kv_blocks=128, max_model_len=128, max_num_seqs=8,
        max_num_batched_tokens=64, num_scheduler_steps=4, warmup=True, strict_compilation=True,
        async_scheduling=True, compilation_cache_dir=str(tmp_path / "xla_cache"))
    compiled = eng.stats()["num_compilations"]
    eng.wait_for_compilation()   # the programs warm-up queued behind the first ones
    _JAX_COMPILE_EVENTS.clear()
    assert compiled > 0 and eng.stats()["warmup_seconds"] > 0
    rng = np.random.default_rng(8)
    for index in range(300):
        eng.add_request(f"r{index}", prompt_token_ids=rng.integers(2, 320, int(
            rng.integers(1, 70))).tolist(), params=SamplingParams(
            n=int(rng.choice([1, 1, 1, 2])), temperature=float(rng.choice([0.0, 0.8])),
            seed=index, max_tokens=int(rng.integers(1, 12)),
            logprobs=int(rng.choice([0, 0, 2])) or None, ignore_eos=bool(rng.integers(2))))
    outputs = run_to_completion(eng)
    assert len(outputs) == 300
    assert eng.stats()["num_compilations"] == compiled
    # JAX's own count, which also sees a program traced again for the same runner key (an
    # input's commitment or weak type drifting between calls)
    assert _JAX_COMPILE_EVENTS == []
    assert eng.stats()["num_free_blocks"] == 127
    assert any((tmp_path / "xla_cache").iterdir())  # the persistent cache was written


def test_strict_compilation_refuses_a_new_shape(hf_checkpoints):
    eng = LLMEngine.from_pretrained(hf_checkpoints["llama_gqa"], num_kv_blocks=32,
                                    max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32,
                                    warmup=False, preemption_mode="recompute")
    eng.executor.strict_compilation = True
    eng.add_request("r", prompt_token_ids=[5, 6, 7], params=SamplingParams(max_tokens=2))
    with pytest.raises(RuntimeError, match="strict"):
        eng.step()
    with pytest.raises(ValueError, match="warmup"):
        LLMEngine.from_pretrained(hf_checkpoints["llama_gqa"], num_kv_blocks=32,
                                  max_model_len=64, strict_compilation=True, warmup=False)


# ---- async scheduling: the next loop runs while the host processes the last -----------------

def test_async_scheduling_gives_identical_outputs(hf_checkpoints):
    path = hf_checkpoints["llama_gqa"]
    baseline, _ = generate(path, 1)
    for k in (1, 4):
        assert generate(path, k, async_scheduling=True)[0] == baseline, k
    assert generate(path, 4, order=[2, 4, 0, 3, 1], async_scheduling=True)[0] == baseline
    for depth in (1, 3):  # loops in flight behind the host (default 2)
        assert generate(path, 2, async_scheduling=True, async_depth=depth)[0] == baseline, depth


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_step_records_split_each_steps_wall_into_host_and_device(hf_checkpoints,
                                                                  async_scheduling):
    """A step's device seconds lie within the step: with loops chained behind the host, a
    loop's time before the step that fetches it was the earlier step's (its host work ran
    beside it), so the records' device seconds never add up past the wall."""
    llm = engine(hf_checkpoints["llama_gqa"], 4, async_scheduling=async_scheduling)
    prompts, params = requests()
    for index, (prompt, param) in enumerate(zip(prompts, params)):
        llm.add_request(f"r{index}", prompt_token_ids=prompt, params=param)
    llm.step_log = []
    start = time.perf_counter()
    run_to_completion(llm)
    wall = time.perf_counter() - start
    records = llm.step_log
    assert sum(record.num_generated > record.num_seqs for record in records) >= 5   # loops
    assert all(record.host_seconds >= 0 and record.device_seconds >= 0 for record in records)
    assert sum(record.host_seconds + record.device_seconds for record in records) <= wall
    assert sum(record.device_seconds for record in records) <= wall


def test_async_loops_drop_to_a_smaller_batch_as_requests_finish(hf_checkpoints):
    """Chained loops keep their first loop's rows, finished ones included: once the live rows
    fit a smaller batch, the chain drains and the next loop carries the live rows alone. A long
    request outliving eleven short ones gets most of its tokens from loops of one row (before,
    every loop carried all twelve rows to its end); outputs as without async scheduling."""
    prompts = prompts_of([6] * 12, seed=3)
    params = ([SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)]
              + [SamplingParams(temperature=0, max_tokens=4 + n, ignore_eos=True)
                 for n in range(11)])
    outputs = {}
    for async_scheduling in (False, True):
        eng = engine(hf_checkpoints["llama_gqa"], 4, max_num_seqs=16,
                     async_scheduling=async_scheduling)
        for index, (prompt, param) in enumerate(zip(prompts, params)):
            eng.add_request(f"r{index}", prompt_token_ids=prompt, params=param)
        eng.step_log = []
        done = run_to_completion(eng)
        outputs[async_scheduling] = [done[f"r{i}"].outputs[0].token_ids for i in range(12)]
        assert_mirror_matches_device(eng)
    assert outputs[True] == outputs[False]
    records = eng.step_log   # the async run's
    alone = sum(record.num_generated for record in records
                if record.is_decode and record.num_seqs == 1)
    # 64 tokens, 50 of them after the short requests' last (at 14); a drain's lag is at most
    # (depth + 1) loops of 4 tokens
    assert alone >= 50 - 3 * 4, [(r.num_seqs, r.num_generated) for r in records]


@pytest.mark.parametrize("depth", [1, 2])
def test_async_stop_strings_and_aborts_while_a_loop_is_in_flight(hf_checkpoints, depth):
    """A stop string found on the host while the next loops already run: that sequence's extra
    tokens are dropped, its blocks are freed after those loops, and the mirror stays exact."""
    path = hf_checkpoints["llama_gqa"]
    sync = LLM(path, num_kv_blocks=64, max_model_len=128, max_num_seqs=4)
    text = sync.generate(["The quick"], SamplingParams(temperature=0, max_tokens=24,
                                                       ignore_eos=True),
                         use_tqdm=False)[0].outputs[0].text
    stop = text[6:8]
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=stop),
              SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)]
    expected = sync.generate(["The quick", "Hello, world"], params, use_tqdm=False)
    eng = engine(path, 2, num_kv_blocks=64, async_scheduling=True, async_depth=depth)
    eng.add_request("stop", "The quick", params[0])
    eng.add_request("free", "Hello, world", params[1])
    eng.add_request("abort", "Hello, jpaged", params[1])
    outputs, steps, in_flight = {}, 0, set()
    while eng.has_unfinished():
        for output in eng.step():
            if output.finished:
                outputs[output.request_id] = output
        steps += 1
        in_flight.add(len(eng.pipeline.loops))
        if steps == 4:
            assert eng.pipeline.in_flight is not None  # the abort lands mid-pipeline
            assert eng.abort("abort")
        if eng.pipeline.in_flight is None:
            assert_mirror_matches_device(eng)
    assert outputs["stop"].outputs[0].text == expected[0].outputs[0].text
    assert outputs["stop"].outputs[0].token_ids == expected[0].outputs[0].token_ids
    assert outputs["free"].outputs[0].token_ids == expected[1].outputs[0].token_ids
    assert "abort" not in outputs
    assert max(in_flight) == depth  # the pipeline really ran `depth` loops ahead
    assert eng.num_free_blocks == 63
    assert_mirror_matches_device(eng)


def test_no_loop_is_chained_past_every_rows_budget(hf_checkpoints, monkeypatch):
    """Rows that end on max_tokens: exactly the loops their tokens need are dispatched (a loop
    has a fixed trip count, so one more would run the model for nothing)."""
    eng = engine(hf_checkpoints["llama_gqa"], 4, async_scheduling=True, async_depth=2)
    calls = collections.Counter()
    for name in ("launch_decode", "continue_decode"):
        real = getattr(eng.executor, name)
        monkeypatch.setattr(eng.executor, name, lambda *a, _real=real, _name=name, **kw: (
            calls.update([_name]), _real(*a, **kw))[1])
    for index, max_tokens in enumerate([13, 9, 13, 5]):
        eng.add_request(str(index), prompt_token_ids=[5 + index, 6, 7],
                        params=SamplingParams(temperature=0, max_tokens=max_tokens,
                                              ignore_eos=True))
    outputs = run_to_completion(eng)
    assert [len(outputs[str(i)].outputs[0].token_ids) for i in range(4)] == [13, 9, 13, 5]
    # the prefill samples token 1; 12 more at K = 4 are one launch and two continuations
    assert calls == {"launch_decode": 1, "continue_decode": 2}, calls
    assert_mirror_matches_device(eng)
    calls.clear()  # 8 tokens after the prefill: one continuation, though depth 2 allows two
    eng.add_request("short", prompt_token_ids=[9, 6, 7], params=SamplingParams(
        temperature=0, max_tokens=9, ignore_eos=True))
    assert len(run_to_completion(eng)["short"].outputs[0].token_ids) == 9
    assert calls == {"launch_decode": 1, "continue_decode": 1}, calls


def test_pack_round_trips_every_leaf_dtype():
    from jpaged.engine.device_step import pack, pack_traced, unpack
    tree = {"a": np.arange(6, dtype=np.int32).reshape(2, 3), "b": np.float32([1.5, -2.25]),
            "c": np.uint32([7, 2 ** 32 - 1]), "d": np.int32(4)}
    packed, layout = pack(tree)
    assert packed.dtype == np.int32 and packed.shape == (6 + 2 + 2 + 1,)
    out = jax.jit(unpack, static_argnums=1)(packed, layout)
    for key, value in tree.items():
        assert out[key].dtype == value.dtype and out[key].shape == value.shape
        np.testing.assert_array_equal(out[key], value)
    np.testing.assert_array_equal(jax.jit(pack_traced)(out), packed)
    with pytest.raises(TypeError, match="4-byte"):
        pack({"x": np.zeros(2, np.int64)})


@pytest.mark.parametrize("k,async_scheduling", [(1, False), (4, True)])
def test_one_host_to_device_transfer_per_step(hf_checkpoints, monkeypatch, k, async_scheduling):
    """Once every request decodes, a step (a mixed step, a launched loop or a chained loop)
    moves its inputs with at most one device_put of one array; a chained loop that keeps all its
    rows reuses its control vector and sends nothing."""
    llm = LLM(hf_checkpoints["llama_gqa"], num_kv_blocks=96, max_model_len=128, max_num_seqs=8,
              max_num_batched_tokens=64, num_scheduler_steps=k, async_scheduling=async_scheduling)
    engine = llm.engine
    prompts, params = requests()
    for index, (prompt, param) in enumerate(zip(prompts, params)):
        engine.add_request(str(index), prompt_token_ids=prompt, params=param)
    while engine.scheduler.waiting:
        engine.step()
    engine.step()  # the last prompt's first decode: its forks and frees settle
    calls = []
    real_put = jax.device_put
    monkeypatch.setattr(jax, "device_put", lambda x, *a, **kw: calls.append(
        len(jax.tree_util.tree_leaves(x))) or real_put(x, *a, **kw))
    per_step = []
    for _ in range(3):
        calls.clear()
        engine.step()
        per_step.append(list(calls))
    assert all(calls in ([], [1]) for calls in per_step), per_step
    assert ([] in per_step) == async_scheduling, per_step


def _primitives(jaxpr, counts=None):
    """Counter of primitive names in a jaxpr, sub-jaxprs (loop bodies, branches) included."""
    counts = collections.Counter() if counts is None else counts
    for eqn in jaxpr.eqns:
        counts[eqn.primitive.name] += 1
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            _primitives(sub, counts)
    return counts


def test_decode_loop_has_no_data_dependent_control_flow(hf_checkpoints):
    """No while predicate and no cond: on a GPU each would make the dispatching thread wait for
    the device every iteration, and async scheduling could not overlap the host. The sampler's
    sort is in the loop only when a row needs it, its noise only when a row samples (both
    decided on the host)."""
    from jpaged.engine.device_step import decode_loop_impl
    from jpaged.sampling import SamplingRow
    runner = engine(hf_checkpoints["llama_gqa"], 4).executor
    counts = {}
    for mode, params in [("greedy", SamplingParams(temperature=0.0, top_k=5)),
                         ("random", SamplingParams(temperature=1.0, min_p=0.1)),
                         ("sort", SamplingParams(temperature=1.0, top_k=5))]:
        launched = runner.launch_decode([(-1, 0)] * 4, [SamplingRow(params, 0, 0, 0)] * 4,
                                        [0] * 4, [[]] * 4, 4, 4, 128, 0)
        assert launched.static["sampler"] == mode
        loop = functools.partial(decode_loop_impl, layout=launched.layout,
                                 model_def=runner.model_def, backend=runner.attention_backend,
                                 interpret=runner.interpret, **launched.static)
        counts[mode] = _primitives(jax.make_jaxpr(loop)(
            runner.param_leaves, runner.manager, runner.cache, launched.packed, launched.result,
            jax.numpy.ones(5, jax.numpy.int32)).jaxpr)
        assert counts[mode]["scan"] and not counts[mode]["while"] + counts[mode]["cond"], mode
    assert counts["random"]["sort"] < counts["sort"]["sort"]
    draws = {mode: count["random_bits"] + count["threefry2x32"] for mode, count in counts.items()}
    assert draws["greedy"] == 0 < draws["random"]   # an all-greedy batch draws no noise


@pytest.mark.parametrize("seed", range(6))
def test_event_replay_equals_iteration_replay(seed):
    """The ledger replays a decode loop from its block-boundary and retirement events only;
    the mirror must end exactly as after replaying every iteration (the device's order)."""
    import copy

    from jpaged.blocks.ledger import BlockLedger

    rng = np.random.default_rng(seed)
    template = BlockLedger(200, 4, 12, 40)
    mirror = template.mirror
    slots = [int(s) for s in rng.permutation(12)[:9]]   # batch order is not slot order
    for slot in slots:
        assert mirror.append([(slot, int(rng.integers(1, 20)))])[0]
    mirror.free([slots[0]])                             # freed blocks reorder the free stack
    assert mirror.append([(slots[0], 6)])[0]
    for first_planned in (False, True):
        active = [bool(a) for a in rng.random(9) < 0.8]
        num_done = int(rng.integers(1, 12))
        done_at = [int(rng.integers(-1, num_done)) if rng.random() < 0.5 else -1
                   for _ in range(9)]
        if first_planned:  # schedule() appended iteration 0 already
            assert mirror.append([(s, 1) for s, a in zip(slots, active) if a])[0]
        states = []
        for replay in ("replay_decode_loop", "_replay_by_iteration"):
            ledger = copy.deepcopy(template)
            if replay == "replay_decode_loop":
                ledger.replay_decode_loop(slots, active, done_at, num_done, first_planned)
            else:
                ledger._replay_by_iteration(slots, active, done_at, num_done,
                                            int(first_planned))
            m = ledger.mirror
            states.append((m.free_stack, m.refcounts, m.tables, m.seq_lens))
        assert states[0] == states[1]
        template = ledger
        mirror = ledger.mirror


@pytest.mark.parametrize("seed", [0, 1])
def test_async_loops_keep_the_mirror_exact_through_evictions_stops_and_aborts(hf_checkpoints,
                                                                            seed):
    """Async loops in a pool too small for the work, with the prefix cache on: prompts sharing
    prefixes (cached blocks evicted behind loops), rows retired inside loops, stop ids and
    aborts landing while loops are in flight. Whenever no loop is in flight the device
    allocator equals the mirror (every operation queued behind a loop had its mirror half
    applied in the device's order), outputs of the requests not aborted are those of a
    synchronous engine, and nothing leaks."""
    rng = np.random.default_rng(seed)
    path = hf_checkpoints["llama_gqa"]
    shared = prompts_of([32], seed=20 + seed)[0]
    prompts = [shared[:int(rng.integers(16, 33))] + prompt
               for prompt in prompts_of([int(n) for n in rng.integers(2, 12, 14)], seed=seed)]
    params = [SamplingParams(temperature=0, max_tokens=int(rng.integers(4, 40)), ignore_eos=True,
                             stop_token_ids=[int(rng.integers(5, 300))]) for _ in prompts]
    options = dict(num_kv_blocks=24, max_model_len=128, max_num_seqs=6,
                   max_num_batched_tokens=64, num_scheduler_steps=2)
    sync = LLM(path, async_scheduling=False, **options)
    expected = sync.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    eng = engine(path, 2, async_scheduling=True, async_depth=2,
                 **(options | dict(num_scheduler_steps=2)))
    queued = collections.Counter()   # operations queued behind loops, by kind
    queue = eng.ledger._queue_behind_loop
    eng.ledger._queue_behind_loop = lambda op, **kw: (queued.update([type(op).__name__]),
                                                      queue(op, **kw))[1]
    for index, (prompt, param) in enumerate(zip(prompts, params)):
        eng.add_request(f"r{index}", prompt_token_ids=prompt, params=param)
    aborted, outputs, steps, chained = set(), {}, 0, 0
    while eng.has_unfinished():
        for output in eng.step():
            if output.finished:
                outputs[output.request_id] = output
        steps += 1
        chained = max(chained, len(eng.pipeline.loops))
        if steps % 7 == 3 and eng.pipeline.loops:   # an abort while loops are in flight
            running = [r.request_id for r in eng.scheduler.running
                       if r.request_id not in outputs]
            if running and eng.abort(running[-1]):
                aborted.add(running[-1])
        if not eng.pipeline.loops:
            assert_mirror_matches_device(eng)
    assert chained == 2 and aborted
    for index, want in enumerate(expected):
        if f"r{index}" not in aborted:
            assert outputs[f"r{index}"].outputs[0].token_ids == want.outputs[0].token_ids, index
    assert queued["Free"] and queued["Release"], queued   # frees and evictions interleaved
    assert_mirror_matches_device(eng)
    eng.ledger.evict_all()
    eng.apply_block_ops()
    assert eng.num_free_blocks == options["num_kv_blocks"] - 1

"""Memory pressure end to end: swap, recompute and auto preemption with prefix caching on and
off give the outputs of an unpressured run; random arrivals, aborts and completions leak no
block (device, mirror or host swap space)."""

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jpaged import LLM, LLMEngine, SamplingParams, kv_cache
from jpaged.blocks.swap import SwapStore
from tests.test_engine import prompts_of
from tests.test_multistep import assert_mirror_matches_device

PARAMS = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def workload(seed=11):
    """32 requests: half share a 40-token prefix (prefix hits), all cross block boundaries."""
    rng = np.random.default_rng(seed)
    shared = rng.integers(2, 320, size=40).tolist()
    prompts = []
    for index, length in enumerate(rng.integers(8, 40, size=32)):
        own = rng.integers(2, 320, size=int(length)).tolist()
        prompts.append(shared + own if index % 2 else own)
    return prompts


def blocks_needed(prompts, max_tokens, block_size=16):
    return sum(-(-(len(p) + max_tokens) // block_size) for p in prompts)


def assert_nothing_held(engine):
    """Every block is free or held only by the prefix cache; host swap space is all free."""
    assert not engine.has_unfinished()
    cache = engine.scheduler.prefix_cache
    cached = set(cache.entries) if cache else set()
    for block in range(1, engine.ledger.mirror.num_blocks):
        assert engine.ledger.mirror.refcounts[block] == (1 if block in cached else 0), block
    assert engine.num_free_blocks == engine.config.num_kv_blocks - 1
    assert cache is None or cache.num_evictable() == len(cached)
    assert len(engine.ledger.free_host_blocks) == engine.ledger.num_swap_blocks
    assert not engine.ledger.has_ops
    assert engine.executor.swap_store is None or not engine.executor.swap_store.stored
    assert all(not table for table in engine.ledger.mirror.tables)
    assert_mirror_matches_device(engine)


@pytest.fixture(scope="module")
def expected(hf_checkpoints):
    big = LLM(hf_checkpoints["llama_gqa"], num_kv_blocks=256, max_model_len=128,
              max_num_seqs=32, max_num_batched_tokens=256, enable_prefix_caching=False)
    outputs = big.generate(prompt_token_ids=workload(), sampling_params=PARAMS, use_tqdm=False)
    assert big.stats()["num_preemptions"] == 0
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("mode", ["swap", "recompute", "auto"])
def test_overloaded_pool_gives_unpressured_outputs(hf_checkpoints, expected, mode, caching):
    prompts = workload()
    pool = blocks_needed(prompts, PARAMS.max_tokens) // 4 + 1   # a quarter of the need
    llm = LLM(hf_checkpoints["llama_gqa"], num_kv_blocks=pool, max_model_len=128,
              max_num_seqs=32, max_num_batched_tokens=256, preemption_mode=mode,
              enable_prefix_caching=caching, swap_space=0.01)
    if mode == "auto":  # make the start-up rates put the crossover inside this workload
        llm.engine.executor.swap_rates = {"swap_fixed_seconds": 1.0, "swap_seconds_per_block": 0.0,
                                 "prefill_seconds_per_token": 1.0 / 40}
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=PARAMS, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    stats = llm.stats()
    assert stats["num_preemptions"] > 0
    assert sum(o.num_preemptions for o in outputs) == stats["num_preemptions"]
    assert stats["num_recomputed_tokens"] == sum(o.num_recomputed_tokens for o in outputs)
    swapped, recomputed = stats["num_swapped_out_blocks"] > 0, stats["num_recomputed_tokens"] > 0
    assert (swapped, recomputed) in {"swap": [(True, False)], "recompute": [(False, True)],
                                     "auto": [(True, True)]}[mode]
    assert stats["swap_bytes_out"] == stats["swap_bytes_in"] == (
        stats["num_swapped_out_blocks"] * llm.engine.executor.bytes_per_block)
    if caching:
        assert stats["prefix_cache_hit_rate"] > 0
        assert stats["num_cached_blocks"] > 0
        # Preemption and prefix hits compose: some request resumed on cached blocks.
        assert any(o.num_preemptions and o.num_cached_tokens for o in outputs)
    assert_nothing_held(llm.engine)


def test_full_swap_space_falls_back_to_recompute(hf_checkpoints, expected):
    prompts = workload()
    llm = LLM(hf_checkpoints["llama_gqa"], num_kv_blocks=blocks_needed(prompts, 24) // 4 + 1,
              max_model_len=128, max_num_seqs=32, max_num_batched_tokens=256,
              preemption_mode="swap", swap_space=3 * 8192 / 2**30)
    assert llm.engine.ledger.num_swap_blocks == 3   # 8 KiB blocks: room for 3
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=PARAMS, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert llm.stats()["num_swapped_out_blocks"] > 0
    assert llm.stats()["num_recomputed_tokens"] > 0
    assert_nothing_held(llm.engine)


def test_swapped_mid_prefill_resumes_its_chunks(hf_checkpoints):
    """Long prompts prefilled in 16-token chunks on a pool far too small: requests are swapped
    out between chunks and finish their prefill after coming back."""
    path = hf_checkpoints["llama_gqa"]
    prompts = prompts_of([90, 75, 84], seed=21)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    options = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=16)
    expected = LLM(path, num_kv_blocks=64, **options).generate(
        prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    llm = LLM(path, num_kv_blocks=9, preemption_mode="swap", enable_prefix_caching=False,
              **options)
    got = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    assert llm.stats()["num_swapped_out_blocks"] > 0
    assert_nothing_held(llm.engine)


def test_auto_policy_compares_transfer_and_prefill_costs(hf_checkpoints):
    engine = LLMEngine.from_pretrained(hf_checkpoints["llama_gqa"], num_kv_blocks=32,
                                       max_model_len=128, max_num_seqs=4)
    assert engine.executor.swap_rates is None   # measured at the first decision
    engine.scheduler.swap_policy(8, 128)
    rates = engine.executor.swap_rates
    assert rates["swap_seconds_per_block"] > 0 and rates["prefill_seconds_per_token"] > 0
    engine.executor.swap_rates = {"swap_fixed_seconds": 1e-3, "swap_seconds_per_block": 1e-4,
                         "prefill_seconds_per_token": 1e-4}
    assert engine.scheduler.swap_policy(8, 128)       # 1.8 ms to swap vs 12.8 ms to recompute
    assert not engine.scheduler.swap_policy(1, 5)     # 1.1 ms vs 0.5 ms


@pytest.mark.parametrize("pinned", [True, False])
def test_swap_store_round_trip(pinned):
    """Blocks gathered to host memory (pinned or through numpy) come back bit-exact elsewhere."""
    cache = kv_cache.init_cache(2, 2, 40, 4, 8, np.float32)
    values = np.random.default_rng(0).standard_normal((2, 40, 4, 8)).astype(np.float32)
    cache = kv_cache.KVCache(tuple(jax.numpy.asarray(values + i) for i in range(2)),
                             tuple(jax.numpy.asarray(values - i) for i in range(2)))
    store = SwapStore(40, 1, pinned=pinned)
    store.swap_out(cache, 7, [3, 9, 17])
    if pinned:
        assert store.stored[7][0][1].sharding.memory_kind == "pinned_host"
    cache = store.swap_in(cache, 7, [30, 31, 5])
    for layer in range(2):
        got = np.asarray(cache.k_pages[layer])
        np.testing.assert_array_equal(got[:, [30, 31, 5]], values[:, [3, 9, 17]] + layer)
        np.testing.assert_array_equal(np.asarray(cache.v_pages[layer])[:, 30],
                                      values[:, 3] - layer)
    assert not store.stored and store.bytes_out == store.bytes_in == 3


event = st.one_of(
    st.tuples(st.just("add"), st.lists(st.tuples(st.integers(4, 60), st.integers(1, 30),
                                                 st.integers(1, 2), st.booleans()),
                                       min_size=1, max_size=4)),
    st.tuples(st.just("abort"), st.integers(0, 30)),
    st.tuples(st.just("step"), st.integers(1, 4)),
)


def run_events(engine, events, seed):
    rng = np.random.default_rng(seed)
    shared = rng.integers(2, 320, size=32).tolist()
    added = []
    for kind, arg in events:
        if kind == "add":
            for length, max_tokens, n, share in arg:
                prompt = (shared if share else []) + rng.integers(2, 320, size=length).tolist()
                request_id = f"r{seed}-{len(added)}"
                params = SamplingParams(n=n, temperature=1.0, max_tokens=max_tokens,
                                        seed=len(added))
                try:
                    engine.add_request(request_id, prompt_token_ids=prompt[:90], params=params)
                    added.append(request_id)
                except ValueError as err:   # a request that could never fit: refused up front
                    assert "could never run" in str(err)
        elif kind == "abort" and added:
            engine.abort(added[arg % len(added)])
        else:
            for _ in range(arg):
                engine.step()
    for _ in range(2000):
        if not engine.has_unfinished():
            break
        engine.step()


def test_random_arrivals_aborts_and_completions_leak_nothing(hf_checkpoints):
    engine = LLMEngine.from_pretrained(
        hf_checkpoints["llama_gqa"], num_kv_blocks=12, max_model_len=96, max_num_seqs=6,
        max_num_batched_tokens=64, preemption_mode="auto", swap_space=6 * 8192 / 2**30)
    assert engine.ledger.num_swap_blocks == 6   # full at times: recompute fallback
    engine.executor.swap_rates = {"swap_fixed_seconds": 1.0, "swap_seconds_per_block": 0.0,
                         "prefill_seconds_per_token": 1.0 / 24}   # both modes get used

    @settings(max_examples=12, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow])
    @given(st.lists(event, min_size=1, max_size=20), st.integers(0, 2**16))
    def check(events, seed):
        run_events(engine, events, seed)
        assert_nothing_held(engine)

    check()
    stats = engine.stats()   # the examples together exercised every path
    assert stats["num_swapped_out_blocks"] > 0 and stats["num_recomputed_tokens"] > 0
    assert stats["prefix_cache_hit_rate"] > 0


def test_swap_warm_up_covers_the_shapes_swaps_use():
    """Every gather and scatter a swap dispatches has the key and argument shapes, dtypes and
    shardings of one of `warmup_calls` (so strict compilation never meets a new swap shape)."""
    from jpaged.engine.programs import argument_specs

    cache = kv_cache.init_cache(2, 2, 40, 4, 8, np.float32)
    seen = []

    def dispatch(key, program, *args):
        seen.append((key, program, argument_specs(args)))
        return program(*args)

    store = SwapStore(40, 1, dispatch=dispatch)
    warm = {(key, program): argument_specs(args)
            for key, program, args, _ in store.warmup_calls(cache)}
    for handle, blocks in enumerate([[3], [5, 6, 7], list(range(1, 20))]):
        store.swap_out(cache, handle, blocks)
        cache = store.swap_in(cache, handle, blocks[::-1])
    assert {key[0] for key, _, _ in seen} == {"swap_gather", "swap_scatter"}
    for key, program, specs in seen:
        assert warm[(key, program)] == specs, key

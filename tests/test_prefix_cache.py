"""Automatic prefix caching: the index confirms every hit, evicts LRU tail first and drops
orphaned descendants; end to end, shared prompts reuse blocks with unchanged outputs, and hash
collisions cost hits, never correctness."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from jpaged import LLM, SamplingParams
from jpaged.blocks import prefix_cache
from jpaged.blocks.ledger import BlockLedger
from jpaged.blocks.prefix_cache import PrefixCache
from jpaged.request import Request
from jpaged.engine.scheduler import Scheduler
from tests.test_engine import prompts_of
from tests.test_preemption import assert_nothing_held

ROOT = Path(__file__).resolve().parent.parent


def index_chain(cache, token_ids, blocks, refcounts):
    """Index token_ids' full blocks as `blocks` (as the scheduler does), cache-held only."""
    keys = cache.keys_for(token_ids, [], len(blocks))
    parent = None
    for i, (key, block) in enumerate(zip(keys, blocks)):
        tokens = tuple(token_ids[i * cache.block_size:(i + 1) * cache.block_size])
        assert cache.insert(key, block, parent, tokens)
        refcounts[block] = 2   # a sequence and the cache
        parent = block
    for block in blocks:
        refcounts[block] = 1
    cache.released(blocks, refcounts)


def test_match_confirms_tokens_and_parents():
    cache, refcounts = PrefixCache(4), [0] * 16
    tokens = list(range(10, 22))
    index_chain(cache, tokens, [3, 7, 5], refcounts)
    assert cache.match(tokens, [], 3) == [3, 7, 5]
    assert cache.match(tokens[:8] + [0, 0, 0, 0], [], 3) == [3, 7]
    assert cache.match([1] + tokens[1:], [], 3) == []          # the chain breaks at block 0
    assert cache.match(tokens, [], 2) == [3, 7]                  # capped


def test_a_hash_collision_is_a_miss(monkeypatch):
    monkeypatch.setattr(prefix_cache, "block_hash", lambda parent, tokens: 42)
    cache, refcounts = PrefixCache(4), [0] * 16
    index_chain(cache, [1, 2, 3, 4], [6], refcounts)
    assert cache.match([9, 9, 9, 9, 5], [], 1) == []   # same key, other tokens: refused
    assert not cache.insert(42, 8, None, (9, 9, 9, 9))  # the key is taken: not indexed
    assert cache.match([1, 2, 3, 4, 5], [], 1) == [6]


def test_eviction_is_lru_tail_first_and_drops_descendants():
    cache, refcounts = PrefixCache(2), [0] * 32
    first, second = [1, 2, 3, 4, 5, 6], [7, 8, 9, 10]
    index_chain(cache, first, [10, 11, 12], refcounts)    # released first: evicted first
    index_chain(cache, second, [20, 21], refcounts)
    assert list(cache.evictable) == [12, 11, 10, 21, 20]
    assert cache.evict(1) == [12]                          # the tail of the oldest chain
    assert cache.match(first, [], 3) == [10, 11]
    assert cache.evict(1, protected={11}) == [10, 11]      # 11's parent goes, so 11 goes too
    assert cache.match(first, [], 3) == []
    assert cache.match(second, [], 2) == [20, 21]
    cache.acquire([20])                                     # a hit: held, not evictable
    assert cache.num_evictable() == 1 and cache.evict(1) == [21]


def tiny_dummy_model(tmp_path) -> str:
    """The tiny preset (1024 positions) with random weights: no checkpoint needed."""
    shutil.copy(ROOT / "configs" / "models" / "tiny.json", tmp_path / "config.json")
    assert json.loads((tmp_path / "config.json").read_text())["max_position_embeddings"] >= 1024
    return str(tmp_path)


def scheduled_blocks(prompts, caching: bool) -> int:
    """Blocks the scheduler allocates to prefill `prompts` (each then finishes): the scheduler
    and block mirror alone, which the device follows block for block."""
    ledger = BlockLedger(128 * 65 + 1, 16, 128, 64, enable_prefix_caching=caching)
    scheduler = Scheduler(ledger, max_num_seqs=128, max_num_batched_tokens=4096)
    for index, prompt in enumerate(prompts):
        scheduler.add(Request(f"r{index}", None, prompt, SamplingParams(max_tokens=1), 0, index))
    while scheduler.num_unfinished:
        for row in scheduler.schedule().rows:
            if row.sample_indices:   # the prompt is done: one token, then finished
                row.seq.token_ids.append(3)
                row.seq.finish_reason = "length"
                ledger.release([row.seq])
                scheduler.retire(row.request)
    return ledger.mirror.num_popped


def test_shared_system_prompt_is_stored_once(tmp_path):
    """128 requests: one 1,000-token system prompt, 20-token user turns. With caching the
    system prompt's 62 full blocks are computed once, not 128 times; outputs are unchanged."""
    path = tiny_dummy_model(tmp_path)
    rng = np.random.default_rng(5)
    system = rng.integers(3, 256, size=1000).tolist()
    prompts = [system + rng.integers(3, 256, size=20).tolist() for _ in range(128)]
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    options = dict(load_format="dummy", num_kv_blocks=128 * 65 + 1, max_model_len=1024,
                   max_num_seqs=128, max_num_batched_tokens=4096, preemption_mode="recompute")
    llm = LLM(path, **options)
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert llm.stats()["prefix_cache_hit_rate"] > 0.9
    assert_nothing_held(llm.engine)
    # The reference run without caching prefills every prompt in full, which is slow on a CPU:
    # it runs a sample of 8 requests (greedy outputs do not depend on the batch).
    plain = LLM(path, enable_prefix_caching=False, **options)
    sample = plain.generate(prompt_token_ids=prompts[::16], sampling_params=params,
                            use_tqdm=False)
    assert [o.outputs[0].token_ids for o in sample] == [
        o.outputs[0].token_ids for o in outputs[::16]]
    # Count the blocks: 2 private tail blocks per request either way, the 62 full blocks of
    # the system prompt once with caching and 128 times without.
    private = 128 * (-(-1023 // 16) - 1000 // 16)
    popped_on, popped_off = scheduled_blocks(prompts, True), scheduled_blocks(prompts, False)
    assert llm.engine.ledger.mirror.num_popped == popped_on
    assert popped_on - private == 1000 // 16
    assert popped_off - private == 128 * (1000 // 16)


def test_hash_collisions_never_serve_wrong_kv(hf_checkpoints, monkeypatch):
    """Every key the same: lookups find candidates that fail confirmation; outputs of prompts
    with and without shared prefixes equal those of a run without caching."""
    path = hf_checkpoints["llama_gqa"]
    shared = prompts_of([48], seed=9)[0]
    prompts = [shared + p for p in prompts_of([5, 9, 17], seed=10)] + prompts_of([40, 33],
                                                                                  seed=12)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    plain = LLM(path, num_kv_blocks=64, max_model_len=128, max_num_seqs=2,
                enable_prefix_caching=False)
    expected = plain.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    monkeypatch.setattr(prefix_cache, "block_hash", lambda parent, tokens: 7)
    colliding = LLM(path, num_kv_blocks=64, max_model_len=128, max_num_seqs=2)
    got = colliding.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    assert colliding.stats()["num_cached_blocks"] >= 1   # one block holds the single key
    assert_nothing_held(colliding.engine)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_generated_blocks_are_cached_for_the_next_turn(hf_checkpoints, async_scheduling):
    """A follow-up prompt containing a previous answer hits the answer's blocks too."""
    llm = LLM(hf_checkpoints["llama_gqa"], num_kv_blocks=64, max_model_len=128,
              max_num_seqs=2, num_scheduler_steps=4, async_scheduling=async_scheduling)
    first = prompts_of([20], seed=13)[0]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    answer = llm.generate(prompt_token_ids=[first], sampling_params=params,
                          use_tqdm=False)[0].outputs[0].token_ids
    follow = first + answer + prompts_of([6], seed=14)[0]
    out = llm.generate(prompt_token_ids=[follow], sampling_params=params, use_tqdm=False)[0]
    # 20 + 40 = 60 tokens: 3 full blocks hold the prompt and most of the answer, whether the
    # answer ended inside a loop chained behind others (async) or not: a loop never frees a
    # retired row's blocks itself, so the host indexes them before their free lands.
    assert out.num_cached_tokens == 48
    assert_nothing_held(llm.engine)


def test_beam_search_evicts_cached_blocks_it_needs(hf_checkpoints):
    """Cached blocks no request holds fill most of a small pool; beam search evicts them
    instead of refusing, and searches exactly as on a fresh engine."""
    from jpaged import BeamSearchParams

    path = hf_checkpoints["llama_gqa"]
    options = dict(num_kv_blocks=16, max_model_len=128, max_num_seqs=4)
    llm = LLM(path, **options)
    llm.generate(prompt_token_ids=prompts_of([60, 60, 60], seed=15),
                 sampling_params=SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                 use_tqdm=False)
    assert llm.engine.ledger.mirror.num_free == 15 - 9 and llm.stats()["num_cached_blocks"] == 9
    prompt = prompts_of([30], seed=16)[0]
    params = BeamSearchParams(beam_width=3, max_tokens=12)   # up to 7 blocks: 1 more than free
    got = llm.beam_search([prompt], params)[0]
    fresh = LLM(path, **options).beam_search([prompt], params)[0]
    assert [s.token_ids for s in got.sequences] == [s.token_ids for s in fresh.sequences]
    assert_nothing_held(llm.engine)

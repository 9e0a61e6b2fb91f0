"""Models whose every layer slides one window give back the blocks behind it as sequences grow:
outputs stay token-identical to a run that keeps every block, the device allocator stays equal
to the mirror, and the pool holds about window / block_size blocks per sequence, not its whole
length."""

import pytest

from jpaged import LLMEngine, SamplingParams
from tests.test_multistep import assert_mirror_matches_device

BLOCK_SIZE = 4      # the checkpoint's window is 8 tokens: two blocks


def prompts_of(lengths):
    return [[(5 * i + 3 * j) % 300 + 5 for j in range(n)] for i, n in enumerate(lengths)]


def run(path, *, trim=True, **options):
    """Greedy and seeded requests to the end; (tokens by request, most blocks held, stats)."""
    settings = dict(num_kv_blocks=128, max_model_len=128, max_num_seqs=6, block_size=BLOCK_SIZE,
                    max_num_batched_tokens=32, dtype="float32") | options
    engine = LLMEngine.from_pretrained(path, **settings)
    if not trim:
        engine.scheduler.sliding_window = None
    for index, prompt in enumerate(prompts_of([5, 23, 14, 9, 30])):
        params = (SamplingParams(temperature=0, max_tokens=40, ignore_eos=True) if index % 2 == 0
                  else SamplingParams(temperature=0.9, seed=index, max_tokens=40,
                                      ignore_eos=True, n=2 if index == 1 else 1))
        engine.add_request(f"r{index}", prompt_token_ids=prompt, params=params)
    tokens, most_held = {}, 0
    while engine.has_unfinished():
        for output in engine.step():
            if output.finished:
                tokens[output.request_id] = [c.token_ids for c in output.outputs]
        most_held = max(most_held, settings["num_kv_blocks"] - 1 - engine.num_free_blocks)
        if not engine.pipeline.loops:
            engine.apply_block_ops()   # the queued operations, early: then both agree
            assert_mirror_matches_device(engine)
    engine.ledger.evict_all()
    engine.apply_block_ops()
    assert engine.num_free_blocks == settings["num_kv_blocks"] - 1    # nothing leaked
    return tokens, most_held, engine.stats()


@pytest.fixture(scope="module")
def kept(hf_checkpoints):
    return run(hf_checkpoints["mistral_window"], trim=False)


@pytest.mark.parametrize("options", [
    {},
    dict(async_scheduling=False),
    dict(enable_prefix_caching=True, num_scheduler_steps=4),
    dict(num_kv_blocks=40, preemption_mode="recompute"),
    dict(num_kv_blocks=40, preemption_mode="swap", enable_prefix_caching=True),
], ids=["plain", "sync", "prefix-cache+loops", "recompute", "swap+prefix-cache"])
def test_blocks_behind_the_window_go_back_and_outputs_do_not_change(hf_checkpoints, kept,
                                                                    options):
    tokens, most_held, stats = run(hf_checkpoints["mistral_window"], **options)
    kept_tokens, kept_most_held, kept_stats = kept
    assert tokens == kept_tokens
    assert kept_stats["num_window_freed_blocks"] == 0
    assert stats["num_window_freed_blocks"] > 60
    if "num_kv_blocks" not in options:    # six sequences of up to 70 tokens: 18 blocks each
        assert kept_most_held > 60 and most_held < kept_most_held / 2


def test_a_model_with_full_attention_layers_keeps_every_block(hf_checkpoints):
    """Qwen2's first layer attends to everything: nothing may be let go."""
    engine = LLMEngine.from_pretrained(hf_checkpoints["qwen2_window"], dtype="float32",
                                       num_kv_blocks=64, block_size=BLOCK_SIZE)
    assert engine.scheduler.sliding_window is None
    assert engine.model_config.num_sliding_layers > 0


def test_a_request_longer_than_the_pool_runs_when_its_window_fits(hf_checkpoints):
    """A sliding-window model (window 8, blocks of 4) with a pool of 11 usable blocks: a request
    of 30 + 60 tokens (23 blocks at full length) is admitted, since trimming keeps it within
    (8 + 8) / 4 + 2 = 6 blocks, and finishes token-identical to a pool that holds it whole;
    the same request on a model with a full-attention layer is still refused up front."""
    prompt = prompts_of([30])[0]
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    settings = dict(max_model_len=128, max_num_seqs=2, block_size=BLOCK_SIZE,
                    max_num_batched_tokens=8, dtype="float32")

    def tokens(path, num_kv_blocks):
        engine = LLMEngine.from_pretrained(path, num_kv_blocks=num_kv_blocks, **settings)
        engine.add_request("long", prompt_token_ids=prompt, params=params)
        while engine.has_unfinished():
            for output in engine.step():
                if output.finished:
                    assert engine.stats()["num_preemptions"] == 0
                    return output.outputs[0].token_ids
        raise AssertionError("the request did not finish")

    path = hf_checkpoints["mistral_window"]
    assert len(tokens(path, 12)) == 60
    assert tokens(path, 12) == tokens(path, 64)
    with pytest.raises(ValueError, match="could never run"):
        tokens(hf_checkpoints["qwen2_window"], 12)

"""benchmarks/rollout.py on the tiny preset: the samples have the asked shape, the prefill
shares are the ones forking and the prefix cache must give, transformers scores jpaged's
completions to the same logprobs, and the table says when transformers' run was capped."""

import argparse

import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import hf_backends, rollout
from jpaged.config import PRESETS_DIR, ModelConfig
from jpaged.models import random_model

# Prompts of 20 tokens are a full block of 16 and a partial one; 2 samples each
# (4 sequences: one decode batch bucket, few programs to compile).
SHAPE = rollout.Shape(prompts=2, prompt_len=20, n=2, max_tokens=4)
ARGS = argparse.Namespace(max_num_seqs=4, max_num_batched_tokens=128, num_scheduler_steps=1,
                          hf_batch_size=1, hf_batches=None, seed=0)


@pytest.fixture(scope="module")
def run():
    model = random_model(ModelConfig.preset("tiny"), dtype=jnp.float32)
    llm = rollout.build_llm(model, SHAPE, ARGS)
    prompts = rollout.random_prompts(SHAPE, 256, seed=0)
    ours, completions = rollout.jpaged_rollout(llm, prompts, SHAPE, seed=0)
    hf_model = hf_backends.build_hf_model(PRESETS_DIR / "tiny.json", model, device="cpu",
                                          dtype_name="float32")
    theirs = rollout.hf_rollout(hf_model, prompts, completions, SHAPE, ARGS, "cpu")
    return ours, completions, theirs


def test_samples_and_scores_have_the_rollout_shape(run):
    _, (completions, logprobs), _ = run
    assert len(completions) == len(logprobs) == SHAPE.num_samples
    assert all(len(c) == SHAPE.max_tokens for c in completions)
    assert all(lp.shape == (SHAPE.max_tokens,) and (lp <= 0).all() for lp in logprobs)
    # n samples of one prompt are drawn independently: with V = 256 they differ
    assert len({tuple(c) for c in completions[:SHAPE.n]}) == SHAPE.n


def test_prefill_shares_are_what_forking_and_the_prefix_cache_give(run):
    ours, _, _ = run
    # the n samples fork one prefilled prompt: (n - 1) / n of the prompt tokens are not run
    assert ours["prefill_saved"] == pytest.approx((SHAPE.n - 1) / SHAPE.n)
    # each scored pair (24 tokens) takes the prompt's full block (16 tokens) from the cache
    assert ours["score_cache_share"] == pytest.approx(16 / 24)
    assert ours["generate_tokens_per_s"] > 0 and ours["score_tokens_per_s"] > 0


def test_transformers_scores_jpaged_completions_alike(run):
    _, _, theirs = run
    assert theirs["prompts_run"] == SHAPE.prompts       # two batches of 1, none dropped
    assert theirs["logprob_difference"] < 1e-4
    assert np.isfinite(theirs["generate_tokens_per_s"])


def test_table_marks_a_capped_transformers_run(run):
    ours, _, theirs = run
    capped = dict(theirs, prompts_run=1)
    lines = rollout.results_table(ours, capped, SHAPE).splitlines()
    assert lines[2].startswith("| jpaged |") and "saved while generating 50.0%" in lines[2]
    assert "CAPPED: 1 of 2 prompts" in lines[3]
    assert "CAPPED" not in rollout.results_table(ours, theirs, SHAPE)

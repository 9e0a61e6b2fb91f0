"""logit_bias through the engine: banned tokens never come out and forced ones always do, in
single steps and in the device decode loop, with the unbiased rows of the batch unchanged and
the reported (raw) logprobs the model's own."""

import numpy as np
import pytest

from jpaged import LLM, LLMEngine, SamplingParams
from tests.test_engine import prompts_of

SETTINGS = dict(num_kv_blocks=96, max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64)
GREEDY = dict(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module", params=[1, 4], ids=["k1", "k4"])
def llm(request, hf_checkpoints):
    return LLM(hf_checkpoints["llama_gqa"], num_scheduler_steps=request.param, **SETTINGS)


def _tokens(llm, prompts, params):
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    return [out.outputs[0] for out in outputs]


@pytest.mark.gpu_suite
def test_banned_tokens_never_come_out_and_other_rows_are_unchanged(llm):
    prompts = prompts_of([7, 19, 4])
    plain = _tokens(llm, prompts, SamplingParams(**GREEDY, logprobs=2))
    banned = {token: -100 for token in plain[0].token_ids}
    sampled = SamplingParams(temperature=1.0, seed=3, max_tokens=24, ignore_eos=True,
                             logit_bias=banned)
    mixed = _tokens(llm, prompts, [SamplingParams(**GREEDY, logprobs=2, logit_bias=banned),
                                   SamplingParams(**GREEDY, logprobs=2), sampled])
    assert [out.finish_reason for out in mixed] == ["length"] * 3
    assert len(mixed[0].token_ids) == GREEDY["max_tokens"]
    assert not set(mixed[0].token_ids) & set(banned)
    assert not set(mixed[2].token_ids) & set(banned)
    # The unbiased row ran in a biased batch: the same tokens and logprobs as without.
    assert mixed[1].token_ids == plain[1].token_ids
    assert mixed[1].logprobs == plain[1].logprobs


@pytest.mark.gpu_suite
def test_a_forced_token_reports_the_models_own_logprob(llm):
    prompt = prompts_of([9], seed=4)[0]
    plain = _tokens(llm, [prompt], SamplingParams(**GREEDY))[0].token_ids
    forced_id = next(t for t in range(3, 300) if t not in plain)
    forced = _tokens(llm, [prompt], SamplingParams(**GREEDY, logprobs=1,
                                                   logit_bias={forced_id: 100}))[0]
    assert forced.token_ids == [forced_id] * GREEDY["max_tokens"]
    # Raw logprobs are the model's: what scoring the same tokens gives, unbiased.
    scored = llm.score([prompt], [forced.token_ids])[0]
    reported = [step[forced_id] for step in forced.logprobs]
    np.testing.assert_allclose(reported, scored, rtol=1e-5, atol=1e-5)
    assert all(score < np.log(0.5) for score in scored)   # the model alone would not pick it


def test_bias_ids_are_checked_against_the_vocabulary_and_strict_compilation(hf_checkpoints):
    llm = LLM(hf_checkpoints["llama_gqa"], **SETTINGS)
    vocab = llm.engine.model_config.vocab_size
    with pytest.raises(ValueError, match=f"logit_bias contains ids outside \\[0, {vocab}\\)"):
        llm.generate(prompt_token_ids=[[5, 6]], sampling_params=SamplingParams(
            logit_bias={vocab: 1.0}), use_tqdm=False)
    engine = LLMEngine.from_pretrained(hf_checkpoints["llama_gqa"], warmup=True,
                                       strict_compilation=True, num_scheduler_steps=2,
                                       **SETTINGS)
    with pytest.raises(ValueError, match="logit_bias .*strict_compilation"):
        engine.add_request("r", prompt_token_ids=[5, 6], params=SamplingParams(
            logit_bias={3: 1.0}))
    assert not engine.has_unfinished()

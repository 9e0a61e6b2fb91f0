"""Log-probabilities against transformers: `score` of given completions, prompt_logprobs
(chunked prefill, prefix caching, preemption), logprobs_mode, and the server's prompt_logprobs
and echo. One float32 checkpoint; engines share their shapes, so programs compile once."""

import functools

import numpy as np
import pytest
from transformers import AutoTokenizer
from fastapi.testclient import TestClient

from jpaged import Logprob, SamplingParams
from jpaged.engine.llm_engine import LLMEngine
from jpaged.logprobs import PositionRows, given_token_logprobs
from jpaged.serve import build_app, model_info
from jpaged.serve.async_engine import AsyncEngine
from tests.logprob_compare import assert_equal_but_floats_close

NAME = "llama_gqa"
# block_size 4 and 16-token steps: sequences cross block boundaries and prompts are chunked.
# Recompute: no swap-rate measurement at start; the pool (63 usable blocks of 4 tokens) is small
# enough that four long sequences preempt one another.
OPTIONS = dict(block_size=4, num_kv_blocks=64, max_model_len=128, max_num_seqs=4,
               max_num_batched_tokens=16, preemption_mode="recompute")
TOLERANCE = 1e-4


def tokens_of(lengths, seed):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 320, size=n).tolist() for n in lengths]


@functools.cache
def _transformers(path):
    import torch
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_log_softmax(path, tokens, temperature=1.0) -> np.ndarray:
    """[T, V] float64 log_softmax(logits / temperature) of transformers at every position."""
    import torch

    with torch.no_grad():
        logits = _transformers(path)(torch.tensor([tokens])).logits[0].double()
    return torch.log_softmax(logits / temperature, dim=-1).numpy()


def hf_token_logprobs(path, prompt, completion, temperature=1.0) -> np.ndarray:
    """log p(completion[i] | prompt + completion[:i]) under transformers."""
    table = hf_log_softmax(path, prompt + completion, temperature)
    return table[np.arange(len(prompt) - 1, len(prompt) + len(completion) - 1), completion]


@pytest.fixture(scope="module")
def path(hf_checkpoints):
    return hf_checkpoints[NAME]


@pytest.fixture(scope="module")
def engines(path):
    """{prefix caching on?: engine}, the same shapes (so the same compiled programs)."""
    return {cached: LLMEngine.from_pretrained(path, enable_prefix_caching=cached, **OPTIONS)
            for cached in (True, False)}


def run(engine, prompts, params):
    """Outputs of prompts run to the end, in order; params: one for all, or one per prompt."""
    params = params if isinstance(params, list) else [params] * len(prompts)
    for index, (prompt, param) in enumerate(zip(prompts, params)):
        engine.add_request(f"t{index}", prompt_token_ids=prompt, params=param)
    finished = {}
    while engine.has_unfinished():
        finished.update((out.request_id, out) for out in engine.step() if out.finished)
    return [finished[f"t{index}"] for index in range(len(prompts))]


def check_prompt_logprobs(path, output, k):
    """vLLM's layout: None, then per token {token: Logprob(logprob, rank, decoded_token)}
    holding it and the top k, equal to transformers' (rank: 1 + the tokens more likely)."""
    prompt, entries = output.prompt_token_ids, output.prompt_logprobs
    assert len(entries) == len(prompt) and entries[0] is None
    table = hf_log_softmax(path, prompt)
    tokenizer = AutoTokenizer.from_pretrained(path)
    for position, (token, entry) in enumerate(zip(prompt[1:], entries[1:]), 1):
        row = table[position - 1]
        top = np.argsort(-row)[:k].tolist()
        assert list(entry)[:k] == top and set(entry) == set(top) | {token}
        for token_id, logprob in entry.items():
            assert isinstance(logprob, Logprob)
            assert abs(logprob.logprob - row[token_id]) < TOLERANCE, (position, token_id)
            # ties within the tolerance may order either way
            assert 1 + np.sum(row > row[token_id] + TOLERANCE) <= logprob.rank \
                <= 1 + np.sum(row > row[token_id] - TOLERANCE), (position, token_id)
            assert logprob.decoded_token == tokenizer.decode([token_id], skip_special_tokens=True)


@pytest.mark.parametrize("cached", [True, False])
def test_score_matches_transformers(path, engines, cached):
    """Several completions of one prompt (GRPO's shape) and a second prompt, crossing block
    boundaries in 16-token chunks; with prefix caching the shared prompt blocks are hit."""
    engine = engines[cached]
    prompt, other = tokens_of([13, 6], seed=1)
    completions = tokens_of([9, 21, 1, 4], seed=2)
    prompts = [prompt, prompt, prompt, other]
    before = engine.stats()["prefix_cache_hit_rate"]
    scores = engine.score(prompts, completions)
    for prompt_ids, completion, score in zip(prompts, completions, scores):
        assert score.dtype == np.float32 and score.shape == (len(completion),)
        np.testing.assert_allclose(score, hf_token_logprobs(path, prompt_ids, completion),
                                   atol=TOLERANCE)
    hit_rate = engine.stats()["prefix_cache_hit_rate"]
    assert (hit_rate > before) if cached else hit_rate == 0.0
    cooler = engine.score(prompts[:2], completions[:2], temperature=0.7)
    for prompt_ids, completion, score in zip(prompts, completions, cooler):
        np.testing.assert_allclose(
            score, hf_token_logprobs(path, prompt_ids, completion, 0.7), atol=TOLERANCE)
    assert engine.num_free_blocks == engine.config.num_kv_blocks - 1


def test_score_equals_the_logprobs_generate_returned(path, engines):
    engine = engines[True]
    prompts = tokens_of([7, 18], seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=9, logprobs=0, ignore_eos=True)
    outputs = run(engine, prompts, params)
    completions = [out.outputs[0].token_ids for out in outputs]
    scores = engine.score(prompts, completions)
    for out, completion, score in zip(outputs, completions, scores):
        sampled = [entry[token] for token, entry in zip(completion, out.outputs[0].logprobs)]
        np.testing.assert_allclose(score, sampled, atol=1e-5)


@pytest.mark.parametrize("cached", [True, False])
def test_prompt_logprobs_match_transformers_over_chunks(path, engines, cached):
    """A 37-token prompt prefilled in 16-token chunks, twice: the second run of the same prompt
    must compute its prompt again rather than take the cached blocks (vLLM recomputes)."""
    engine = engines[cached]
    prompts = tokens_of([37, 5], seed=4)
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=3)
    for _ in range(2):
        outputs = run(engine, prompts, params)
        for output in outputs:
            check_prompt_logprobs(path, output, 3)
            assert output.num_cached_tokens == 0
    plain = run(engine, prompts[:1], SamplingParams(temperature=0.0, max_tokens=2))[0]
    assert plain.prompt_logprobs is None and plain.num_cached_tokens == (36 if cached else 0)


def test_a_step_scores_at_most_its_share_of_positions(path, engines, monkeypatch):
    """With the per-step cap at 5, prompts of 37 and 23 tokens (prompt logprobs) and a score
    request are cut into more steps, no step scores more than 5 positions, and every number is
    still transformers'."""
    from jpaged.engine import batch_arrays, scheduler

    monkeypatch.setattr(scheduler, "SCORED_POSITIONS_PER_STEP", 5)
    counts = []
    scored_positions = batch_arrays.scored_positions

    def counted(rows):
        scored = scored_positions(rows)
        counts.append(len(scored[0]))
        return scored

    monkeypatch.setattr(batch_arrays, "scored_positions", counted)
    engine = engines[False]
    prompts = tokens_of([37, 23], seed=6)
    for output in run(engine, prompts, SamplingParams(temperature=0.0, max_tokens=2,
                                                      prompt_logprobs=2)):
        check_prompt_logprobs(path, output, 2)
    assert counts and max(counts) == 5 and sum(counts) == 36 + 22
    prompt, completion = prompts[1][:9], prompts[0][:20]
    scores = engine.score([prompt], [completion])[0]
    np.testing.assert_allclose(scores, hf_token_logprobs(path, prompt, completion),
                               atol=TOLERANCE)
    assert max(counts) == 5


def test_prompt_logprobs_under_preemption_are_made_once(path, engines):
    """The pool cannot hold four growing sequences: requests are preempted and prefilled again;
    each prompt's logprobs still come once, equal to transformers'."""
    engine = engines[False]
    prompts = tokens_of([11, 9, 14, 6], seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True, prompt_logprobs=2)
    before = engine.stats()["num_preemptions"]
    outputs = run(engine, prompts, params)
    assert engine.stats()["num_preemptions"] > before
    for output in outputs:
        check_prompt_logprobs(path, output, 2)
    scores = engine.score(prompts, [out.outputs[0].token_ids for out in outputs])
    for out, score in zip(outputs, scores):
        np.testing.assert_allclose(score, hf_token_logprobs(path, out.prompt_token_ids,
                                                            out.outputs[0].token_ids),
                                   atol=TOLERANCE)


def test_processed_logprobs_are_those_of_the_distribution_sampled(path, engines):
    """top_k=1 leaves one token: its processed logprob is 0 while the raw one
    is transformers' log_softmax; at temperature 0.7 the processed logprob is
    log_softmax(logits / 0.7). One prefill step each (the sampled-token path is the decode
    loop's too: both call `sample`)."""
    processed = LLMEngine.from_pretrained(path, logprobs_mode="processed_logprobs", **OPTIONS)
    prompts = tokens_of([10, 5], seed=6)   # one 16-token step: no decode loop to compile
    params = [SamplingParams(top_k=1, max_tokens=1, logprobs=0, seed=0),
              SamplingParams(temperature=0.7, max_tokens=1, logprobs=0, seed=1)]
    raw_outs = run(engines[True], prompts, params)
    outs = run(processed, prompts, params)
    (token, entry), (cool_token, cool_entry) = [
        (out.outputs[0].token_ids[0], out.outputs[0].logprobs[0]) for out in outs]
    assert [out.outputs[0].token_ids[0] for out in raw_outs] == [token, cool_token]
    raw_entry, raw_cool_entry = [out.outputs[0].logprobs[0] for out in raw_outs]
    assert entry[token] == 0.0
    for prompt, tok, raw in zip(prompts, (token, cool_token), (raw_entry, raw_cool_entry)):
        assert abs(raw[tok] - hf_token_logprobs(path, prompt, [tok])[0]) < TOLERANCE
    assert raw_entry[token] < 0
    assert abs(cool_entry[cool_token]
               - hf_token_logprobs(path, prompts[1], [cool_token], 0.7)[0]) < TOLERANCE


def test_given_token_logprobs_on_a_hand_worked_case():
    """logits (0, ln 3): p = (1/4, 3/4); at temperature 2, (0, ln 3 / 2): p1 = r3 / (1 + r3)."""
    logits = np.array([[0.0, np.log(3.0)], [0.0, np.log(3.0)]], np.float32)
    rows = PositionRows.from_lists([0, 1], [1, 0], [1.0, 2.0], size=2)
    out = given_token_logprobs(logits, rows, num_logprobs=1)
    root = np.sqrt(3.0)
    np.testing.assert_allclose(out.logprobs, [np.log(0.75), np.log(1 / (1 + root))], rtol=1e-6)
    np.testing.assert_allclose(out.top_logprobs[:, 0], [np.log(0.75), np.log(root / (1 + root))],
                               rtol=1e-6)
    assert out.top_ids[:, 0].tolist() == [1, 1] and out.token_ids.tolist() == [1, 0]


def test_sampling_params_cap_prompt_logprobs():
    with pytest.raises(ValueError, match="prompt_logprobs must be at most 20"):
        SamplingParams(prompt_logprobs=21)
    with pytest.raises(ValueError, match="prompt_logprobs must be at least 0"):
        SamplingParams(prompt_logprobs=-1)


# ---- the server -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def client(path, engines):
    engine = engines[True]   # from here on only the app's engine thread drives it
    app = build_app(AsyncEngine(engine, NAME), model_info(engine, path, NAME))
    with TestClient(app) as test_client:
        yield test_client


def test_server_prompt_logprobs_and_echo(path, client):
    prompt = tokens_of([9], seed=7)[0]
    body = {"prompt": prompt, "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    table = hf_log_softmax(path, prompt)
    reply = client.post("/v1/completions", json={**body, "prompt_logprobs": 1}).json()
    listed = reply["choices"][0]["prompt_logprobs"]
    assert len(listed) == len(prompt) and listed[0] is None
    for position, (token, entry) in enumerate(zip(prompt[1:], listed[1:]), 1):
        assert abs(entry[str(token)]["logprob"] - table[position - 1, token]) < TOLERANCE
        best = int(np.argmax(table[position - 1]))
        assert entry[str(best)]["rank"] == 1
    plain = client.post("/v1/completions", json={**body, "logprobs": 0}).json()["choices"][0]
    echoed = client.post("/v1/completions", json={**body, "logprobs": 0, "echo": True}).json()
    choice = echoed["choices"][0]
    assert "prompt_logprobs" not in choice and choice["text"].endswith(plain["text"])
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(prompt) + 3
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    np.testing.assert_allclose(logprobs["token_logprobs"][1:len(prompt)],
                               table[np.arange(len(prompt) - 1), prompt[1:]], atol=TOLERANCE)
    # The echo request also computes prompt logprobs, so its steps are chunked and batched
    # unlike the plain one's: its completion's tokens are the same, its float32 logprobs equal
    # only to a tolerance (tests/logprob_compare.py says why).
    for key in ("tokens", "token_logprobs", "top_logprobs"):   # text_offset: checked below
        assert_equal_but_floats_close(logprobs[key][len(prompt):], plain["logprobs"][key],
                                      where=key)
    assert logprobs["text_offset"][len(prompt)] == len(choice["text"]) - len(plain["text"])
    chat = client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "temperature": 0,
        "prompt_logprobs": 0}).json()["choices"][0]
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) > 1
    bad = client.post("/v1/completions", json={**body, "prompt_logprobs": 21})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt_logprobs"


def test_the_across_requests_comparison_tells_rounding_from_a_different_reply():
    from tests.logprob_compare import ACROSS_REQUESTS_ATOL as ATOL

    seen = {"tokens": ["a", "b"], "token_logprobs": [-3.7172932624816895, -0.5],
            "top_logprobs": [{"a": -3.7172932624816895}, {}], "text_offset": [0, 1]}
    rounded = {**seen, "token_logprobs": [-3.7172935009002686, -0.5],
               "top_logprobs": [{"a": -3.7172935009002686}, {}]}
    assert_equal_but_floats_close(rounded, seen)
    for wrong in ({**seen, "tokens": ["a", "c"]}, {**seen, "text_offset": [0, 2]},
                  {**seen, "token_logprobs": [-3.7172932624816895, -0.5 - 2 * ATOL]},
                  {**seen, "top_logprobs": [{"b": -3.7172932624816895}, {}]},
                  {**seen, "token_logprobs": [None, -0.5]}):
        with pytest.raises(AssertionError):
            assert_equal_but_floats_close(wrong, seen)

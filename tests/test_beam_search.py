"""Beam search: token-exact parity with transformers' beam search (greedy for width 1), beams
sharing KV blocks with copy-on-write, no leaked blocks or slots, and eager validation."""

import functools
import json
import math
import shutil

import numpy as np
import pytest

from jpaged import LLM, BeamSearchParams, SamplingParams
from jpaged.engine.beam_search import Beam, Candidate, SelectionRule, top_candidates

MAX_TOKENS = 10
BLOCK_SIZE = 4
# EOS ids the tiny llama_gqa emits within 10 tokens of PROMPTS (found with transformers), so
# hypotheses end mid-search. Two ids: transformers then keeps K = 3 * beam_width candidates.
EOS_IDS = [114, 26]


def prompts_of(lengths, seed=0, vocab=320):
    rng = np.random.default_rng(seed)
    return [rng.integers(2, vocab, size=n).tolist() for n in lengths]


# max_num_seqs 4: width-4 prompts run one after another (each waits for the slots), width 1 and 2
# batch several prompts' beams into each step. The 19-token prompt exceeds the 16-token step
# budget, so its prefill is chunked, next to other prompts' beams.
PROMPTS = prompts_of([7, 19, 3])


@pytest.fixture(scope="module")
def checkpoint(hf_checkpoints, tmp_path_factory) -> str:
    """llama_gqa with EOS_IDS as its eos_token_id (config and generation config)."""
    target = tmp_path_factory.mktemp("beam_checkpoint") / "llama_gqa"
    shutil.copytree(hf_checkpoints["llama_gqa"], target)
    for file in ("config.json", "generation_config.json"):
        config = json.loads((target / file).read_text())
        config["eos_token_id"] = EOS_IDS
        (target / file).write_text(json.dumps(config))
    return str(target)


@functools.cache
def hf_model(path: str):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@functools.cache
def hf_beams(path: str, prompt: tuple, width: int, length_penalty: float, ignore_eos: bool):
    """transformers' generate(num_beams=width): [(generated tokens up to the first EOS, score)],
    best first. Width 1 is transformers' greedy search (no scores: None)."""
    import torch

    model = hf_model(path)
    config = model.generation_config
    eos = set() if ignore_eos else set(config.eos_token_id)
    saved, config.eos_token_id = config.eos_token_id, None if ignore_eos else config.eos_token_id
    try:
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), num_beams=width, do_sample=False,
                                 max_new_tokens=MAX_TOKENS, num_return_sequences=width,
                                 length_penalty=length_penalty, pad_token_id=0,
                                 return_dict_in_generate=True, output_scores=True)
    finally:
        config.eos_token_id = saved
    scores = getattr(out, "sequences_scores", None)
    results = []
    for row, tokens in enumerate(out.sequences[:, len(prompt):].tolist()):
        ends = [i for i, token in enumerate(tokens) if token in eos]
        results.append((tokens[:ends[0] + 1] if ends else tokens,
                        None if scores is None else float(scores[row])))
    return results


@functools.cache
def llm_for(path: str) -> LLM:
    return LLM(path, num_kv_blocks=64, max_model_len=64, max_num_seqs=4,
               max_num_batched_tokens=16, block_size=BLOCK_SIZE)


def assert_engine_clean(llm: LLM):
    """Every block and slot back; the device block manager agrees with the host mirror."""
    engine = llm.engine
    assert engine.ledger.mirror.num_free == engine.config.num_kv_blocks - 1
    assert sorted(engine.ledger.free_slots) == list(range(engine.config.max_num_seqs))
    assert not engine.ledger.has_ops
    assert int(engine.executor.manager.num_free) == engine.ledger.mirror.num_free
    assert np.asarray(engine.executor.manager.refcounts).tolist() == engine.ledger.mirror.refcounts


CASES = [  # (beam_width, length_penalty, ignore_eos)
    (4, 1.0, False),
    (4, 0.0, False),    # raw sums: short EOS hypotheses win and the search stops early
    (4, 1.0, True),
    (2, 2.0, False),
    (2, 0.0, True),
    (1, 1.0, False),    # greedy: the 7- and 19-token prompts stop at EOS after 2 tokens
    (1, 1.0, True),
]


@pytest.mark.parametrize("width,length_penalty,ignore_eos", CASES)
def test_matches_transformers_beam_search(checkpoint, width, length_penalty, ignore_eos):
    path = checkpoint
    llm = llm_for(path)
    params = BeamSearchParams(width, MAX_TOKENS, length_penalty, ignore_eos)
    outputs = llm.beam_search(PROMPTS, params)   # all prompts' beams batched in each step
    assert len(outputs) == len(PROMPTS)
    for prompt, output in zip(PROMPTS, outputs):
        reference = hf_beams(path, tuple(prompt), width, length_penalty, ignore_eos)
        assert output.prompt_token_ids == prompt
        assert [s.token_ids for s in output.sequences] == [tokens for tokens, _ in reference]
        for sequence, (tokens, score) in zip(output.sequences, reference):
            assert sequence.score == pytest.approx(
                sequence.cum_logprob / len(tokens) ** length_penalty, rel=1e-6)
            if score is not None:
                assert sequence.score == pytest.approx(score, abs=2e-5)
            eos_ended = not ignore_eos and tokens[-1] in EOS_IDS
            assert sequence.finish_reason == ("stop" if eos_ended else "length")
        assert [s.score for s in output.sequences] == sorted(
            (s.score for s in output.sequences), reverse=True)
    assert_engine_clean(llm)


def test_eos_ends_hypotheses_mid_search(checkpoint):
    """The parity grid is only meaningful if EOS really ends some hypotheses early."""
    llm = llm_for(checkpoint)
    output = llm.beam_search(PROMPTS[0], BeamSearchParams(4, MAX_TOKENS))[0]
    lengths = [len(s.token_ids) for s in output.sequences]
    assert any(n < MAX_TOKENS for n in lengths) and any(n == MAX_TOKENS for n in lengths)
    assert {s.finish_reason for s in output.sequences} == {"stop", "length"}


def test_text_and_dict_prompts_give_the_same_beams(checkpoint):
    llm = llm_for(checkpoint)
    text = "The quick brown fox"
    token_ids = llm.get_tokenizer().encode(text).ids
    params = BeamSearchParams(2, 6, ignore_eos=True)
    by_text, by_dict, by_list = llm.beam_search(
        [text, {"prompt_token_ids": token_ids}, token_ids], params)
    assert by_text.prompt == text and by_dict.prompt is None
    for output in (by_dict, by_list):   # batch composition may move logprobs by float rounding
        assert [s.token_ids for s in output.sequences] == [s.token_ids for s in by_text.sequences]
        assert [s.score for s in output.sequences] == pytest.approx(
            [s.score for s in by_text.sequences], abs=1e-5)
    tokenizer = llm.get_tokenizer()
    for sequence in by_text.sequences:
        assert sequence.text == tokenizer.decode(sequence.token_ids)
    assert_engine_clean(llm)


def test_max_model_len_caps_the_generated_length(checkpoint):
    llm = llm_for(checkpoint)
    prompt = prompts_of([60], seed=3)[0]               # max_model_len 64: 4 tokens at most
    capped = llm.beam_search(prompt, BeamSearchParams(2, MAX_TOKENS, ignore_eos=True))[0]
    short = llm.beam_search(prompt, BeamSearchParams(2, 4, ignore_eos=True))[0]
    assert [s.token_ids for s in capped.sequences] == [s.token_ids for s in short.sequences]
    assert all(len(s.token_ids) == 4 and s.finish_reason == "length" for s in capped.sequences)
    assert_engine_clean(llm)


def test_beams_share_blocks_and_copy_on_write(checkpoint, monkeypatch):
    llm = llm_for(checkpoint)
    mirror = llm.engine.ledger.mirror
    free_before = mirror.num_free
    fewest_free, copies = [free_before], []
    append = mirror.append

    def watched_append(rows):
        ok, slots, row_copies = append(rows)
        fewest_free[0] = min(fewest_free[0], mirror.num_free)
        copies.extend(copy for copy in row_copies if copy is not None)
        return ok, slots, row_copies

    monkeypatch.setattr(mirror, "append", watched_append)
    prompt, width = PROMPTS[0], 4                          # 7 tokens: a shared partial block
    llm.beam_search(prompt, BeamSearchParams(width, MAX_TOKENS, ignore_eos=True))
    peak = free_before - fewest_free[0]
    independent = width * math.ceil((len(prompt) + MAX_TOKENS - 1) / BLOCK_SIZE)
    assert peak < independent, (peak, independent)
    assert copies, "no beam ever wrote into a block it shared"
    assert mirror.num_free == free_before
    assert_engine_clean(llm)


def test_bad_parameters_and_prompts_raise_and_leak_nothing(checkpoint):
    bad = [dict(beam_width=0, max_tokens=4), dict(beam_width=11, max_tokens=4),
           dict(beam_width=2, max_tokens=0), dict(beam_width=2.0, max_tokens=4),
           dict(beam_width=2, max_tokens=4, length_penalty=float("nan")),
           dict(beam_width=2, max_tokens=4, length_penalty=float("inf")),
           dict(beam_width=2, max_tokens=4, ignore_eos=1)]
    for options in bad:
        with pytest.raises(ValueError):
            BeamSearchParams(**options)
    llm = llm_for(checkpoint)
    with pytest.raises(ValueError, match="EOS"):   # two EOS ids: K = 3 * 7 > 20
        llm.beam_search([5, 6], BeamSearchParams(7, 4))
    with pytest.raises(ValueError, match="max_num_seqs"):
        llm.beam_search([5, 6], BeamSearchParams(5, 4, ignore_eos=True))
    with pytest.raises(ValueError, match="max_model_len"):
        llm.beam_search([[5, 6], [7] * 64], BeamSearchParams(2, 4))
    with pytest.raises(ValueError, match="KV blocks"):   # 4 beams x 16 blocks > 63
        llm.beam_search([5, 6], BeamSearchParams(4, 61, ignore_eos=True))
    with pytest.raises(ValueError, match="outside"):
        llm.beam_search([5, 400], BeamSearchParams(2, 4))
    with pytest.raises(ValueError, match="prompt"):
        llm.beam_search([[]], BeamSearchParams(2, 4))
    with pytest.raises(ValueError, match="params"):
        llm.beam_search([5, 6], SamplingParams())
    llm.engine.add_request("busy", prompt_token_ids=[5, 6], params=SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="idle"):
        llm.beam_search([5, 6], BeamSearchParams(2, 4))
    llm.engine.abort("busy")
    assert_engine_clean(llm)


def test_selection_rule_on_a_hand_worked_step():
    """W = 2, K = 4, EOS 9. Candidates: (b0, 9) -1.1, (b0, 5) -1.2, (b1, 8) -1.6, (b1, 9) -1.8.
    Rank 0 ends (score -1.1 / 2); rank 3 also ends but is not in the top W, so it is dropped;
    ranks 1 and 2 are the next beams."""
    beams = [Beam([3], -1.0), Beam([4], -1.5)]
    top_ids = [[9, 5, 6, 7], [8, 9, 5, 6]]
    top_logprobs = [[-0.1, -0.2, -2.0, -3.0], [-0.1, -0.3, -2.0, -3.0]]
    candidates = top_candidates(beams, top_ids, top_logprobs, keep=4)
    assert candidates == [Candidate(0, 9, -1.1), Candidate(0, 5, -1.2), Candidate(1, 8, -1.6),
                          Candidate(1, 9, -1.8)]
    rule = SelectionRule(beam_width=2, length_penalty=1.0, eos_token_ids=frozenset({9}),
                         max_new_tokens=5)
    running, finished, is_done = rule.select(beams, candidates, [])
    assert running == candidates[1:3]
    assert [(score, beam.token_ids) for score, beam in finished] == [(-1.1 / 2, [3, 9])]
    assert not is_done                                  # only 1 of W hypotheses
    # With W hypotheses the best beam's -1.2 / 2 = -0.6 cannot beat the worst (-0.55): done.
    _, finished, is_done = rule.select(beams, candidates, [(-0.5, Beam([1, 9], -1.0))])
    assert [score for score, _ in finished] == [-0.5, -0.55] and is_done
    # Length penalty 0 scores raw sums: -1.2 > -1.5, so the search goes on.
    rule.length_penalty = 0.0
    _, finished, is_done = rule.select(beams, candidates, [(-1.5, Beam([1, 9], -1.5))])
    assert [score for score, _ in finished] == [-1.1, -1.5] and not is_done
    # At the length limit every candidate ends; the top W become hypotheses.
    rule.max_new_tokens = 2
    running, finished, is_done = rule.select(beams, candidates, [])
    assert running == [] and is_done
    assert [beam.token_ids for _, beam in finished] == [[3, 9], [3, 5]]


def test_per_beam_top_k_finds_the_global_top_k():
    """transformers takes the top K over beams x vocabulary; each beam's own top K suffice."""
    rng = np.random.default_rng(0)
    width, vocab, keep = 4, 50, 8
    logprobs = np.log(rng.dirichlet(np.ones(vocab), size=width))
    beams = [Beam([0], float(c)) for c in rng.normal(-3, 1, size=width)]
    order = np.argsort(-logprobs, axis=1)[:, :keep]
    candidates = top_candidates(beams, order, np.take_along_axis(logprobs, order, 1), keep)
    flat = (np.array([b.cum_logprob for b in beams])[:, None] + logprobs).ravel()
    best = np.argsort(-flat)[:keep]
    assert [(c.parent, c.token_id) for c in candidates] == [divmod(int(i), vocab) for i in best]
    assert [c.cum_logprob for c in candidates] == pytest.approx(flat[best].tolist())

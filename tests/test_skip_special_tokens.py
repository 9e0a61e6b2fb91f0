"""skip_special_tokens end to end, on a tiny Llama whose tokenizer has <|python_tag|> and
[TOOL_CALLS] as special tokens: the text keeps them only when asked (token ids the same both
ways), the token that ends a request is never text, and stop strings match across special
tokens."""

import pytest
import tokenizers

from jpaged import LLM, SamplingParams
from jpaged.structured_outputs import StructuredOutputsParams
from jpaged.serve.tool_parsers import PYTHON_TAG, TOOL_CALLS
from tests import hf_fixtures

EOS, TAG, CALLS = 1, 2, 3   # token ids: write_tokenizer puts the extra specials at 2, 3
SETTINGS = dict(num_kv_blocks=64, max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64)
GREEDY = dict(temperature=0, max_tokens=4)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    pytest.importorskip("transformers")
    out_dir = tmp_path_factory.mktemp("special_tokens")
    hf_fixtures.build_llama_mha(out_dir)    # eos_token_id 1 only
    hf_fixtures.write_tokenizer(out_dir, (PYTHON_TAG, TOOL_CALLS))
    tokenizer = tokenizers.Tokenizer.from_file(str(out_dir / "tokenizer.json"))
    assert [tokenizer.token_to_id(token) for token in (PYTHON_TAG, TOOL_CALLS)] == [TAG, CALLS]
    return str(out_dir)


@pytest.fixture(scope="module")
def llm(checkpoint):
    return LLM(checkpoint, **SETTINGS)


def _both_ways(llm, **params):
    """The completion with skip_special_tokens True, then False."""
    return [llm.generate("Hello", SamplingParams(**params, skip_special_tokens=skip),
                         use_tqdm=False)[0].outputs[0] for skip in (True, False)]


def test_special_tokens_are_text_only_when_not_skipped(llm):
    grammar = StructuredOutputsParams(grammar='start: "Sure." <|python_tag|> "{}"')
    skipped, kept = _both_ways(llm, temperature=0, max_tokens=20,
                                structured_outputs=grammar)
    assert kept.text == "Sure.<|python_tag|>{}" and skipped.text == "Sure.{}"
    assert kept.token_ids == skipped.token_ids and TAG in kept.token_ids
    forced_skipped, forced_kept = _both_ways(llm, **GREEDY, logit_bias={TAG: 100})
    assert forced_kept.token_ids == forced_skipped.token_ids == [TAG] * 4
    assert (forced_kept.text, forced_skipped.text) == (PYTHON_TAG * 4, "")


@pytest.mark.parametrize("stop", [{"logit_bias": {EOS: 100}},
                                  {"logit_bias": {TAG: 100}, "stop_token_ids": [TAG]},
                                  {"logit_bias": {70: 100}, "stop_token_ids": [70]}],
                         ids=["eos", "special-stop-id", "plain-stop-id"])
def test_the_token_that_ends_a_request_is_a_token_but_not_text(llm, stop):
    for output in _both_ways(llm, **GREEDY, **stop):
        assert output.token_ids == [next(iter(stop["logit_bias"]))]
        assert (output.text, output.finish_reason) == ("", "stop")


def test_ignore_eos_makes_eos_text_like_any_special_token(llm):
    skipped, kept = _both_ways(llm, **GREEDY, logit_bias={EOS: 100}, ignore_eos=True)
    assert kept.token_ids == skipped.token_ids == [EOS] * 4
    assert (kept.text, skipped.text) == ("</s>" * 4, "")


def test_stop_strings_match_across_special_tokens(llm):
    skipped, kept = _both_ways(llm, **GREEDY, logit_bias={TAG: 100}, stop=["|><|"])
    assert (kept.text, kept.token_ids, kept.finish_reason) == ("<|python_tag", [TAG] * 2, "stop")
    assert (skipped.text, skipped.token_ids, skipped.finish_reason) == ("", [TAG] * 4, "length")

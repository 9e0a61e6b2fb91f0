"""Structured outputs: constraint parameters, their compilation to token masks (the built-in
model's byte tokenizer: token t is byte t), the mask in the sampler, and whole requests through
the engine, whose outputs must parse, validate and end when the constraint is complete."""

import collections
import json
import re
import threading

import jax
import jsonschema
import numpy as np
import pytest
import tokenizers

from jpaged import LLM, SamplingParams
from jpaged.engine.builder import default_model_dir
from jpaged.sampling import SamplingRow, SamplingTensors, sample
from jpaged.structured_outputs import (ConstraintCompiler, LoopMatchers,
                                       StructuredOutputsParams as Structured)

VOCAB = 257   # the built-in model: 256 bytes and <|endoftext|> (256, EOS)
SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150},
                         "tags": {"type": "array", "items": {"enum": ["red", "green"]},
                                  "maxItems": 3}},
          "required": ["name", "age", "tags"], "additionalProperties": False}


def allowed_ids(words: np.ndarray) -> list[int]:
    return np.flatnonzero(np.unpackbits(words.view(np.uint8), bitorder="little")).tolist()


@pytest.fixture(scope="module")
def compiler():
    tokenizer = tokenizers.Tokenizer.from_file(str(default_model_dir() / "tokenizer.json"))
    return ConstraintCompiler(tokenizer, VOCAB, [256])


# ---------------------------------------------------------------------------- parameters


@pytest.mark.parametrize("fields,message", [
    ({}, "exactly one"), ({"regex": "a", "choice": ["a"]}, "exactly one"),
    ({"choice": []}, "choice"), ({"choice": ["a", ""]}, "choice"), ({"choice": "ab"}, "choice"),
    ({"regex": ""}, "regex"), ({"grammar": 3}, "grammar"), ({"json": "{"}, "not valid JSON"),
    ({"json": "[1]"}, "JSON schema"), ({"json_object": "yes"}, "json_object")])
def test_malformed_parameters_raise_naming_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        Structured(**fields)
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs=fields)


def test_parameters_are_normalised_and_hashable():
    a = SamplingParams(structured_outputs={"json": SCHEMA})
    b = SamplingParams(structured_outputs=Structured(json=json.dumps(SCHEMA, indent=2)))
    assert a == b and hash(a) == hash(b)
    assert json.loads(a.structured_outputs.json) == SCHEMA
    assert list(json.loads(a.structured_outputs.json)["properties"]) == ["name", "age", "tags"]
    assert Structured(choice=["x", "y"]).choice == ("x", "y")
    with pytest.raises(ValueError, match="unknown fields"):
        SamplingParams(structured_outputs={"jsonschema": SCHEMA})


# ---------------------------------------------------------------------------- compilation


def test_choice_mask_allows_exactly_the_next_bytes(compiler):
    constraint = compiler.constraint(Structured(choice=["yes", "no", "maybe"]))
    assert allowed_ids(constraint.allowed()) == sorted(map(ord, "ynm"))
    assert constraint.consume([ord("y")]) == (1, False)
    assert allowed_ids(constraint.allowed()) == [ord("e")]
    assert constraint.consume([ord("e"), ord("s"), ord("!")]) == (2, True)   # complete at 's'
    with pytest.raises(ValueError, match="rejected token"):
        compiler.constraint(Structured(choice=["yes"])).consume([ord("n")])


@pytest.mark.parametrize("fields,kind", [
    ({"json": {"type": "nonsense"}}, "json"), ({"regex": "(a"}, "regex"),
    ({"grammar": "start: undefined_rule"}, "grammar"), ({"grammar": "root ::= ("}, "grammar")])
def test_malformed_schema_regex_or_grammar_is_a_value_error_naming_it(compiler, fields, kind):
    with pytest.raises(ValueError, match=f"structured_outputs.{kind}"):
        compiler.constraint(Structured(**fields))


def test_each_constraint_compiles_once_and_requests_get_independent_copies(compiler):
    params = Structured(regex=r"[0-9]{2}")
    before = compiler.num_compiled
    first, second = compiler.constraint(params), compiler.constraint(params)
    assert compiler.num_compiled == before + 1
    first.consume([ord("4")])
    assert len(allowed_ids(second.allowed())) == 10   # untouched by the first's token
    assert first.fork().consume([ord("2")]) == (1, True)


def test_loop_matchers_advance_rows_and_retire_them_when_complete(compiler):
    """The host side of a decode loop's constrained rows: slot 7 is constrained, slot 3 is not;
    each call takes the tokens of the rows that sampled and returns the next masks."""
    constraint = compiler.constraint(Structured(choice=["yes", "no"]))
    matchers = LoopMatchers()
    first = matchers.start([7], [constraint])
    assert allowed_ids(first[0]) == [ord("n"), ord("y")]
    seq_ids, tokens = np.array([3, 7, -1], np.int32), np.array([65, ord("n"), 0], np.int32)
    masks, complete = matchers.advance(seq_ids, np.array([True, True, False]), tokens)
    assert (masks[[0, 2]] == -1).all() and allowed_ids(masks[1]) == [ord("o")]
    assert complete.tolist() == [0, 0, 0]
    assert constraint.allowed().tolist() == first[0].tolist()   # the sequence's own: untouched
    # An iteration that did not run (the loop stopped) hands back the same mask.
    masks, _ = matchers.advance(seq_ids, np.array([False, False, False]), tokens)
    assert allowed_ids(masks[1]) == [ord("o")]
    masks, complete = matchers.advance(seq_ids, np.array([True, True, False]),
                                       np.array([66, ord("o"), 0], np.int32))
    assert complete.tolist() == [0, 1, 0]
    # A token the mask forbade retires the row too (the sequence's own matcher then fails it).
    matchers.start([5], [compiler.constraint(Structured(choice=["yes"]))])
    _, complete = matchers.advance(np.array([5], np.int32), np.array([True]),
                                   np.array([ord("n")], np.int32))
    assert complete.tolist() == [1]


# ---------------------------------------------------------------------------- the sampler


def test_masked_rows_sample_only_allowed_tokens_and_others_are_unchanged(compiler):
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, VOCAB)).astype(np.float32) * 4
    mask = compiler.constraint(Structured(choice=["ab", "cd"])).allowed()
    rows = [SamplingRow(SamplingParams(temperature=0), 0, 0, 0, mask),
            SamplingRow(SamplingParams(temperature=1.0, seed=4), 4, 0, 7, mask),
            SamplingRow(SamplingParams(temperature=1.0, seed=5), 5, 0, 7)]
    run = jax.jit(sample, static_argnames="num_logprobs")
    out = run(logits, SamplingTensors.from_rows(rows), num_logprobs=2)
    allowed = [ord("a"), ord("c")]
    assert int(out.token_ids[0]) == allowed[int(np.argmax(logits[0, allowed]))]
    for position in range(40):   # many draws of the sampled row
        drawn = run(logits[1:2], SamplingTensors.from_rows(
            [rows[1]._replace(position=position)]))
        assert int(drawn.token_ids[0]) in allowed
    alone = run(logits[2:], SamplingTensors.from_rows(rows[2:]), num_logprobs=2)
    for leaf_batch, leaf_alone in zip(jax.tree.leaves(out), jax.tree.leaves(alone)):
        np.testing.assert_array_equal(np.asarray(leaf_batch)[2], np.asarray(leaf_alone)[0])
    log_softmax = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    np.testing.assert_allclose(out.logprobs[0], log_softmax[0, out.token_ids[0]], rtol=1e-5)


# ---------------------------------------------------------------------------- the engine


@pytest.fixture(scope="module")
def llm():
    """Synchronous scheduling: the tests below count steps and look at the engine between them
    (async runs are built where a test wants one)."""
    return LLM(None, block_size=16, max_num_seqs=8, max_num_batched_tokens=128,
               max_model_len=256, num_scheduler_steps=4, async_scheduling=False)


def _generate(llm, prompts, params):
    return [out.outputs for out in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.gpu_suite
def test_constrained_outputs_parse_validate_and_stop(llm):
    schema = Structured(json=SCHEMA)
    params = [SamplingParams(temperature=0, max_tokens=120, structured_outputs=schema),
              SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=120,
                             structured_outputs=schema),
              SamplingParams(temperature=0.8, seed=4, max_tokens=80,
                             structured_outputs=Structured(json_object=True)),
              SamplingParams(temperature=1.0, seed=5, max_tokens=40, structured_outputs=Structured(
                  regex=r"[a-z]{2,8}@[a-z]{2,6}\.(com|org)")),
              SamplingParams(temperature=0, max_tokens=20,
                             structured_outputs=Structured(choice=["left", "right"])),
              SamplingParams(temperature=1.0, seed=6, max_tokens=30,
                             structured_outputs=Structured(
                                 grammar='root ::= "(" [0-9] [0-9]? [0-9]? ")"')),
              SamplingParams(temperature=0, max_tokens=30, structured_outputs=Structured(
                  grammar='start: "x=" NUM\nNUM: /[1-9][0-9]?/'))]
    outputs = _generate(llm, ["def f(", "import os\n", "x = ", "email: ", "go ", "(", "y"],
                        params)
    for completion in outputs[0] + outputs[1]:
        jsonschema.validate(json.loads(completion.text), SCHEMA)
    assert outputs[1][0].text != outputs[1][1].text   # two samples, two draws
    assert isinstance(json.loads(outputs[2][0].text), dict)
    assert re.fullmatch(r"[a-z]{2,8}@[a-z]{2,6}\.(com|org)", outputs[3][0].text)
    assert outputs[4][0].text in ("left", "right")
    assert re.fullmatch(r"\([0-9]{1,3}\)", outputs[5][0].text)
    assert re.fullmatch(r"x=[1-9][0-9]?", outputs[6][0].text)
    assert all(c.finish_reason == "stop" for out in outputs for c in out)


@pytest.mark.gpu_suite
def test_unconstrained_requests_get_the_same_tokens_beside_constrained_ones(llm):
    plain = SamplingParams(temperature=0.9, seed=8, max_tokens=40, ignore_eos=True)
    alone = _generate(llm, ["class A:"], plain)[0][0]
    mixed = _generate(llm, ["class A:", "z"], [plain, SamplingParams(
        temperature=0, max_tokens=60, structured_outputs=Structured(json=SCHEMA))])
    assert mixed[0][0].token_ids == alone.token_ids
    assert mixed[0][0].finish_reason == "length"


def _counting(monkeypatch, executor) -> collections.Counter:
    """Calls of the executor's single steps and decode loops, counted as they happen."""
    calls = collections.Counter()
    for name in ("run_rows", "launch_decode", "continue_decode"):
        def counted(*args, _method=getattr(executor, name), _name=name, **kwargs):
            calls[_name] += 1
            return _method(*args, **kwargs)
        monkeypatch.setattr(executor, name, counted)
    return calls


def _with_logprobs(completion) -> tuple[list[int], list[float]]:
    return completion.token_ids, [entry[token] for entry, token in
                                  zip(completion.logprobs, completion.token_ids)]


@pytest.mark.gpu_suite
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_constrained_rows_keep_the_decode_loop(llm, monkeypatch, async_scheduling):
    """Constrained rows decode inside device loops (their matchers advanced by the loop, a row
    retired the iteration its constraint completes) with the unconstrained rows beside them:
    after the one prefill step no batch steps one token at a time, and every output, token
    for token and logprob for logprob, is the one an engine that steps constrained batches one
    token at a time writes."""
    prompts = ["def f(", "import os\n", "x = ", "class A:", "go "]
    params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=80, logprobs=1,
                             structured_outputs=Structured(json=SCHEMA)) for seed in range(3)]
    params += [SamplingParams(temperature=0.9, seed=8, max_tokens=60, ignore_eos=True,
                              logprobs=1),
               SamplingParams(temperature=0, max_tokens=20, logprobs=1,
                              structured_outputs=Structured(choice=["left", "right"]))]
    stepping = LLM(None, block_size=16, max_num_seqs=8, max_num_batched_tokens=128,
                   max_model_len=256, num_scheduler_steps=4, async_scheduling=False)
    stepping.engine.scheduler.loops_take_constraints = False
    expected = _generate(stepping, prompts, params)
    looping = llm if not async_scheduling else LLM(
        None, block_size=16, max_num_seqs=8, max_num_batched_tokens=128, max_model_len=256,
        num_scheduler_steps=4, async_scheduling=True)
    calls = _counting(monkeypatch, looping.engine.executor)
    outputs = _generate(looping, prompts, params)
    assert calls["run_rows"] == 1   # the prefill step
    # The longest output: 60 tokens, the first from the prefill step, the rest 4 a loop.
    assert calls["launch_decode"] + calls["continue_decode"] >= -(-59 // 4)
    assert (calls["continue_decode"] > 0) == async_scheduling
    for out, want in zip(outputs, expected):
        tokens, logprobs = _with_logprobs(out[0])
        want_tokens, want_logprobs = _with_logprobs(want[0])
        assert tokens == want_tokens and out[0].finish_reason == want[0].finish_reason
        np.testing.assert_allclose(logprobs, want_logprobs, rtol=1e-5, atol=1e-6)
    for out in outputs[:3]:
        jsonschema.validate(json.loads(out[0].text), SCHEMA)
        assert out[0].finish_reason == "stop"
    assert outputs[4][0].text in ("left", "right") and outputs[4][0].finish_reason == "stop"


@pytest.mark.gpu_suite
def test_a_constrained_loop_runs_while_the_engine_goes_on(monkeypatch):
    """A loop holding the matchers' host callback runs inside the call that dispatches it, so
    the executor dispatches it from a thread of its own: the step that launches one returns
    while the loop is held in its first callback, and the batch then ends as it would."""
    llm = LLM(None, block_size=16, max_num_seqs=8, max_num_batched_tokens=128,
              max_model_len=256, num_scheduler_steps=4, async_scheduling=True)
    engine = llm.engine
    gate, waited, advance = threading.Event(), [], engine.executor.loop_matchers.advance

    def held_once(*args):
        if not waited:
            waited.append(gate.wait(timeout=120))
        return advance(*args)

    # Before the loop is traced: its program calls the callback it was traced with.
    monkeypatch.setattr(engine.executor.loop_matchers, "advance", held_once)
    params = [SamplingParams(temperature=1.0, seed=3, max_tokens=80,
                             structured_outputs=Structured(json=SCHEMA)),
              SamplingParams(temperature=0.9, seed=8, max_tokens=30, ignore_eos=True)]
    expected = _generate(LLM(None, block_size=16, max_num_seqs=8, max_num_batched_tokens=128,
                             max_model_len=256, num_scheduler_steps=4, async_scheduling=False),
                         ["def f(", "class A:"], params)
    engine.add_request("constrained", "def f(", params[0])
    engine.add_request("plain", "class A:", params[1])
    for _ in range(4):
        if engine.pipeline.loops:
            break
        engine.step()
    assert engine.pipeline.loops and not waited   # a loop is launched and held in its callback
    gate.set()
    outputs = {}
    while engine.has_unfinished():
        outputs.update((out.request_id, out) for out in engine.step() if out.finished)
    assert waited == [True]
    assert outputs["constrained"].outputs[0].token_ids == expected[0][0].token_ids
    assert outputs["plain"].outputs[0].token_ids == expected[1][0].token_ids
    jsonschema.validate(json.loads(outputs["constrained"].outputs[0].text), SCHEMA)
    assert int(engine.executor.manager.num_free) == engine.ledger.mirror.num_free


def test_max_tokens_before_the_end_is_length(llm):
    out = _generate(llm, ["a"], SamplingParams(temperature=0, max_tokens=3,
                                               structured_outputs=Structured(json=SCHEMA)))[0][0]
    assert out.finish_reason == "length" and len(out.token_ids) == 3
    assert out.text.startswith('{"')


def test_a_bad_constraint_is_refused_before_anything_runs(llm):
    with pytest.raises(ValueError, match="structured_outputs.regex"):
        llm.generate(["a", "b"], [SamplingParams(max_tokens=2), SamplingParams(
            max_tokens=2, structured_outputs=Structured(regex="[z-a]"))], use_tqdm=False)
    assert not llm.engine.has_unfinished()


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_constrained_requests_give_the_same_valid_outputs(llm, mode):
    """A pool too small for the batch preempts constrained requests mid-output; each resumes
    with its matcher where it was and writes what it writes unpreempted."""
    prompts = ["def f(", "import os\n", "x = ", "class A:", "y", "z = ["]
    params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=120,
                             structured_outputs=Structured(json=SCHEMA)) for seed in range(6)]
    roomy = _generate(llm, prompts, params)
    tight = LLM(None, block_size=16, max_num_seqs=8, max_num_batched_tokens=128,
                max_model_len=256, num_scheduler_steps=4, num_kv_blocks=12,
                preemption_mode=mode, swap_space=0.01)
    outputs = tight.generate(prompts, params, use_tqdm=False)
    assert sum(out.num_preemptions for out in outputs) > 0
    for out, expected in zip(outputs, roomy):
        assert out.outputs[0].token_ids == expected[0].token_ids
        jsonschema.validate(json.loads(out.outputs[0].text), SCHEMA)


def test_an_aborted_constrained_request_frees_everything_and_the_next_one_is_valid(llm):
    engine = llm.engine
    free_before = engine.num_free_blocks
    params = SamplingParams(temperature=1.0, seed=9, max_tokens=120,
                            structured_outputs=Structured(json=SCHEMA))
    engine.add_request("aborted", "def g(", params)
    for _ in range(5):
        engine.step()
    assert engine.abort("aborted") and not engine.has_unfinished()
    engine.apply_block_ops()
    assert engine.num_free_blocks == free_before
    out = _generate(llm, ["def g("], params)[0][0]
    jsonschema.validate(json.loads(out.text), SCHEMA)

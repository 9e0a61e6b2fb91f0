"""One request can never hurt another: a fault injected into one request's output processing
fails that request alone, with an error on its output, while the others finish token-identical
to a clean run and every block comes back."""

import pytest

from jpaged import LLMEngine, SamplingParams


def prompts_of(count):
    return [[(7 * i + 3 * j) % 300 + 5 for j in range(6 + 3 * i)] for i in range(count)]


def engine_for(path, **options):
    defaults = dict(num_kv_blocks=96, max_model_len=128, max_num_seqs=8,
                    max_num_batched_tokens=64, dtype="float32")
    return LLMEngine.from_pretrained(path, **(defaults | options))


def run(engine, bad_prompt=None, join_at=3, max_steps=500, bad_n=1):
    """Four good requests (greedy and seeded), and the bad one joining at step join_at; the
    finished outputs by request id."""
    for i, prompt in enumerate(prompts_of(4)):
        engine.add_request(f"good{i}", prompt_token_ids=prompt,
                           params=SamplingParams(temperature=0.8, seed=10 + i, max_tokens=10,
                                                 ignore_eos=True) if i % 2 else
                           SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    finished = {}
    for step in range(max_steps):
        if step == join_at and bad_prompt is not None:
            engine.add_request("bad", prompt_token_ids=bad_prompt,
                               params=SamplingParams(temperature=0.8, seed=666, n=bad_n,
                                                     max_tokens=10, ignore_eos=True))
        if step >= join_at and not engine.has_unfinished():
            break
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    return finished


@pytest.fixture(scope="module")
def clean_outputs(hf_checkpoints):
    return run(engine_for(hf_checkpoints["llama_gqa"]))


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("fault_after", [0, 2])  # 0: at the prompt's end, as siblings are born
def test_a_fault_in_one_requests_output_processing_fails_it_alone(
        hf_checkpoints, monkeypatch, clean_outputs, n, fault_after):
    clean = clean_outputs
    engine = engine_for(hf_checkpoints["llama_gqa"])
    append = engine.output._append_samples

    def faulty_append(request, seq, samples):
        if request.request_id == "bad" and len(seq.output_token_ids) >= fault_after:
            raise KeyError("detokenizer broke")
        return append(request, seq, samples)

    monkeypatch.setattr(engine.output, "_append_samples", faulty_append)
    got = run(engine, bad_prompt=[21, 22, 23], bad_n=n)
    bad = got["bad"]
    assert bad.finished and "detokenizer broke" in bad.error
    assert all(c.finish_reason == "error" for c in bad.outputs)
    assert {k: v.outputs[0].token_ids for k, v in got.items() if k != "bad"} == \
        {k: v.outputs[0].token_ids for k, v in clean.items()}
    assert engine.stats()["num_preemptions"] == 0  # attributed at once: nobody else was touched
    assert engine.num_free_blocks == engine.config.num_kv_blocks - 1


@pytest.mark.parametrize("num_scheduler_steps", [1, 4])
@pytest.mark.parametrize("fault_after", [0, 3])  # 0: its prompt's step; 3: a decode step
def test_a_step_that_raises_for_one_request_fails_it_alone(
        hf_checkpoints, monkeypatch, clean_outputs, num_scheduler_steps, fault_after):
    """A fault raised while one request's step is built (before the device changes): the step
    runs again one request at a time, the faulty request fails with the error, the others
    finish token-identical to a clean run, and the device allocator equals the mirror."""
    from tests.test_multistep import assert_mirror_matches_device

    # synchronous: the fault is raised where a step's inputs are built, which a loop chained
    # behind another (async scheduling) does not do
    engine = engine_for(hf_checkpoints["llama_gqa"], num_scheduler_steps=num_scheduler_steps,
                        enable_prefix_caching=True, async_scheduling=False)
    executor = engine.executor
    build, launch = executor._build_inputs, executor.decode_inputs

    def bad_slot_in(slots):
        bad = engine._requests.get("bad")
        return (bad is not None and len(bad.sequences[0].output_token_ids) >= fault_after
                and bad.sequences[0].slot in slots)

    def faulty_build(rows, *args):
        if bad_slot_in([slot for slot, _ in rows]):
            raise OverflowError("step inputs overflow")
        return build(rows, *args)

    def faulty_launch(rows, *args):
        if bad_slot_in([slot for slot, _ in rows]):
            raise OverflowError("step inputs overflow")
        return launch(rows, *args)

    monkeypatch.setattr(executor, "_build_inputs", faulty_build)
    monkeypatch.setattr(executor, "decode_inputs", faulty_launch)
    got = run(engine, bad_prompt=[21, 22, 23])
    bad = got["bad"]
    assert bad.finished and "OverflowError: step inputs overflow" in bad.error
    assert bad.outputs[0].finish_reason == "error"
    # a loop launched before the fault's threshold runs its iterations
    assert fault_after <= len(bad.outputs[0].token_ids) < fault_after + num_scheduler_steps
    assert {k: v.outputs[0].token_ids for k, v in got.items() if k != "bad"} == \
        {k: v.outputs[0].token_ids for k, v in clean_outputs.items()}
    engine.apply_block_ops()
    assert_mirror_matches_device(engine)
    engine.ledger.evict_all()
    engine.apply_block_ops()
    assert engine.num_free_blocks == engine.config.num_kv_blocks - 1

"""The engine end to end on tiny Hugging Face checkpoints: parity with transformers through
continuous batching, preemption, n > 1 sharing, chunked prefill, stops, aborts, bad input."""

import functools

import jax
import numpy as np
import pytest

from jpaged import LLM, LLMEngine, RequestOutputKind, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def prompts_of(lengths, seed=0, vocab=320):
    rng = np.random.default_rng(seed)
    return [rng.integers(2, vocab, size=n).tolist() for n in lengths]


@functools.cache
def hf_greedy(path: str, prompt: tuple, max_tokens: int) -> list[int]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=0, min_new_tokens=max_tokens)
    return out[0, len(prompt):].tolist()


def engine_for(path, **options):
    defaults = dict(num_kv_blocks=96, max_model_len=256, max_num_seqs=8,
                    max_num_batched_tokens=64)
    return LLMEngine.from_pretrained(path, **(defaults | options))


def run_all_steps(engine, max_steps=2000) -> list:
    """Every output of every step until the engine is idle."""
    outputs = []
    for _ in range(max_steps):
        if not engine.has_unfinished():
            break
        outputs += engine.step()
    assert not engine.has_unfinished()
    return outputs


def run_to_completion(engine, max_steps=2000):
    outputs = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            break
        for output in engine.step():
            if output.finished:
                outputs[output.request_id] = output
    assert not engine.has_unfinished()
    return outputs


@pytest.mark.parametrize("name", ["llama_mha", "llama_gqa", "mistral", "qwen2", "llama_head_dim"])
def test_greedy_matches_transformers_in_one_continuous_batch(hf_checkpoints, name):
    path = hf_checkpoints[name]
    prompts = prompts_of([3, 17, 40, 9], seed=1)
    # Token budget 32 < the 40-token prompt: chunked prefill mixed with the others' decodes.
    llm = LLM(path, num_kv_blocks=64, max_model_len=64, max_num_seqs=4,
              max_num_batched_tokens=32)
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        assert output.outputs[0].token_ids == hf_greedy(path, tuple(prompt), 12), name
        assert output.outputs[0].finish_reason == "length"
    assert llm.stats()["num_free_blocks"] == 63


def test_late_arrivals_join_the_next_step_and_blocks_return_at_once(hf_checkpoints):
    engine = engine_for(hf_checkpoints["llama_gqa"], async_scheduling=False)
    total_free = engine.num_free_blocks
    engine.add_request("a", prompt_token_ids=prompts_of([20])[0],
                       params=SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    engine.step()
    engine.step()
    engine.add_request("b", prompt_token_ids=prompts_of([5], seed=2)[0],
                       params=SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    schedule_ids = []
    finished_at = {}
    for step in range(40):
        if not engine.has_unfinished():
            break
        outputs = engine.step()
        schedule_ids.append({o.request_id for o in outputs})
        for output in outputs:
            if output.finished:
                finished_at[output.request_id] = step
                if output.request_id == "a":
                    blocks_of_b = -(-(5 + len(schedule_ids) - 1) // 16)
                    # a's blocks are back the moment it finishes; only b holds blocks now.
                    assert engine.num_free_blocks == total_free - blocks_of_b
    assert schedule_ids[0] == {"a", "b"}  # b prefilled in the very next step, beside a's decode
    assert finished_at["a"] < finished_at["b"]
    assert engine.num_free_blocks == total_free
    assert int(engine.executor.manager.num_free) == engine.ledger.mirror.num_free


def test_parallel_samples_share_prompt_blocks_and_seeds_reproduce(hf_checkpoints):
    path = hf_checkpoints["llama_gqa"]
    engine = engine_for(path)
    prompt = prompts_of([40], seed=3)[0]
    params = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=5, ignore_eos=True)
    engine.add_request("n4", prompt_token_ids=prompt, params=params)
    used = []
    outputs = {}
    while engine.has_unfinished():
        for output in engine.step():
            outputs[output.request_id] = output
        used.append(engine.ledger.mirror.num_blocks - 1 - engine.num_free_blocks)
    # Four separate requests would hold 4 x ceil(45 / 16) = 12 blocks; forks share the 2 full
    # prompt blocks and copy only the partial one.
    assert max(used) == 2 + 4 * 1
    samples = [c.token_ids for c in outputs["n4"].outputs]
    assert len({tuple(s) for s in samples}) > 1, "n samples must be distinct streams"
    again = LLM(path, num_kv_blocks=96, max_model_len=256, max_num_seqs=8).generate(
        prompt_token_ids=[prompt], sampling_params=params, use_tqdm=False)[0]
    assert [c.token_ids for c in again.outputs] == samples


@pytest.mark.parametrize("options", [dict(), dict(num_scheduler_steps=4, async_scheduling=True)])
def test_forked_greedy_samples_read_the_copied_prompt_block(hf_checkpoints, options):
    """n = 3 greedy samples of a prompt ending mid-block: each sample's first append copies the
    shared partial block (the scheduler's "copy" operation; programs copy nothing), so every
    sample must equal transformers' greedy continuation."""
    path = hf_checkpoints["llama_gqa"]
    prompt = prompts_of([21], seed=11)[0]   # 16 + 5: the last prompt block is partial
    reference = hf_greedy(path, tuple(prompt), 10)
    engine = engine_for(path, **options)
    engine.add_request("n3", prompt_token_ids=prompt, params=SamplingParams(
        n=3, temperature=0, max_tokens=10, ignore_eos=True))
    out = run_to_completion(engine)["n3"]
    assert [c.token_ids for c in out.outputs] == [reference] * 3
    assert engine.num_free_blocks == 95


def test_small_pool_preempts_and_gives_the_same_greedy_outputs(hf_checkpoints):
    path = hf_checkpoints["llama_gqa"]
    prompts = prompts_of([30, 25, 20, 35, 12, 28], seed=4)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    # The reference: each prompt alone in a pool of the same size (one fits, nothing is
    # preempted), so both engines share their programs.
    one_at_a_time = LLM(path, num_kv_blocks=12, max_model_len=128, max_num_seqs=8,
                        preemption_mode="recompute")
    expected = [one_at_a_time.generate(prompt_token_ids=[prompt], sampling_params=params,
                                       use_tqdm=False)[0] for prompt in prompts]
    assert one_at_a_time.stats()["num_preemptions"] == 0
    small = LLM(path, num_kv_blocks=12, max_model_len=128, max_num_seqs=8,
                preemption_mode="recompute")
    got = small.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    assert small.stats()["num_preemptions"] > 0
    assert sum(o.num_preemptions for o in got) == small.stats()["num_preemptions"]
    assert any(o.num_recomputed_tokens > 0 for o in got)
    assert small.stats()["num_free_blocks"] == 11


def test_seeded_sampling_is_batch_invariant_under_preemption(hf_checkpoints):
    path = hf_checkpoints["llama_gqa"]
    prompts = prompts_of([30, 25, 20, 35], seed=5)
    params = [SamplingParams(temperature=0.9, top_p=0.9, seed=100 + i, max_tokens=16,
                             ignore_eos=True) for i in range(4)]
    # The same pool size alone (one request fits, nothing is preempted) shares the programs.
    alone = [LLM(path, num_kv_blocks=10, max_model_len=128, max_num_seqs=8).generate(
        prompt_token_ids=[p], sampling_params=s, use_tqdm=False)[0] for p, s in
        zip(prompts[:1], params[:1])]
    squeezed = LLM(path, num_kv_blocks=10, max_model_len=128, max_num_seqs=8)
    together = squeezed.generate(prompt_token_ids=prompts, sampling_params=params,
                                 use_tqdm=False)
    assert together[0].outputs[0].token_ids == alone[0].outputs[0].token_ids
    assert alone[0].num_preemptions == 0 < squeezed.stats()["num_preemptions"]


def test_compilations_stay_bounded_over_200_random_requests(hf_checkpoints):
    engine = engine_for(hf_checkpoints["llama_gqa"], num_kv_blocks=160, max_num_seqs=16,
                        max_num_batched_tokens=128)
    rng = np.random.default_rng(6)
    for index in range(200):
        length = int(rng.integers(1, 60))
        engine.add_request(f"r{index}", prompt_token_ids=rng.integers(2, 320, length).tolist(),
                           params=SamplingParams(temperature=0, max_tokens=int(rng.integers(1, 8)),
                                                 ignore_eos=True))
    outputs = run_to_completion(engine)
    assert len(outputs) == 200
    stats = engine.stats()
    # Buckets: decode B in {4, 8, 16}, mixed T = 128, plus free/fork sizes.
    assert stats["num_compilations"] <= 3 + 4 + 6, stats
    assert stats["num_free_blocks"] == 159


def test_stops_and_finish_reasons(hf_checkpoints):
    path = hf_checkpoints["llama_gqa"]
    prompt = prompts_of([8], seed=7)[0]
    reference = hf_greedy(path, tuple(prompt), 12)
    engine = engine_for(path)
    stop_token = reference[3]
    engine.add_request("tok", prompt_token_ids=prompt,
                       params=SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                             stop_token_ids=[stop_token]))
    engine.add_request("len", prompt_token_ids=prompt,
                       params=SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    outputs = run_to_completion(engine)
    first = reference.index(stop_token)
    assert outputs["tok"].outputs[0].token_ids == reference[:first + 1]
    assert outputs["tok"].outputs[0].finish_reason == "stop"
    assert outputs["len"].outputs[0].token_ids == reference[:5]
    assert outputs["len"].outputs[0].finish_reason == "length"


def test_stop_string_truncates_text(hf_checkpoints):
    llm = LLM(hf_checkpoints["llama_gqa"], num_kv_blocks=64, max_model_len=128, max_num_seqs=4)
    free_text = llm.generate(["The quick brown"], SamplingParams(temperature=0, max_tokens=20,
                                                                ignore_eos=True),
                             use_tqdm=False)[0].outputs[0].text
    assert len(free_text) > 4
    stop = free_text[2:4]
    out = llm.generate(["The quick brown"], SamplingParams(temperature=0, max_tokens=20,
                                                          ignore_eos=True, stop=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop"
    assert out.text == free_text[:free_text.index(stop)]


@pytest.mark.parametrize("num_scheduler_steps", [1, 4])
def test_detokenize_off_gives_the_same_tokens_with_no_text(hf_checkpoints, num_scheduler_steps):
    """detokenize=False (vLLM's): the same token ids, logprobs and finish reasons as with text
    (a stop id, max_tokens, n = 2 sampled, each output kind), every text empty; prompt logprobs
    the same without their tokens' text; a stop string with it is refused by name."""
    path = hf_checkpoints["llama_gqa"]
    prompt = prompts_of([8], seed=7)[0]
    stop_token = hf_greedy(path, tuple(prompt), 12)[3]
    runs = {}
    for detokenize in (True, False):
        for kind in RequestOutputKind:
            engine = engine_for(path, num_scheduler_steps=num_scheduler_steps)
            for request_id, extra in (("stop", dict(temperature=0, stop_token_ids=[stop_token])),
                                      ("n", dict(temperature=0.8, n=2, seed=3))):
                engine.add_request(request_id, prompt_token_ids=prompt, params=SamplingParams(
                    max_tokens=12, ignore_eos=True, logprobs=1, output_kind=kind,
                    detokenize=detokenize, **extra))
            runs[detokenize, kind] = [
                (out.request_id, out.finished, [(c.index, c.text, c.token_ids, c.logprobs,
                                                 c.finish_reason) for c in out.outputs])
                for out in run_all_steps(engine)]
    for kind in RequestOutputKind:
        with_text, without = runs[True, kind], runs[False, kind]
        assert [(rid, done, [(i, ids, lp, why) for i, _, ids, lp, why in outs])
                for rid, done, outs in with_text] == \
            [(rid, done, [(i, ids, lp, why) for i, _, ids, lp, why in outs])
             for rid, done, outs in without]
        assert all(text == "" for _, _, outs in without for _, text, *_ in outs)
        assert any(text for _, _, outs in with_text for _, text, *_ in outs)
    final = {rid: outs for rid, done, outs in runs[False, RequestOutputKind.FINAL_ONLY]}
    assert [why for *_, why in final["stop"]] == ["stop"]
    assert final["stop"][0][2][-1] == stop_token
    assert [why for *_, why in final["n"]] == ["length", "length"]
    with pytest.raises(ValueError, match="needs detokenize=True"):
        SamplingParams(stop=["x"], detokenize=False)
    llm = LLM(path, num_kv_blocks=64, max_model_len=128, max_num_seqs=4)
    scored = [llm.generate(prompt_token_ids=prompt, use_tqdm=False, sampling_params=SamplingParams(
        max_tokens=1, prompt_logprobs=1, detokenize=detokenize))[0].prompt_logprobs[1:]
        for detokenize in (True, False)]
    assert [{t: (e.logprob, e.rank) for t, e in entry.items()} for entry in scored[0]] == \
        [{t: (e.logprob, e.rank) for t, e in entry.items()} for entry in scored[1]]
    assert all(isinstance(e.decoded_token, str) for entry in scored[0] for e in entry.values())
    assert all(e.decoded_token is None for entry in scored[1] for e in entry.values())


@pytest.mark.parametrize("num_scheduler_steps", [1, 4])
def test_output_kinds_deltas_add_up_to_the_cumulative_output(hf_checkpoints,
                                                             num_scheduler_steps):
    """The same requests (greedy with a stop string; n = 2 sampled to max_tokens; logprobs) as
    CUMULATIVE, DELTA and FINAL_ONLY: the deltas concatenate to the cumulative output, and
    FINAL_ONLY gives one output per request, the finished one."""
    path = hf_checkpoints["llama_gqa"]
    free = LLM(path, num_kv_blocks=64, max_model_len=128, max_num_seqs=4).generate(
        ["The quick brown"], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
        use_tqdm=False)[0].outputs[0].text
    stop = free[5:7]
    runs = {}
    for kind in RequestOutputKind:
        engine = engine_for(path, num_scheduler_steps=num_scheduler_steps)
        for request_id, prompt, extra in (
                ("a", "The quick brown", dict(temperature=0, stop=[stop])),
                ("b", "Once upon", dict(temperature=0.8, n=2, seed=3))):
            engine.add_request(request_id, prompt=prompt, params=SamplingParams(
                max_tokens=16, ignore_eos=True, logprobs=2, output_kind=kind, **extra))
        runs[kind] = []
        while engine.has_unfinished():
            runs[kind] += engine.step()
    final = {out.request_id: out for out in runs[RequestOutputKind.CUMULATIVE] if out.finished}
    assert final["a"].outputs[0].finish_reason == "stop"
    assert final["a"].outputs[0].text == free[:free.index(stop)]
    assert [c.finish_reason for c in final["b"].outputs] == ["length", "length"]
    only = runs[RequestOutputKind.FINAL_ONLY]
    assert sorted(out.request_id for out in only) == ["a", "b"]
    assert all(out.finished for out in only)
    for out in only:
        assert out.outputs == final[out.request_id].outputs
    deltas = runs[RequestOutputKind.DELTA]
    assert len(deltas) > 2
    for request_id, want in final.items():
        mine = [out for out in deltas if out.request_id == request_id]
        assert mine[-1].finished and not any(out.finished for out in mine[:-1])
        for index, completion in enumerate(want.outputs):
            parts = [c for out in mine for c in out.outputs if c.index == index]
            assert "".join(c.text for c in parts) == completion.text
            assert [t for c in parts for t in c.token_ids] == completion.token_ids
            assert [p for c in parts for p in c.logprobs] == completion.logprobs
            assert len(completion.token_ids) > 1


def test_output_kind_is_validated():
    assert SamplingParams(output_kind="delta").output_kind == RequestOutputKind.DELTA
    assert SamplingParams(output_kind=2).output_kind == RequestOutputKind.FINAL_ONLY
    for bad in ("sometimes", 7, True, None):
        with pytest.raises(ValueError, match="output_kind"):
            SamplingParams(output_kind=bad)


def test_abort_frees_blocks_and_others_carry_on(hf_checkpoints):
    path = hf_checkpoints["llama_gqa"]
    engine = engine_for(path)
    total = engine.num_free_blocks
    prompts = prompts_of([20, 10], seed=8)
    engine.add_request("keep", prompt_token_ids=prompts[0], params=GREEDY)
    engine.add_request("drop", prompt_token_ids=prompts[1], params=GREEDY)
    engine.step()
    engine.step()
    assert engine.abort("drop")
    assert not engine.abort("drop")
    outputs = run_to_completion(engine)
    assert list(outputs) == ["keep"]
    assert outputs["keep"].outputs[0].token_ids == hf_greedy(path, tuple(prompts[0]), 12)
    assert engine.num_free_blocks == total
    assert int(engine.executor.manager.num_free) == engine.ledger.mirror.num_free


def test_bad_input_is_rejected_before_anything_runs(hf_checkpoints):
    llm = LLM(hf_checkpoints["llama_gqa"], num_kv_blocks=16, max_model_len=128, max_num_seqs=4)
    engine = llm.engine
    engine.add_request("inflight", prompt_token_ids=[5, 6, 7], params=GREEDY)
    engine.step()
    cases = [
        (dict(prompt_token_ids=[]), "empty"),
        (dict(prompt_token_ids=list(range(2, 200))), "max_model_len"),
        (dict(prompt_token_ids=[5] * 100, params=SamplingParams(max_tokens=20, n=2)), "blocks"),
        (dict(prompt_token_ids=[5, 999]), "outside"),
        (dict(prompt_token_ids=[5], params=SamplingParams(n=5)), "max_num_seqs"),
        (dict(prompt_token_ids=[5], params=SamplingParams(stop_token_ids=[7, 320])),
         "stop_token_ids"),  # the tiny checkpoints' vocabulary is 320
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            engine.add_request("bad", **kwargs)
    for kwargs, name in [(dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p"),
                         (dict(n=0), "n"), (dict(max_tokens=0), "max_tokens"),
                         (dict(top_k=0), "top_k")]:
        with pytest.raises(ValueError, match=name):
            SamplingParams(**kwargs)
    with pytest.raises(ValueError, match="prompt 1"):
        llm.generate(prompt_token_ids=[[5, 6], []], sampling_params=GREEDY, use_tqdm=False)
    outputs = run_to_completion(engine)
    assert list(outputs) == ["inflight"]  # nothing bad was queued, the in-flight request is whole
    assert len(outputs["inflight"].outputs[0].token_ids) == 12


def test_logprobs_are_reported(hf_checkpoints):
    llm = LLM(hf_checkpoints["llama_gqa"], num_kv_blocks=32, max_model_len=128, max_num_seqs=4)
    out = llm.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=SamplingParams(
        temperature=0, max_tokens=4, ignore_eos=True, logprobs=3), use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == 4
    for token, entry in zip(out.token_ids, out.logprobs):
        assert token in entry and 3 <= len(entry) <= 4
        assert entry[token] == max(entry.values())  # greedy picks the most likely token
    assert out.cumulative_logprob == pytest.approx(sum(e[t] for t, e in
                                                       zip(out.token_ids, out.logprobs)))


@pytest.mark.parametrize("backend", ["pallas_gpu", "pallas_tpu"])
def test_engine_runs_each_kernel_backend(hf_checkpoints, backend):
    """The whole engine with a Pallas kernel (interpret mode on the CPU) gives the reference's
    greedy tokens, through chunked prefill, mixed steps and decode steps."""
    path = hf_checkpoints["llama_gqa"]
    prompts = prompts_of([21, 5], seed=9)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    options = dict(num_kv_blocks=16, max_model_len=64, max_num_seqs=4,
                   max_num_batched_tokens=16, attention_backend=backend)
    platform = jax.default_backend()
    if platform != "cpu" and not backend.endswith(platform):   # e.g. the TPU kernel on a GPU
        with pytest.raises(ValueError, match=f"{backend}.*not for this {platform}"):
            LLM(path, **options)
        return
    llm = LLM(path, **options)
    assert llm.stats()["attention_backend"] == backend
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        assert output.outputs[0].token_ids == hf_greedy(path, tuple(prompt), 12)[:4]


def test_abort_returns_reserved_sample_slots(hf_checkpoints):
    """An n > 1 request aborted before its samples fork gives back every sequence slot."""
    eng = engine_for(hf_checkpoints["llama_gqa"], max_num_seqs=4, max_num_batched_tokens=16)
    eng.add_request("n3", prompt_token_ids=prompts_of([40])[0],
                    params=SamplingParams(n=3, max_tokens=4))
    eng.step()  # first 16-token chunk of the prompt: 3 slots taken, 2 of them reserved
    assert eng.ledger.num_free_slots == 1
    assert eng.abort("n3")
    assert eng.ledger.num_free_slots == 4
    assert eng.num_free_blocks == eng.config.num_kv_blocks - 1


@pytest.mark.parametrize("platform,name,expected", [
    ("gpu", "auto", ("pallas_gpu", False)), ("gpu", "pallas_gpu", ("pallas_gpu", False)),
    ("gpu", "reference", ("reference", False)), ("tpu", "auto", ("pallas_tpu", False)),
    ("cpu", "pallas_tpu", ("pallas_tpu", True)), ("cpu", "auto", ("reference", False)),
    ("gpu", "pallas_tpu", "'pallas_tpu' compiles for tpu"),
    ("tpu", "pallas_gpu", "'pallas_gpu' compiles for gpu or cuda or rocm")])
def test_attention_backend_resolves_per_platform(monkeypatch, platform, name, expected):
    """A Pallas kernel for another accelerator is refused by name before anything compiles;
    on the CPU both Pallas backends run interpreted."""
    from jpaged.engine import builder
    monkeypatch.setattr(builder.jax, "default_backend", lambda: platform)
    if isinstance(expected, str):
        with pytest.raises(ValueError, match=expected):
            builder.resolve_attention_backend(name)
    else:
        assert builder.resolve_attention_backend(name) == expected


def _collaborator_calls(engine, calls_per_step: int = 1) -> list[list[str]]:
    """For each of `calls_per_step` steps, the methods of other jpaged modules that
    `LLMEngine.step` and its own helpers call directly, as "Class.method" in call order
    (property reads excluded)."""
    import sys

    from jpaged.engine import llm_engine

    engine_file = llm_engine.__file__
    steps = []

    def profile(frame, event, _arg):
        if event != "call" or frame.f_back is None or frame.f_code.co_filename == engine_file:
            return
        if frame.f_back.f_code.co_filename != engine_file:
            return
        owner = frame.f_locals.get("self")
        name = frame.f_code.co_name
        if owner is None or "jpaged" not in type(owner).__module__:
            return
        if isinstance(getattr(type(owner), name, None), property):
            return
        steps[-1].append(f"{type(owner).__name__}.{name}")

    for _ in range(calls_per_step):
        steps.append([])
        sys.setprofile(profile)
        try:
            engine.step()
        finally:
            sys.setprofile(None)
    return steps


def test_a_step_enters_each_part_once_per_phase(hf_checkpoints):
    """The common path of a step: schedule, run (block operations applied first, inside),
    process outputs, update the scheduler; the engine itself never touches the ledger."""
    engine = engine_for(hf_checkpoints["llama_gqa"], async_scheduling=False)
    for index, prompt in enumerate(prompts_of([5, 9, 3])):
        engine.add_request(f"r{index}", prompt_token_ids=prompt, params=GREEDY)
    prefill, decode = _collaborator_calls(engine, 2)
    expected = ["Scheduler.schedule", "Executor.run_rows", "OutputProcessor.process",
                "Scheduler.update"]
    assert prefill == expected
    assert decode == ["Scheduler.schedule", "DecodePipeline.launch", "DecodePipeline.advance",
                      "OutputProcessor.process", "Scheduler.update"]
    run_to_completion(engine)


def test_auto_never_picks_a_kernel_that_cannot_run_the_model(monkeypatch, caplog):
    """On a GPU, "auto" passes over the Pallas GPU kernels for a model they cannot run (here a
    block size that is not a power of two) and says which backend it took and why, once; asked
    for by name, that backend is refused with the reason."""
    import logging

    from jpaged.config import ModelConfig
    from jpaged.engine import builder

    monkeypatch.setattr(builder.jax, "default_backend", lambda: "gpu")
    config = ModelConfig.preset("tiny")
    options = dict(dtype="float32", kv_dtype="float32")
    assert builder.choose_attention_backend("auto", config, block_size=16, **options) == (
        "pallas_gpu", False)
    with caplog.at_level(logging.WARNING, logger=builder.__name__):
        for _ in range(2):
            assert builder.choose_attention_backend("auto", config, block_size=24,
                                                    **options) == ("reference", False)
    warnings = [r.getMessage() for r in caplog.records if "cannot run this model" in r.getMessage()]
    assert len(warnings) == 1 and "'pallas_gpu'" in warnings[0] and "block_size" in warnings[0]
    with pytest.raises(ValueError, match="'pallas_gpu' cannot run this model.*block_size"):
        builder.choose_attention_backend("pallas_gpu", config, block_size=24, **options)


def test_auto_tries_its_gpu_candidates_in_order(monkeypatch):
    """With the Hopper prefill kernel listed first, "auto" takes it only where it can run: a
    head size it takes, this jax, a Hopper device; otherwise the next candidate, the Triton
    kernels. Asked for by name off Hopper, it is refused with the reason."""
    import dataclasses
    import types

    import pallas_kernels
    from jpaged.config import ModelConfig
    from jpaged.engine import builder

    monkeypatch.setattr(builder.jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(builder, "AUTO_GPU_BACKENDS", ("pallas_mosaic_gpu", "pallas_gpu"))
    tiny = ModelConfig.preset("tiny")  # head_dim 16: not for the Mosaic GPU kernel
    wide = dataclasses.replace(tiny, head_dim=128)
    options = dict(dtype="bfloat16", kv_dtype="bfloat16", block_size=16)
    can_build = pallas_kernels.unsupported_reason(
        "pallas_mosaic_gpu", head_dim=128, dtype="bfloat16", block_size=16) is None
    for capability, config, expected in [
            ("9.0", wide, "pallas_mosaic_gpu" if can_build else "pallas_gpu"),
            ("9.0", tiny, "pallas_gpu"), ("8.0", wide, "pallas_gpu")]:
        device = types.SimpleNamespace(compute_capability=capability)
        monkeypatch.setattr(builder.jax, "devices", lambda device=device: [device])
        assert builder.choose_attention_backend("auto", config, **options) == (expected, False)
    with pytest.raises(ValueError, match="'pallas_mosaic_gpu' cannot run this model.*Hopper"
                       if can_build else "'pallas_mosaic_gpu' cannot run this model"):
        builder.choose_attention_backend("pallas_mosaic_gpu", wide, **options)

"""The arithmetic benchmarks/e2e.py and benchmarks/roofline.py report: the static cache's KV
utilisation and the decode floor's bytes, by hand; the table marks capped and failed runs."""

import dataclasses
import json
from pathlib import Path

import pytest

from benchmarks import e2e, hf_backends, roofline
from benchmarks.trace import TraceRequest
from jpaged.config import ModelConfig
from jpaged.models import load_model
from tests.hf_fixtures import MOE_CHECKPOINTS


def test_static_kv_utilisation_by_hand():
    """Prompts 2 and 4 (padded to 4), outputs 1 and 3: a cache of 2 x (4 + 3) slots for 3 steps;
    held: step 0: 2 + 4, step 1: 2 + 5, step 2: 2 + 6 -> 21 of 42."""
    batch = [TraceRequest(0.0, 2, 1), TraceRequest(0.0, 4, 3)]
    assert hf_backends.static_kv_utilisation(batch) == 21 / 42


def test_floor_bytes_count_every_weight_but_the_embedding_table():
    config = ModelConfig.preset("tiny")                       # untied, E = 64, V = 256
    weights, kv = roofline.floor_bytes(config, batch=3, context_tokens=10, dtype="bfloat16")
    assert weights == (config.num_parameters() - 256 * 64 + 3 * 64) * 2
    assert kv == 10 * 2 * config.num_hidden_layers * config.num_key_value_heads \
        * config.head_dim * 2
    tied = dataclasses.replace(config, tie_word_embeddings=True)
    assert roofline.floor_bytes(tied, batch=3, context_tokens=0, dtype="float32")[0] == \
        (tied.num_parameters() + 3 * 64) * 4


def test_results_table_marks_capped_and_failed_runs():
    results = {
        "paged": dict(wall=2.0, requests=4, output_tokens=100, decoded_tokens=100,
                      max_concurrent=4, kv_utilisation=0.97, capped=False, note="K=1"),
        "static": dict(wall=4.0, requests=2, output_tokens=50, decoded_tokens=200,
                       max_concurrent=2, kv_utilisation=None, capped=True, note="1 batch"),
        "broken": {"error": "RuntimeError: no"},
    }
    lines = e2e.results_table(results).splitlines()
    assert lines[2] == "| paged | 2.00 | 50 | 4 | 97.0% | 4 | 2.0 | K=1 |"
    assert lines[3] == ("| static | 0.50 | 12 | 2 | n/m | 2 | 4.0 | CAPPED: 1 batch; 75% of "
                        "decoded thrown away |")
    assert lines[4].startswith("| broken | - |") and "RuntimeError: no" in lines[4]


def test_step_flops_by_hand():
    """tiny: 2 layers, H = 4, D = 16; 2 FLOPs per non-embedding weight per sequence, 4 per head
    x dim per context token per layer."""
    config = ModelConfig.preset("tiny")
    linear = config.num_parameters() - 256 * 64
    assert roofline.step_flops(config, batch=3, context_tokens=10) == \
        2 * linear * 3 + 4 * 10 * 4 * 16 * 2


def test_roofline_table_adds_the_compute_column_only_when_measured():
    row = dict(batch=2, bucket=4, context=8, seconds=0.004, dispatch_seconds=0.001,
               weight_bytes=2e9, kv_bytes=1e9, floor=0.002)
    plain = roofline.table([row], {"best": 1.5e12}).splitlines()
    assert plain[-1] == "| 2 (4) | 8 | 4.00 | 1.00 | 2.00 | 1.00 | 2.00 | 2.00 | 500 |"
    with_compute = roofline.table([dict(row, compute_floor=0.0005)], {"best": 1.5e12})
    # bound: max(2 GB / 1.5 TB/s, 0.5 ms) + 1 GB / 1.5 TB/s = 2.00 ms
    assert with_compute.splitlines()[-1].endswith("| 2.00 | 0.50 | 2.00 | 2.00 | 500 |")
    compute_bound = roofline.table([dict(row, compute_floor=0.003)], {"best": 1.5e12})
    assert compute_bound.splitlines()[-1].endswith("| 2.00 | 3.00 | 3.67 | 1.09 | 500 |")
    moe = roofline.table([dict(row, floor_fewest=0.0012)], {"best": 1.5e12}).splitlines()
    assert "the same k experts" in moe[-3]
    assert moe[-1] == "| 2 (4) | 8 | 4.00 | 1.00 | 2.00 | 1.00 | 2.00 | 2.00 | 1.20 | 500 |"


def test_time_decode_step_runs_on_an_engine_and_leaves_it_idle():
    """The roofline's timing drives the engine's own decode loop on made-up context: on the
    tiny preset it returns a step time (a difference of two runs: its sign is noise on a CPU) and gives every block back."""
    from jpaged import LLMEngine

    engine = LLMEngine.from_pretrained(None, num_kv_blocks=64, max_num_seqs=4,
                                       max_model_len=128, dtype="float32")
    free = engine.num_free_blocks
    row = roofline.time_decode_step(engine, 4, max_context=40, steps=2)
    assert row["batch"] == 4 and row["context"] == 40 and row["seconds"] == row["seconds"]
    assert engine.num_free_blocks == free and engine.ledger.num_free_slots == 4


def test_step_breakdown_sorts_time_by_kind_and_tail():
    """Prompt steps, single decode steps and K-iteration loops (more tokens than sequences)
    apart, the tail (<= tail_seqs sequences) apart from the rest; sums by hand."""
    from jpaged.engine.llm_engine import StepRecord

    records = [StepRecord(False, 40, 2048, 2048, 40, 0.5, 0.1, True),     # prompt, full
               StepRecord(True, 40, 40, 9000, 40, 0.02, 0.01, False),     # decode, full
               StepRecord(True, 40, 40, 9000, 320, 0.10, 0.02, False),    # loop of 8, full
               StepRecord(True, 4, 4, 900, 32, 0.05, 0.03, False),        # loop, tail
               StepRecord(True, 3, 3, 700, 24, 0.05, 0.01, False)]        # loop, tail
    rows = e2e.step_breakdown(records, tail_seqs=16)
    assert [(r["kind"], r["phase"], r["steps"]) for r in rows] == [
        ("prompt", "full", 1), ("decode", "full", 1), ("decode loop", "full", 1),
        ("decode loop", "tail", 2)]
    tail = rows[-1]
    assert (tail["generated"], tail["seqs"], tail["compiled"]) == (56, 7, 0)
    assert abs(tail["host_seconds"] - 0.04) < 1e-12 and abs(tail["device_seconds"] - 0.10) < 1e-12
    table = e2e.breakdown_table({"jpaged K=8": dict(steps=rows), "hf": {"error": "x"}}, 16)
    last = table.splitlines()[-1]
    # 0.14 s of 0.89 s in all; 56 tokens / 0.14 s = 400 tokens/s; 3.5 sequences a step
    assert last == ("| jpaged K=8 | decode loop | tail | 2 | 0.14 | 15.7% | 0.04 | 0.10 | 56 | "
                    "400 | 3.5 | 0 |")


def test_a_timed_second_pass_compiles_nothing_and_counts_its_own_tokens():
    """--passes 2: the second pass of the trace runs on the programs the first compiled, so it
    compiles nothing; tokens, preemptions and the note are the second pass's own."""
    import argparse

    import jax.numpy as jnp
    from flax import nnx

    from jpaged.models.llama import LlamaForCausalLM

    config = ModelConfig.preset("tiny")
    model = LlamaForCausalLM(config, dtype=jnp.float32, rngs=nnx.Rngs(0))
    trace = [TraceRequest(0.0, 20, 5), TraceRequest(0.0, 33, 9), TraceRequest(0.0, 7, 17)]
    prompts = e2e.trace_prompts(trace, config.vocab_size)
    args = argparse.Namespace(budget_seqs=2, max_model_len=64, max_num_seqs=8,
                              max_num_batched_tokens=64, tail_seqs=2, passes=2)
    result, engine = e2e.run_jpaged(model, trace, prompts, args, block_size=16, num_steps=4,
                                    keep_engine=True)
    assert result["compile_seconds"] == 0 and result["wall"] == result["wall_with_compile"]
    assert result["output_tokens"] == 31 and engine.num_generated_tokens == 62
    assert "second pass (the first: " in result["note"] and result["note"].endswith(
        "; nothing compiled")
    assert sum(row["generated"] for row in result["steps"]) == 31
    # one pass: a new engine of this process shares the programs, so it compiles nothing either
    single, _ = e2e.run_jpaged(model, trace, prompts, argparse.Namespace(**{**vars(args),
                                                                           "passes": 1}),
                               block_size=16, num_steps=4)
    assert single["output_tokens"] == 31 and single["note"].endswith(
        "; one pass; compile 0 s subtracted")


def test_moe_floor_reads_the_chosen_experts_and_flops_count_the_active_ones():
    """Qwen3-30B-A3B: 48 sparse layers of 128 experts, 8 chosen, expert 3 x 2048 x 768."""
    config = ModelConfig.preset("qwen3-30b-a3b")
    expert = 3 * 2048 * 768
    embedding = config.vocab_size * config.hidden_size           # untied
    fewest = roofline.floor_bytes(config, batch=4, context_tokens=0, dtype="bfloat16",
                                  experts="fewest")[0]
    assert fewest == (config.num_parameters(active=True) - embedding + 4 * 2048) * 2
    most = roofline.floor_bytes(config, batch=4, context_tokens=0, dtype="bfloat16")[0]
    assert most - fewest == 48 * (32 - 8) * expert * 2          # 4 tokens x 8 experts
    every = roofline.floor_bytes(config, batch=64, context_tokens=0, dtype="bfloat16")[0]
    assert every == (config.num_parameters() - embedding + 64 * 2048) * 2
    assert roofline.step_flops(config, batch=2, context_tokens=0) == \
        2 * 2 * (config.num_parameters(active=True) - embedding)
    dense = ModelConfig.preset("tiny")
    assert roofline.floor_bytes(dense, batch=3, context_tokens=0, dtype="float32",
                                experts="fewest") == roofline.floor_bytes(
        dense, batch=3, context_tokens=0, dtype="float32")


def test_sync_and_async_runs_side_by_side_with_their_step_breakdowns(tmp_path):
    """--scheduling sync,async: both runs of each K in one table, each with its breakdown, whose
    host seconds are never negative (an async run's once were: its loops' device time counted
    from their dispatch in an earlier step)."""
    e2e.main(["--model", "tiny", "--dtype", "float32", "--parts", "jpaged", "--ks", "4",
              "--scheduling", "sync,async", "--num-requests", "12", "--trace", "alpaca",
              "--max-model-len", "256", "--budget-seqs", "4", "--max-num-batched-tokens", "256",
              "--passes", "1", "--out-dir", str(tmp_path)])
    text = (tmp_path / "e2e.md").read_text()
    breakdown = text.split("### Where jpaged's time went, by step")[1]
    for name in ("jpaged K=4", "jpaged K=4 async"):
        rows = [line.split(" | ") for line in breakdown.splitlines()
                if line.startswith(f"| {name} | ")]
        assert any(row[1] == "decode loop" for row in rows), name
        assert all(float(row[6]) >= 0 and float(row[7]) >= 0 for row in rows), rows


@pytest.mark.parametrize("name", MOE_CHECKPOINTS)
def test_transformers_model_holds_a_mixture_of_experts_weights(hf_checkpoints, name):
    """build_hf_model stacks each expert's checkpoint tensors into transformers' fused expert
    parameters: the model it builds from jpaged's weights equals the checkpoint's own load."""
    import torch
    import transformers

    path = Path(hf_checkpoints[name])
    model, _ = load_model(path, dtype="float32")
    config = json.loads((path / "config.json").read_text())
    preset = path.parent / f"{name}_preset.json"
    preset.write_text(json.dumps({k: v for k, v in config.items()
                                  if k not in ("architectures", "transformers_version")}))
    built = hf_backends.build_hf_model(preset, model, device="cpu", dtype_name="float32")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    expected = dict(loaded.named_parameters())
    fused = [n for n in expected if n.endswith("experts.gate_up_proj")]
    assert fused, "transformers fuses the experts"
    for param_name, param in built.named_parameters():
        assert torch.equal(param, expected[param_name]), param_name

"""KV calculator: llama3-70b worked by hand (4096 tokens, 128 users sharing a 1000-token prefix),
every shipped config, bad input."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from jpaged.config import PRESETS_DIR, ModelConfig
from jpaged.kv_cache import kv_footprint

ROOT = Path(__file__).resolve().parent.parent


def test_llama3_70b_numbers():
    numbers = kv_footprint(ModelConfig.preset("llama3-70b"), tokens=4096, block_size=16,
                           dtype="bf16", users=128, shared_prefix=1000)
    assert numbers["bytes_per_token"] == 327_680
    assert numbers["bytes_per_block"] == 5_242_880
    assert numbers["blocks_per_sequence"] == 256
    assert round(numbers["prefix_bytes_unshared"] / 1e9, 1) == 41.9
    assert round(numbers["prefix_bytes_shared"] / 1e9, 2) == 0.33
    assert round(numbers["prefix_bytes_shared_paged"] / 1e9, 2) == 0.33


def test_cli_json_keys():
    out = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "kv_calc.py"), "--model", "llama3-70b",
         "--tokens", "4096", "--block-size", "16", "--dtype", "bf16", "--users", "128",
         "--shared-prefix", "1000", "--json"], capture_output=True, text=True, check=True)
    numbers = json.loads(out.stdout)
    assert {"bytes_per_token", "bytes_per_block", "blocks_per_sequence",
            "prefix_bytes_unshared", "prefix_bytes_shared"} <= set(numbers)
    assert numbers["bytes_per_block"] == 5_242_880


@pytest.mark.parametrize("name,per_token_bf16", [
    ("llama2-7b", 2 * 32 * 32 * 128 * 2), ("llama3-8b", 2 * 32 * 8 * 128 * 2),
    ("mistral-7b", 2 * 32 * 8 * 128 * 2), ("qwen2.5-7b", 2 * 28 * 4 * 128 * 2),
    ("tiny", 2 * 2 * 2 * 16 * 2), ("qwen3-8b", 2 * 36 * 8 * 128 * 2),
    ("phi-3-mini-4k", 2 * 32 * 32 * 96 * 2), ("gemma-2-9b", 2 * 42 * 8 * 256 * 2),
    ("gemma-3-12b", 2 * 48 * 8 * 256 * 2), ("qwen3-30b-a3b", 2 * 48 * 4 * 128 * 2),
    ("mixtral-8x7b", 2 * 32 * 8 * 128 * 2)])
def test_shipped_configs(name, per_token_bf16):
    assert ModelConfig.preset(name).kv_bytes_per_token("bfloat16") == per_token_bf16


def _kv_calc_main(argv, capsys) -> str:
    spec = importlib.util.spec_from_file_location("kv_calc", ROOT / "tools" / "kv_calc.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(argv) == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("name, sliding_layers, window", [
    ("gemma-3-12b", 40, 1024), ("gemma-2-9b", 21, 4096), ("phi-3-mini-4k", 32, 2047),
    ("qwen3-8b", 0, None), ("mistral-7b", 0, None)])
def test_sliding_layers_reported(name, sliding_layers, window, capsys):
    numbers = json.loads(_kv_calc_main(["--model", name, "--json"], capsys))
    assert (numbers["sliding_layers"], numbers["sliding_window"]) == (sliding_layers, window)
    assert numbers["bytes_per_token"] == ModelConfig.preset(name).kv_bytes_per_token("bf16")
    text = _kv_calc_main(["--model", name], capsys)
    assert (f"{sliding_layers} layers slide a {window}-token window" in text) == bool(window)


@pytest.mark.parametrize("name, experts, total_gb, active_gb", [
    ("qwen3-30b-a3b", 128, 61.06, 6.71), ("mixtral-8x7b", 8, 93.41, 25.76),
    ("llama3-8b", 0, 16.06, 16.06)])
def test_weights_counted_with_their_experts(name, experts, total_gb, active_gb, capsys):
    """bf16 weights: every expert held, a token's routed experts read (tests/test_moe.py works
    the parameter counts); a dense model reads all of its weights."""
    numbers = json.loads(_kv_calc_main(["--model", name, "--json"], capsys))
    assert numbers["num_experts"] == experts and numbers["weight_dtype"] == "bfloat16"
    assert round(numbers["weight_bytes"] / 1e9, 2) == total_gb
    assert round(numbers["active_weight_bytes"] / 1e9, 2) == active_gb
    text = _kv_calc_main(["--model", name], capsys)
    assert f"weights (bfloat16) {total_gb:.2f} GB, {active_gb:.2f} GB read per token" in text
    assert ("routed experts only" in text) == bool(experts)


def test_every_shipped_config_loads():
    assert len(list(PRESETS_DIR.glob("*.json"))) >= 6
    for path in PRESETS_DIR.glob("*.json"):
        ModelConfig.from_json(path)


def test_cli_bad_input_names_the_problem():
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "kv_calc.py"), "--model",
                          "llama3-8b", "--block-size", "0"], capture_output=True, text=True)
    assert out.returncode == 2 and "block_size" in out.stderr
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "kv_calc.py"), "--dtype", "int3"],
                         capture_output=True, text=True)
    assert out.returncode == 2 and "dtype" in out.stderr


def test_activation_reserve_covers_a_step_of_scored_positions():
    """A step scoring prompt positions (prompt logprobs, `score`) has a row of logits per
    position, at most SCORED_POSITIONS_PER_STEP (the scheduler's cap): the reserve counts
    max(sequences, scored rows) rows of float32 logits x 4, and no more at larger budgets."""
    from jpaged.engine.builder import ACTIVATION_SLACK_BYTES, activation_reserve_bytes
    from jpaged.logprobs import SCORED_POSITIONS_PER_STEP as CAP

    config = ModelConfig.preset("llama3-8b")
    per_token = 4 * (4 * 4096 + 2 * 6144 + 3 * 14336)

    def logit_rows(tokens, seqs):
        logits = activation_reserve_bytes(config, tokens, seqs) - tokens * per_token \
            - ACTIVATION_SLACK_BYTES
        assert logits % (16 * config.vocab_size) == 0
        return logits // (16 * config.vocab_size)

    assert logit_rows(2048, 64) == CAP and logit_rows(32768, 64) == CAP   # the cap decides
    assert logit_rows(256, 64) == 256                                     # a small budget
    assert logit_rows(2048, 4 * CAP) == 4 * CAP                           # sequences decide


def test_activation_reserve_holds_each_tokens_routed_rows():
    """Qwen3-30B-A3B: a token's 8 routed rows (gathered input, gate/up, hidden, output:
    8 x (2 x 2048 + 3 x 768)) plus its 128 router logits outweigh the dense MLP's 3 x 6144."""
    from jpaged.engine.builder import activation_reserve_bytes

    config = ModelConfig.preset("qwen3-30b-a3b")
    per_token = 4 * (4 * 2048 + 2 * (32 + 2 * 4) * 128 + 128 + 8 * (2 * 2048 + 3 * 768))
    assert (activation_reserve_bytes(config, 4096, 8) - activation_reserve_bytes(config, 2048, 8)
            == 2048 * per_token)

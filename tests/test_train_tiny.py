"""tools/train_tiny.py: the corpus, the byte tokenizer, that training lowers the loss, and that the
saved orbax directory loads into the engine with the same numbers as the training forward."""

import json
import shutil
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))

import train_tiny  # noqa: E402

from jpaged import SamplingParams  # noqa: E402
from jpaged.engine.llm_engine import LLMEngine  # noqa: E402
from jpaged.models import load_model  # noqa: E402

TINY = train_tiny.TrainConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=2, intermediate_size=64,
                              max_position_embeddings=128, context=64, batch_size=8, steps=40,
                              learning_rate=1e-2, warmup_steps=5, eval_every=20,
                              max_corpus_bytes=300_000)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(directory, history) of a tiny model trained for TINY.steps steps and saved."""
    model, history = train_tiny.train(TINY, log=lambda line: None)
    out = tmp_path_factory.mktemp("tiny_model")
    train_tiny.save(model, TINY, history, out)
    return out, history


def test_corpus_is_stdlib_source_with_eos_between_files():
    sources = train_tiny.stdlib_sources()
    assert len(sources) > 100 and all(p.suffix == ".py" for p in sources)
    assert not any("site-packages" in p.parts or "test" in p.parts for p in sources)
    corpus = train_tiny.load_corpus(max_bytes=50_000)
    assert corpus.size == 50_000 and corpus.max() <= train_tiny.EOS_ID
    first = sources[0].read_bytes()
    assert bytes(corpus[:len(first)].astype(np.uint8)) == first[:50_000]
    windows = train_tiny.sample_windows(corpus, np.random.default_rng(0), 3, 16)
    assert windows.shape == (3, 17) and windows.dtype == np.int32


def test_tokenizer_ids_are_utf8_bytes():
    tokenizer = train_tiny.build_tokenizer()
    text = "def f(x):\n\treturn 'é€'  # ok"
    ids = tokenizer.encode(text).ids
    assert ids == list(text.encode("utf-8"))
    assert tokenizer.decode(ids) == text
    assert tokenizer.encode("a<|endoftext|>").ids == [ord("a"), train_tiny.EOS_ID]
    assert tokenizer.get_vocab_size() == train_tiny.VOCAB_SIZE


def test_loss_decreases(trained):
    _, history = trained
    losses = history["loss"]
    assert len(losses) == TINY.steps
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 0.5, losses
    assert history["val_loss"][-1] < history["val_loss"][0]


def test_saved_directory_has_hf_config_tokenizer_and_orbax_checkpoint(trained):
    out, _ = trained
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["vocab_size"] == train_tiny.VOCAB_SIZE
    assert (out / "tokenizer.json").is_file()
    assert (out / train_tiny.CHECKPOINT_DIR / "_METADATA").is_file()
    log = json.loads((out / "train_log.json").read_text())
    assert len(log["loss"]) == TINY.steps


def test_loaded_model_matches_the_trained_weights(trained):
    out, _ = trained
    model, config = load_model(out)
    assert config.eos_token_ids == (train_tiny.EOS_ID,)
    saved = train_tiny.hf_named_params(model)
    # Load again through a fresh restore and compare every tensor with the first.
    again = train_tiny.hf_named_params(load_model(out)[0])
    assert saved.keys() == again.keys()
    for name in saved:
        np.testing.assert_array_equal(saved[name], again[name])


def test_engine_logprobs_equal_the_dense_training_forward(trained):
    """The saved model through the paged engine and the training forward are the same function:
    the first sampled token's top-5 logprobs match (a prompt spanning three KV blocks)."""
    out, _ = trained
    model, _ = load_model(out)
    engine = LLMEngine.from_model(model, None, max_num_seqs=4, max_num_batched_tokens=128,
                                  max_model_len=128, num_kv_blocks=32, block_size=8)
    prompt = list(b"def main(argv=None):\n  ")  # 23 tokens
    engine.add_request("r", prompt_token_ids=prompt,
                       params=SamplingParams(temperature=0, max_tokens=1, logprobs=5))
    [output] = engine.step()
    completion = output.outputs[0]
    logits = train_tiny.dense_logits(model, jnp.asarray([prompt], jnp.int32))[0, -1]
    logprobs = np.asarray(jax.nn.log_softmax(logits))                          # [V]
    top = np.argsort(-logprobs)[:5]
    assert completion.token_ids == [int(top[0])]
    entry = completion.logprobs[0]
    assert list(entry)[:5] == top.tolist()
    np.testing.assert_allclose([entry[int(t)] for t in top], logprobs[top], atol=1e-4)


def test_orbax_errors_name_the_tensor(trained, tmp_path):
    out, _ = trained
    broken = shutil.copytree(out, tmp_path / "broken")
    config = json.loads((broken / "config.json").read_text())
    config["intermediate_size"] = 48
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.down_proj.weight.*\(32, 64\)"):
        load_model(broken)
    config["intermediate_size"] = 64
    config["num_hidden_layers"] = 3
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="missing .*model.layers.2"):
        load_model(broken)
    shutil.rmtree(broken / train_tiny.CHECKPOINT_DIR)
    (broken / train_tiny.CHECKPOINT_DIR).mkdir()
    with pytest.raises(ValueError, match="checkpoint"):
        load_model(broken)


def test_command_line_flags_map_to_the_config(tmp_path):
    config, args = train_tiny.parse_args(["--out", str(tmp_path), "--steps", "7",
                                          "--learning-rate", "0.5", "--hidden-size", "16"])
    assert (config.steps, config.learning_rate, config.hidden_size) == (7, 0.5, 16)
    assert args.out == tmp_path

"""`--load-format dummy`: random weights of a config's shapes, loaded and served without weight files."""

import json
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fastapi.testclient import TestClient

from jpaged import serve
from jpaged.serve.async_engine import AsyncEngine
from jpaged.config import PRESETS_DIR
from jpaged.engine.llm_engine import LLMEngine
from jpaged.models import checkpoint_tensors, load_model

SERVER_FLAGS = ["--load-format", "dummy", "--max-num-seqs", "4", "--max-model-len", "256",
                "--max-num-batched-tokens", "128", "--block-size", "16"]


@pytest.fixture
def config_only_dir(tmp_path):
    """A directory holding only configs/models/tiny.json as config.json."""
    shutil.copy(PRESETS_DIR / "tiny.json", tmp_path / "config.json")
    return tmp_path


def _params(model) -> dict[str, jax.Array]:
    return checkpoint_tensors(model)


def test_dummy_needs_only_config_and_is_random_fixed_and_in_dtype(config_only_dir):
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_model(config_only_dir)  # "auto" wants weights
    model, config = load_model(config_only_dir, dtype="bfloat16", load_format="dummy")
    params = _params(model)
    assert {p.dtype for p in params.values()} == {jnp.dtype(jnp.bfloat16)}
    assert sum(p.size for p in params.values()) == config.num_parameters()
    embed = params["model.embed_tokens.weight"]
    assert embed.shape == (config.vocab_size, config.hidden_size)
    assert 0.01 < float(jnp.std(embed.astype(jnp.float32))) < 0.04  # drawn, std 0.02
    again = _params(load_model(config_only_dir, dtype="bfloat16", load_format="dummy")[0])
    for name, value in params.items():  # fixed seed: the same weights every load
        np.testing.assert_array_equal(np.asarray(again[name]), np.asarray(value), err_msg=name)
    assert load_model(config_only_dir, load_format="dummy")[0].dtype == jnp.float32  # config's


def test_dummy_programs_do_not_grow_with_the_number_of_layers(tmp_path):
    """One draw program per shape and layout, shared by every layer: a deep model (an 8B has
    32 layers, 291 tensors) compiles as few as a shallow one."""
    from jpaged.models import loader

    raw = json.loads((PRESETS_DIR / "tiny.json").read_text())
    counts = []
    for layers in (2, 6):
        directory = tmp_path / str(layers)
        directory.mkdir()
        (directory / "config.json").write_text(json.dumps(dict(raw, num_hidden_layers=layers)))
        loader._draw_program.cache_clear()
        model, _ = load_model(directory, load_format="dummy")
        counts.append(loader._draw_program.cache_info().misses)
        assert len(_params(model)) > counts[-1]
    assert counts[0] == counts[1] <= 8, counts


def test_dummy_has_exactly_the_checkpoint_names_and_shapes(hf_checkpoints):
    directory = hf_checkpoints["qwen2"]  # biases and tied embeddings: names depend on the config
    real = _params(load_model(directory)[0])
    dummy = _params(load_model(directory, load_format="dummy")[0])
    assert {n: (v.shape, v.dtype) for n, v in dummy.items()} == \
        {n: (v.shape, v.dtype) for n, v in real.items()}
    name = "model.layers.0.mlp.up_proj.weight"
    assert not np.array_equal(np.asarray(dummy[name]), np.asarray(real[name]))


def test_unknown_load_format_is_rejected(config_only_dir, capsys):
    with pytest.raises(ValueError, match="load_format.*'pt'"):
        load_model(config_only_dir, load_format="pt")
    with pytest.raises(SystemExit) as exit_info:
        serve.parse_args(["--load-format", "pt"])
    assert exit_info.value.code == 2
    assert "--load-format" in capsys.readouterr().err


def _client(model_dir):
    """An in-process app over the engine that `python -m jpaged.serve --model DIR` flags build."""
    args = serve.parse_args(["--model", str(model_dir), *SERVER_FLAGS])
    assert serve.engine_options(args)["load_format"] == "dummy"
    engine = LLMEngine.from_pretrained(args.model, **serve.engine_options(args))
    app = serve.build_app(AsyncEngine(engine, "dummy"), serve.model_info(engine, model_dir,
                                                                         "dummy"))
    return TestClient(app)


def test_served_dummy_model_gives_well_formed_completions(config_only_dir):
    body = {"prompt": [5, 17, 200, 3], "max_tokens": 6, "ignore_eos": True, "temperature": 0}
    with _client(config_only_dir) as client:
        reply = client.post("/v1/completions", json=body)
        assert reply.status_code == 200, reply.text
        (choice,) = reply.json()["choices"]
        assert choice["finish_reason"] == "length" and choice["text"] == ""  # no tokenizer
        assert reply.json()["usage"] == {"prompt_tokens": 4, "completion_tokens": 6,
                                         "total_tokens": 10}
        text_prompt = client.post("/v1/completions", json={**body, "prompt": "hello"})
        assert text_prompt.status_code == 400 and "token ids" in text_prompt.text


def test_served_dummy_model_with_synthetic_tokenizer_streams_text(tmp_path):
    from benchmarks.serve_bench import write_model_dir

    model_dir = write_model_dir("tiny", tmp_path / "tiny")
    body = {"prompt": [5, 17, 200, 3], "max_tokens": 5, "ignore_eos": True, "temperature": 0,
            "stream": True}
    with _client(model_dir) as client:
        events = [line[len("data: "):] for line in
                  client.post("/v1/completions", json=body).text.splitlines() if line]
    assert events[-1] == "[DONE]"
    texts = [json.loads(event)["choices"][0]["text"] for event in events[:-1]]
    assert len(texts) == 5 and all(re.fullmatch(r" ?t\d+", text) for text in texts), texts

"""Loading Hugging Face directories without torch, and the errors that name what is wrong."""

import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jpaged.models import checkpoint_tensors, load_model, load_tokenizer, packing


@pytest.fixture
def copy_checkpoint(hf_checkpoints, tmp_path):
    """copy_checkpoint(name) -> a private copy of a fixture checkpoint that a test may break."""
    def copy(name):
        return shutil.copytree(hf_checkpoints[name], tmp_path / name)
    return copy


def _edit_tensors(path, edit):
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def test_sharded_checkpoint_loads_every_tensor_exactly(hf_checkpoints):
    directory = hf_checkpoints["llama_sharded"]
    index = json.load(open(f"{directory}/model.safetensors.index.json"))["weight_map"]
    assert len(set(index.values())) > 1
    tensors = {}
    for shard in set(index.values()):
        tensors.update(load_file(f"{directory}/{shard}"))
    model, config = load_model(directory)
    loaded = checkpoint_tensors(model)
    assert set(loaded) == set(tensors)
    for name, array in loaded.items():
        np.testing.assert_array_equal(np.asarray(array), tensors[name], err_msg=name)
    attn = model.model.layers[1].self_attn   # packed in q, k, v order (one shard)
    np.testing.assert_array_equal(np.asarray(attn.qkv_proj.weight[...]), np.concatenate(
        [tensors[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv"]).T)  # [in, out]
    assert config.architecture == "LlamaForCausalLM" and config.num_hidden_layers == 2


def test_dtype_override_and_bad_dtype(hf_checkpoints):
    model, config = load_model(hf_checkpoints["qwen2"], dtype="bf16")
    assert model.model.embed_tokens.weight[...].dtype == jnp.bfloat16
    assert config.torch_dtype == "float32"  # the checkpoint's dtype; the model's is model.dtype
    with pytest.raises(ValueError, match="int8"):
        load_model(hf_checkpoints["qwen2"], dtype="int8")


def test_eos_ids_merge_config_and_generation_config(copy_checkpoint):
    directory = copy_checkpoint("llama_gqa")
    assert load_model(directory)[1].eos_token_ids == (1, 2)
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    assert load_model(directory)[1].eos_token_ids == (1, 2, 7)


def test_tokenizer_round_trip_and_absent(hf_checkpoints):
    tokenizer = load_tokenizer(hf_checkpoints["llama_gqa"])
    ids = tokenizer.encode("Hello, paged world!").ids
    assert ids[0] == 0 and max(ids) < 320  # <s> prepended; ids fit the model's vocab
    assert tokenizer.decode(ids, skip_special_tokens=True) == "Hello, paged world!"
    assert load_tokenizer(hf_checkpoints["llama_mha"]) is None


def test_corrupt_tokenizer_names_file(copy_checkpoint):
    directory = copy_checkpoint("llama_gqa")
    (directory / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer.json"):
        load_tokenizer(directory)


def test_missing_directory_and_config(copy_checkpoint, tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_model(tmp_path / "nowhere")
    directory = copy_checkpoint("llama_mha")
    (directory / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(directory)


def test_missing_weights_file(copy_checkpoint):
    directory = copy_checkpoint("llama_mha")
    (directory / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_model(directory)


def test_missing_shard_named_in_index(copy_checkpoint):
    directory = copy_checkpoint("llama_sharded")
    (directory / "model-00002-of-00005.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model-00002-of-00005.safetensors"):
        load_model(directory)


def test_index_pointing_to_wrong_shard_names_tensor(copy_checkpoint):
    directory = copy_checkpoint("llama_sharded")
    index_path = directory / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shards = sorted(set(index["weight_map"].values()))
    name = next(n for n, shard in index["weight_map"].items() if shard == shards[0])
    index["weight_map"][name] = shards[1]
    index_path.write_text(json.dumps(index))
    with pytest.raises(ValueError, match=rf"{shards[1]}.*{name}"):
        load_model(directory)


def test_wrong_tensor_shape_names_tensor(copy_checkpoint):
    directory = copy_checkpoint("llama_mha")
    name = "model.layers.1.self_attn.k_proj.weight"
    _edit_tensors(directory / "model.safetensors",
                  lambda t: t.update({name: np.zeros((60, 64), np.float32)}))
    with pytest.raises(ValueError, match=rf"{name}.*\(60, 64\).*\(64, 64\)"):
        load_model(directory)


def test_missing_tensor_names_tensor(copy_checkpoint):
    directory = copy_checkpoint("llama_mha")
    _edit_tensors(directory / "model.safetensors", lambda t: t.pop("model.norm.weight"))
    with pytest.raises(ValueError, match="model.norm.weight"):
        load_model(directory)


def test_unexpected_tensor_names_tensor(copy_checkpoint):
    directory = copy_checkpoint("mistral")  # Mistral has no o_proj bias: a stray one is an error
    name = "model.layers.0.self_attn.o_proj.bias"
    _edit_tensors(directory / "model.safetensors",
                  lambda t: t.update({name: np.zeros(64, np.float32)}))
    with pytest.raises(ValueError, match=name):
        load_model(directory)


def test_tied_checkpoint_with_saved_lm_head_loads(copy_checkpoint):
    directory = copy_checkpoint("qwen2")
    _edit_tensors(directory / "model.safetensors",
                  lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"]}))
    model, _ = load_model(directory)
    assert model.lm_head is None


def test_unsupported_architecture_names_field(copy_checkpoint):
    directory = copy_checkpoint("llama_mha")
    config = json.loads((directory / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="architectures.*GPT2LMHeadModel"):
        load_model(directory)


@pytest.mark.parametrize("corruption", ["garbage", "truncated"])
def test_corrupt_safetensors_names_file(copy_checkpoint, corruption):
    directory = copy_checkpoint("llama_mha")
    path = directory / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(b"\x00garbage" * 8 if corruption == "garbage" else data[:len(data) // 2])
    with pytest.raises(ValueError, match="model.safetensors"):
        load_model(directory)


@pytest.mark.parametrize("name, tensor, shape", [
    ("llama_mha", "model.norm.weight", (60,)),                        # the last one read
    ("phi3", "model.layers.1.self_attn.qkv_proj.weight", (96, 96)),   # a fused tensor
    ("gemma3", "model.layers.1.self_attn.k_norm.weight", (16,)),
])
def test_bad_tensor_fails_before_any_device_memory(copy_checkpoint, monkeypatch, name, tensor,
                                                   shape):
    directory = copy_checkpoint(name)
    _edit_tensors(directory / "model.safetensors",
                  lambda t: t.update({tensor: np.zeros(shape, np.float32)}))
    placed = []
    monkeypatch.setattr("jax.device_put", lambda *args, **kw: placed.append(args))
    with pytest.raises(ValueError, match=rf"{tensor}.*{tuple(shape)}"):
        load_model(directory)
    assert placed == []


def test_integer_tensor_names_tensor_and_dtype(copy_checkpoint):
    directory = copy_checkpoint("qwen3")
    name = "model.layers.0.self_attn.q_norm.weight"
    _edit_tensors(directory / "model.safetensors",
                  lambda t: t.update({name: np.zeros(32, np.int32)}))
    with pytest.raises(ValueError, match=rf"{name}.*I32"):
        load_model(directory)


def test_head_dim_not_a_multiple_of_8_names_field(copy_checkpoint):
    directory = copy_checkpoint("llama_head_dim")
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "head_dim": 20}))
    with pytest.raises(ValueError, match="head_dim.*20"):
        load_model(directory)


def test_multimodal_gemma3_reads_only_its_text_model(copy_checkpoint):
    """The vision tower's tensors are never read (a broken one does not matter); the text
    model's are checked as any checkpoint's."""
    directory = copy_checkpoint("gemma3_multimodal")
    _edit_tensors(directory / "model.safetensors",
                  lambda t: t.update({"vision_tower.head.probe": np.zeros(3, np.int8)}))
    model, config = load_model(directory)
    assert config.checkpoint_prefix == "language_model."
    assert "model.layers.1.self_attn.q_norm.weight" in checkpoint_tensors(model)
    stray = "language_model.model.layers.0.self_attn.o_proj.bias"
    _edit_tensors(directory / "model.safetensors",
                  lambda t: t.update({stray: np.zeros(64, np.float32)}))
    with pytest.raises(ValueError, match="model.layers.0.self_attn.o_proj.bias"):
        load_model(directory)


@pytest.mark.parametrize("packed", [
    packing.qkv_packing(32, 8, 16, 1), packing.qkv_packing(8, 2, 16, 8),
    packing.qkv_packing(32, 8, 16, 2, rotary_dim=8),        # many short runs: the gather path
    packing.qkv_packing(8, 2, 16, 2, fused=True), packing.gate_up_packing(64, 4),
    packing.gate_up_packing(66, 4)], ids=lambda p: f"{'+'.join(p.parts)}-{len(p.runs)}runs")
def test_packing_by_slices_equals_the_row_map(packed):
    """`Packing.pack` (slices of the parts, or a gather past MAX_RUNS runs) puts row
    `rows[r]` of the stacked parts at row r, for numpy and jax parts, and unpack inverts it."""
    rng = np.random.default_rng(0)
    parts = [rng.standard_normal((rows, 3)).astype(np.float32) for rows in packed.part_rows]
    expected = np.concatenate(parts)[np.asarray(packed.rows)]
    np.testing.assert_array_equal(packed.pack(parts), expected)
    np.testing.assert_array_equal(np.asarray(packed.pack([jnp.asarray(p) for p in parts])),
                                  expected)
    unpacked = packed.unpack(expected)
    for name, part in zip(packed.parts, parts):
        np.testing.assert_array_equal(unpacked[name], part)


@pytest.mark.parametrize("host_limit", [0, 1 << 30])
def test_projections_are_placed_transposed_on_the_device_or_the_host(monkeypatch, host_limit):
    """A projection's checkpoint tensor [out, in] is stored [in, out]: transposed by a device
    program, or on the host when it is small (limit 0: always the device); other tensors as
    they are."""
    from jpaged.models import loader

    monkeypatch.setattr(loader, "HOST_TRANSPOSE_BYTES", host_limit)
    weight = np.arange(6 * 4, dtype=np.float32).reshape(6, 4)
    placed = loader.place_parameter("model.layers.0.self_attn.o_proj.weight", weight.copy(), None)
    np.testing.assert_array_equal(np.asarray(placed), weight.T)
    norm = loader.place_parameter("model.norm.weight", weight[0].copy(), None)
    np.testing.assert_array_equal(np.asarray(norm), weight[0])

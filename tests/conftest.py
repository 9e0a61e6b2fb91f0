"""Session fixtures shared across the suite: tiny Hugging Face checkpoints built once per run."""

import pytest


@pytest.fixture(scope="session")
def hf_checkpoints(tmp_path_factory) -> dict[str, str]:
    """{name: directory} of tiny random float32 checkpoints (plus 'llama_bf16'), built once.

    Names: llama_mha, llama_gqa (llama3 RoPE, tokenizer.json, eos [1, 2]), mistral (sliding
    window 64), qwen2 (q/k/v bias, tied embeddings), llama_head_dim (head_dim 32, all biases),
    llama_sharded (several safetensors + index), llama_bf16. See tests/hf_fixtures.py.
    """
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from tests import hf_fixtures

    return hf_fixtures.build_all(tmp_path_factory.mktemp("hf_checkpoints"))

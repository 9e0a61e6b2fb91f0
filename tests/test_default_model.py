"""The built-in default model that ships in jpaged/assets/default_model: small, byte-level, loads
with no --model, and completes Python-looking prompts with Python-looking text."""

import json
import keyword
import re
from pathlib import Path

import pytest

from jpaged import LLM, SamplingParams
from jpaged.engine.builder import default_model_dir
from jpaged.models import load_model, load_tokenizer

ROOT = Path(__file__).resolve().parent.parent
MAX_BYTES = 10 * 2**20


@pytest.fixture(scope="module")
def llm():
    return LLM(None, max_num_seqs=4, max_num_batched_tokens=128, max_model_len=1024)


def test_checkpoint_is_small_and_complete():
    directory = default_model_dir()
    files = [p for p in directory.rglob("*") if p.is_file()]
    assert sum(p.stat().st_size for p in files) < MAX_BYTES
    for name in ("config.json", "generation_config.json", "tokenizer.json", "train_log.json",
                 "checkpoint/_METADATA"):
        assert (directory / name).is_file(), name


def test_config_is_a_small_byte_level_llama_with_long_context():
    config = json.loads((default_model_dir() / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["vocab_size"] == 257 and config["max_position_embeddings"] >= 512
    model, model_config = load_model(default_model_dir())
    assert 1_000_000 <= model_config.num_parameters() <= 5_000_000
    assert model_config.eos_token_ids == (256,)
    assert model.dtype.name == "float32"


def test_tokenizer_is_byte_level():
    tokenizer = load_tokenizer(default_model_dir())
    text = "def f(x):\n    return x  # é"
    assert tokenizer.encode(text).ids == list(text.encode("utf-8"))
    assert tokenizer.decode(tokenizer.encode(text).ids) == text


def _python_score(text: str) -> int:
    """How many Python traits the text shows (keywords, colon-newline, indented lines, ...)."""
    words = set(re.findall(r"[A-Za-z_]+", text))
    return sum([
        len(words & set(keyword.kwlist)) >= 2,
        ":\n" in text,
        bool(re.search(r"\n {4,}\S", text)),
        "(" in text and ")" in text,
        bool(re.search(r"\b(self|None|True|False|return)\b", text)),
    ])


PYTHON_PROMPTS = ["class Parser:\n    def __init__(self", "import os\n\n\ndef ",
                  "    def read(self, path):\n        "]


def test_python_prompts_get_python_like_completions(llm):
    """Sampled completions (a model this small loops on whitespace under greedy decoding) look
    like Python: the generated text alone shows most traits, and all of them together."""
    params = [SamplingParams(temperature=0.7, top_p=0.9, seed=seed, max_tokens=96)
              for seed in range(2) for _ in PYTHON_PROMPTS]
    texts = [output.outputs[0].text
             for output in llm.generate(PYTHON_PROMPTS * 2, params, use_tqdm=False)]
    scores = [_python_score(text) for text in texts]
    assert min(scores) >= 3, list(zip(scores, texts))
    assert _python_score("\n".join(texts)) == 5


def test_loads_from_a_relative_path(monkeypatch):
    monkeypatch.chdir(ROOT)
    model, _ = load_model(Path("jpaged/assets/default_model"))
    assert model.config.vocab_size == 257


def test_context_beyond_512_tokens(llm):
    source = (Path(json.__file__).read_text())[:700]
    [output] = llm.generate([source], SamplingParams(temperature=0, max_tokens=8),
                            use_tqdm=False)
    assert len(output.prompt_token_ids) > 600 and len(output.outputs[0].token_ids) == 8


def test_training_is_documented_with_a_small_loss_plot():
    doc = (ROOT / "docs" / "default_model.md").read_text()
    assert "tools/train_tiny.py" in doc and "default_model_loss.png" in doc
    plot = ROOT / "docs" / "default_model_loss.png"
    assert plot.is_file() and plot.stat().st_size < 200_000
    log = json.loads((default_model_dir() / "train_log.json").read_text())
    assert log["val_loss"][-1] < log["val_loss"][0]

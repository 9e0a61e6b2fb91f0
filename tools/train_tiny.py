"""Train the built-in default model: a tiny byte-level Llama on the Python standard library.

The model is `jpaged.models.llama.LlamaForCausalLM` itself, so the saved checkpoint is exactly what
the engine loads. Training runs it densely (`dense_logits`: the same modules, with plain causal
attention instead of the paged cache). The output directory holds config.json (Hugging Face
field names), generation_config.json, tokenizer.json (256 bytes + `<|endoftext|>`), an
orbax-checkpoint folder `checkpoint/` and train_log.json (the loss curve).

    python tools/train_tiny.py --out jpaged/assets/default_model --plot docs/default_model_loss.png
"""

import argparse
import dataclasses
import json
import math
import os
import sys
import sysconfig
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from jpaged.config import ModelConfig  # noqa: E402
from jpaged.models.layers import rotary_cos_sin  # noqa: E402
from pallas_kernels.reference import apply_rotary  # noqa: E402
from jpaged.models.llama import LlamaForCausalLM  # noqa: E402
from jpaged.models.loader import checkpoint_tensors, load_model  # noqa: E402

EOS_TOKEN = "<|endoftext|>"
EOS_ID = 256                    # after the 256 byte tokens; also separates source files
VOCAB_SIZE = 257
CHECKPOINT_DIR = "checkpoint"   # the orbax folder inside the model directory
_SKIPPED_DIRS = {"site-packages", "test", "tests", "idle_test", "__pycache__"}


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    hidden_size: int = 192
    num_hidden_layers: int = 4
    num_attention_heads: int = 6
    num_key_value_heads: int = 2
    intermediate_size: int = 512
    max_position_embeddings: int = 1024
    context: int = 512           # training window (tokens per row)
    batch_size: int = 8
    steps: int = 600
    learning_rate: float = 3e-3
    warmup_steps: int = 30
    weight_decay: float = 0.1
    seed: int = 0
    eval_every: int = 50
    max_corpus_bytes: int | None = None


# ---- data ------------------------------------------------------------------------------------
def stdlib_sources(root: Path | None = None) -> list[Path]:
    """The standard library's .py files (tests and site-packages left out), in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"]) if root is None else root
    sources = []
    for folder, subfolders, files in os.walk(root):
        subfolders[:] = [name for name in subfolders if name not in _SKIPPED_DIRS]
        sources.extend(Path(folder) / name for name in files if name.endswith(".py"))
    return sorted(sources)


def load_corpus(max_bytes: int | None = None) -> np.ndarray:
    """[L] uint16 token ids: every source file's bytes, each followed by EOS_ID."""
    chunks, total = [], 0
    for path in stdlib_sources():
        data = np.frombuffer(path.read_bytes(), np.uint8).astype(np.uint16)
        chunks.append(np.append(data, np.uint16(EOS_ID)))
        total += data.size + 1
        if max_bytes is not None and total >= max_bytes:
            break
    corpus = np.concatenate(chunks)
    return corpus if max_bytes is None else corpus[:max_bytes]


def sample_windows(corpus: np.ndarray, rng: np.random.Generator, batch_size: int,
                   context: int) -> np.ndarray:
    """[B, context + 1] int32 windows at random offsets (inputs are [:, :-1], targets [:, 1:])."""
    starts = rng.integers(0, corpus.size - context - 1, size=batch_size)
    return np.stack([corpus[s:s + context + 1] for s in starts]).astype(np.int32)


# ---- tokenizer -------------------------------------------------------------------------------
def byte_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map, which the ByteLevel pre-tokenizer uses."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[byte] = chr(byte)
        else:
            chars[byte] = chr(256 + extra)
            extra += 1
    return chars


def build_tokenizer():
    """A `tokenizers.Tokenizer` whose ids are the UTF-8 bytes (0-255) plus EOS_TOKEN (256)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {char: byte for byte, char in byte_to_unicode().items()}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(EOS_TOKEN, special=True, normalized=False)])
    assert tokenizer.token_to_id(EOS_TOKEN) == EOS_ID
    return tokenizer


# ---- model -----------------------------------------------------------------------------------
def hf_config(config: TrainConfig) -> dict:
    """config.json content (Hugging Face field names)."""
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": VOCAB_SIZE, "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu",
        "tie_word_embeddings": True, "torch_dtype": "float32", "eos_token_id": EOS_ID,
    }


def dense_logits(model: LlamaForCausalLM, token_ids: jax.Array) -> jax.Array:
    """token_ids [B, T] -> logits [B, T, V]: the engine's modules with dense causal attention."""
    positions = jnp.arange(token_ids.shape[1], dtype=jnp.int32)
    cos, sin = rotary_cos_sin(positions, model.model.inv_frequencies)    # [T, D]
    x = model.model.embed_tokens(token_ids)                              # [B, T, E]
    for layer in model.model.layers:
        x = x + _dense_attention(layer.self_attn, layer.input_layernorm(x), cos, sin)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return model.compute_logits(model.model.norm(x))


def _dense_attention(attn, x, cos, sin):
    batch, length, _ = x.shape
    q, k, v = attn.project_qkv(x)                        # [B, T, H, D], [B, T, K, D], [B, T, K, D]
    q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    out = jax.nn.dot_product_attention(q, k, v, is_causal=True)                   # [B, T, H, D]
    return attn.o_proj(out.reshape(batch, length, -1))


def hf_named_params(model: LlamaForCausalLM) -> dict[str, np.ndarray]:
    """{Hugging Face tensor name: array}, e.g. 'model.layers.0.mlp.up_proj.weight'."""
    return {name: np.asarray(array) for name, array in checkpoint_tensors(model).items()}


# ---- training --------------------------------------------------------------------------------
def make_optimizer(config: TrainConfig) -> optax.GradientTransformation:
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, config.learning_rate, config.warmup_steps, max(config.steps, config.warmup_steps + 1),
        end_value=config.learning_rate / 10)
    decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)  # noqa: E731
    return optax.chain(optax.clip_by_global_norm(1.0),
                       optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=config.weight_decay,
                                   mask=decay_mask))


def make_steps(graphdef, tx):
    """(train_step, eval_loss), jitted pure functions of (params, opt_state, batch)."""
    def loss_fn(params, batch):
        logits = dense_logits(nnx.merge(graphdef, params), batch[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()

    def train_step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    # params and opt_state are donated: XLA updates them in place.
    return jax.jit(train_step, donate_argnums=(0, 1)), jax.jit(loss_fn)


def initial_model(config: TrainConfig, init_from: Path | None) -> LlamaForCausalLM:
    """Random weights, or those of a directory saved by this script (to train further)."""
    model_config = ModelConfig.from_dict(hf_config(config))
    if init_from is None:
        return LlamaForCausalLM(model_config, dtype=jnp.float32, rngs=nnx.Rngs(config.seed))
    model, loaded_config = load_model(init_from, dtype="float32")
    if dataclasses.replace(loaded_config, eos_token_ids=()) != dataclasses.replace(
            model_config, eos_token_ids=()):
        raise ValueError(f"--init-from {init_from}: its config.json differs from the model flags "
                         f"({loaded_config} vs {model_config})")
    return model


def train(config: TrainConfig, *, log=print, init_from: Path | None = None):
    """Train (from scratch, or further from `init_from`); returns (model, history) with
    history = {"step", "loss", "val_step", "val_loss", "seconds"}, steps counted from 1."""
    corpus = load_corpus(config.max_corpus_bytes)
    split = int(corpus.size * 0.99)
    train_data, val_data = corpus[:split], corpus[split:]
    log(f"corpus: {corpus.size:,} tokens ({train_data.size:,} train, {val_data.size:,} val)")
    model = initial_model(config, init_from)
    log(f"model: {model.config.num_parameters():,} parameters"
        + (f", starting from {init_from}" if init_from else ""))
    graphdef, params = nnx.split(model)
    tx = make_optimizer(config)
    opt_state = tx.init(params)
    train_step, eval_loss = make_steps(graphdef, tx)
    rng = np.random.default_rng(config.seed)
    val_batch = sample_windows(val_data, np.random.default_rng(1), config.batch_size,
                               config.context)
    history = {"step": [], "loss": [], "val_step": [], "val_loss": [], "seconds": []}
    start = time.perf_counter()
    for step in range(1, config.steps + 1):
        batch = sample_windows(train_data, rng, config.batch_size, config.context)
        params, opt_state, loss = train_step(params, opt_state, batch)
        history["step"].append(step)
        history["loss"].append(float(loss))
        history["seconds"].append(time.perf_counter() - start)
        if step % config.eval_every == 0 or step == config.steps:
            val = float(eval_loss(params, val_batch))
            history["val_step"].append(step)
            history["val_loss"].append(val)
            log(f"step {step}/{config.steps} loss {float(loss):.3f} val {val:.3f} "
                f"({val / math.log(2):.2f} bits/byte) {time.perf_counter() - start:.0f}s")
    return nnx.merge(graphdef, params), history


def merged_history(previous_log: dict | None, history: dict) -> dict:
    """The phases' loss curves as one, later phases' steps and seconds shifted to follow on."""
    if previous_log is None:
        return history
    last_step = previous_log["step"][-1]
    last_second = previous_log["seconds"][-1]
    shift = {"step": last_step, "val_step": last_step, "seconds": last_second}
    return {key: previous_log[key] + [value + shift.get(key, 0) for value in history[key]]
            for key in history}


def save(model: LlamaForCausalLM, config: TrainConfig, history: dict, out_dir: Path, *,
         phases: list[dict] | None = None):
    """Write config.json, generation_config.json, tokenizer.json, checkpoint/, train_log.json.

    `phases`: the training configs so far (several when a run continued an earlier one)."""
    import orbax.checkpoint as ocp

    out_dir = Path(out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(hf_config(config), indent=2) + "\n")
    (out_dir / "generation_config.json").write_text(
        json.dumps({"eos_token_id": EOS_ID}, indent=2) + "\n")
    build_tokenizer().save(str(out_dir / "tokenizer.json"))
    nested: dict = {}
    for name, array in hf_named_params(model).items():
        *parents, leaf = name.split(".")
        node = nested
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = array
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(out_dir / CHECKPOINT_DIR, nested, force=True)
    phases = (phases or []) + [dataclasses.asdict(config)]
    log = {"train_config": dataclasses.asdict(config), "phases": phases, **history}
    (out_dir / "train_log.json").write_text(json.dumps(log) + "\n")


def plot(history: dict, path: Path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=80)
    ax.plot(history["step"], history["loss"], lw=0.8, alpha=0.6, label="train (one batch)")
    ax.plot(history["val_step"], history["val_loss"], "o-", ms=3, label="held-out")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/byte)")
    ax.set_ylim(0, min(6.0, max(history["loss"]) * 1.05))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def parse_args(argv=None) -> tuple[TrainConfig, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="model directory to write")
    parser.add_argument("--plot", type=Path, help="loss-curve PNG to write (needs matplotlib)")
    parser.add_argument("--init-from", type=Path,
                        help="train further from a directory this script saved (same model "
                             "flags); its loss curve is continued")
    for field in dataclasses.fields(TrainConfig):
        flag = "--" + field.name.replace("_", "-")
        kind = float if field.type in (float, "float") else int
        parser.add_argument(flag, type=kind, default=field.default, help=f"default {field.default}")
    args = parser.parse_args(argv)
    config = TrainConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)})
    return config, args


def main(argv=None) -> int:
    config, args = parse_args(argv)
    previous = None
    if args.init_from is not None and (args.init_from / "train_log.json").is_file():
        previous = json.loads((args.init_from / "train_log.json").read_text())
    model, history = train(config, log=lambda line: print(line, flush=True),
                           init_from=args.init_from)
    history = merged_history(previous, history)
    phases = previous.get("phases", [previous["train_config"]]) if previous else None
    save(model, config, history, args.out, phases=phases)
    if args.plot:
        plot(history, args.plot)
    print(f"saved {args.out}; final loss {history['loss'][-1]:.3f}, "
          f"held-out {history['val_loss'][-1]:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Engine settings (vLLM's names), their eager validation, model loading and KV-pool sizing."""

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp

from jpaged import kv_cache, parallel
from jpaged.config import normalize_dtype
from jpaged.models.loader import load_model, load_tokenizer
from jpaged.engine.scheduler import PREEMPTION_MODES

ATTENTION_BACKENDS = ("auto", "reference", "pallas_gpu", "pallas_tpu")
CPU_KV_BUDGET_BYTES = 1 << 30       # no memory statistics on the CPU: a fixed 1 GiB pool at most
ACTIVATION_SLACK_BYTES = 512 << 20  # allocator fragmentation, compiler scratch, kernels' partials


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Resolved engine settings; every field validated when built."""
    num_kv_blocks: int
    block_size: int = 16
    max_num_seqs: int = 256
    max_model_len: int = 2048
    max_num_batched_tokens: int = 2048
    seed: int = 0
    kv_dtype: str = "float32"
    attention_backend: str = "reference"
    interpret: bool = False
    num_scheduler_steps: int = 1
    async_scheduling: bool = False     # overlap host processing with the next decode loops
    async_depth: int = 2               # with it, decode loops kept in flight behind the host
    warmup: bool = False               # compile every bucket shape at start-up
    strict_compilation: bool = False   # after warm-up, a new shape is an error
    compilation_cache_dir: str | None = None
    enable_prefix_caching: bool = True
    preemption_mode: str = "auto"      # "auto" | "swap" | "recompute"
    swap_space: float = 4.0            # GiB of host memory for swapped-out KV blocks
    tensor_parallel_size: int = 1      # devices the model and KV cache are split over

    def __post_init__(self):
        for name in ("num_kv_blocks", "block_size", "max_num_seqs", "max_model_len",
                     "max_num_batched_tokens", "num_scheduler_steps", "tensor_parallel_size",
                     "async_depth"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.num_kv_blocks < 2:
            raise ValueError(f"num_kv_blocks must be at least 2 (one is the sink), "
                             f"got {self.num_kv_blocks}")
        if self.strict_compilation and not self.warmup:
            raise ValueError("strict_compilation=True needs warmup=True (nothing is compiled yet)")
        for name in ("async_scheduling", "warmup", "strict_compilation", "enable_prefix_caching"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}, "
                             f"got {self.preemption_mode!r}")
        if isinstance(self.swap_space, bool) or not isinstance(self.swap_space, (int, float)) \
                or not 0 <= self.swap_space < float("inf"):
            raise ValueError(f"swap_space must be a non-negative number of GiB, "
                             f"got {self.swap_space!r}")
        if self.preemption_mode == "swap" and self.swap_space == 0:
            raise ValueError("preemption_mode='swap' needs swap_space > 0 (GiB of host memory)")
        if self.tensor_parallel_size > 1 and self.preemption_mode != "recompute":
            raise ValueError("swapping moves blocks of a single-device cache: with "
                             "tensor_parallel_size > 1 preemption_mode must be 'recompute'")
        if self.attention_backend not in ATTENTION_BACKENDS[1:]:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, "
                             f"got {self.attention_backend!r}")


def resolve_attention_backend(name: str) -> tuple[str, bool]:
    """("auto" | explicit) -> (backend, interpret). Pallas backends interpret on the CPU."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {name!r}")
    platform = jax.default_backend()
    if name == "auto":
        name = {"gpu": "pallas_gpu", "cuda": "pallas_gpu", "tpu": "pallas_tpu"}.get(
            platform, "reference")
    native = {"pallas_gpu": ("gpu", "cuda", "rocm"), "pallas_tpu": ("tpu",)}
    if platform != "cpu" and platform not in native.get(name, (platform,)):
        raise ValueError(f"attention_backend {name!r} compiles for {' or '.join(native[name])} "
                         f"(or runs interpreted on the CPU), not for this {platform} backend; "
                         "use 'auto' or 'reference'")
    return name, name != "reference" and platform == "cpu"


def default_model_dir() -> Path:
    """The built-in model that ships with the package."""
    return Path(__file__).resolve().parent.parent / "assets" / "default_model"


def resolve_engine_config(model=None, *, dtype="auto", load_format="auto",
                          tensor_parallel_size=1, devices=None, **options):
    """Load the model (None: the built-in one) and tokenizer and size the engine.

    load_format is `load_model`'s ("auto": the weights in the directory). tensor_parallel_size:
    devices the model is split over, the first ones of jax.devices() unless `devices` names them
    (a data-parallel replica's group). Returns (model, tokenizer, EngineConfig); options are
    `build_engine_config`'s.
    """
    model_dir = default_model_dir() if model is None else Path(model)
    mesh = parallel.make_mesh(tensor_parallel_size, devices)
    llm_model, _ = load_model(model_dir, dtype=dtype, load_format=load_format, mesh=mesh)
    return llm_model, load_tokenizer(model_dir), build_engine_config(
        llm_model, tensor_parallel_size=tensor_parallel_size, **options)


def build_engine_config(model, *, block_size=16, num_kv_blocks=None, gpu_memory_utilization=0.9,
                        max_num_seqs=256, max_model_len=None, max_num_batched_tokens=None, seed=0,
                        attention_backend="auto", kv_cache_dtype="auto",
                        num_scheduler_steps=1, async_scheduling=False, async_depth=2,
                        warmup=None, strict_compilation=False, compilation_cache_dir=None,
                        enable_prefix_caching=True, preemption_mode="auto",
                        swap_space=4.0, tensor_parallel_size=1) -> EngineConfig:
    """Engine settings for a model already in memory (its weights count against the budget).

    warmup None means: compile all shapes at start-up on an accelerator, lazily on the CPU.
    tensor_parallel_size must be the size of the mesh the model was built on (`model.mesh`);
    preemption "auto" then means recompute.
    """
    if parallel.mesh_size(model.mesh) != tensor_parallel_size:
        raise ValueError(f"tensor_parallel_size={tensor_parallel_size} but the model is split "
                         f"over {parallel.mesh_size(model.mesh)} device(s): build it with "
                         "load_model(..., mesh=jpaged.parallel.make_mesh(n))")
    if model.mesh is not None:  # swapping knows one device's cache only
        if preemption_mode == "swap":
            raise ValueError("preemption_mode='swap' needs a single-device engine (no "
                             "tensor_parallel_size or device group)")
        preemption_mode = "recompute"
    if warmup is None:
        warmup = jax.default_backend() != "cpu"
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got "
                         f"{gpu_memory_utilization}")
    model_config = model.config
    if max_model_len is None:
        max_model_len = model_config.max_model_len
    if max_model_len > model_config.max_model_len:
        raise ValueError(f"max_model_len={max_model_len} exceeds the model's limit "
                         f"{model_config.max_model_len} (max_position_embeddings, or the "
                         "sliding window, past which full attention would be wrong)")
    if max_num_batched_tokens is None:
        max_num_batched_tokens = max(2048, block_size)
    kv_dtype = (model.dtype.name if kv_cache_dtype == "auto"
                else normalize_dtype(kv_cache_dtype))
    backend, interpret = resolve_attention_backend(attention_backend)
    if num_kv_blocks is None:
        num_kv_blocks = size_kv_pool(model_config, block_size=block_size, kv_dtype=kv_dtype,
                                     max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                                     max_num_batched_tokens=max_num_batched_tokens,
                                     utilization=gpu_memory_utilization, mesh=model.mesh)
    return EngineConfig(num_kv_blocks=num_kv_blocks, block_size=block_size,
                        max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                        max_num_batched_tokens=max_num_batched_tokens, seed=seed,
                        kv_dtype=kv_dtype, attention_backend=backend, interpret=interpret,
                        num_scheduler_steps=num_scheduler_steps,
                        async_scheduling=async_scheduling, async_depth=async_depth,
                        warmup=warmup,
                        strict_compilation=strict_compilation,
                        compilation_cache_dir=compilation_cache_dir,
                        enable_prefix_caching=enable_prefix_caching,
                        preemption_mode=preemption_mode, swap_space=swap_space,
                        tensor_parallel_size=tensor_parallel_size)


def activation_reserve_bytes(model_config, max_num_batched_tokens, max_num_seqs) -> int:
    """Peak bytes of one step's temporaries, an upper estimate in float32: per token the
    residual stream, q/k/v, attention output and the MLP's three intermediate-size tensors; per
    sampled row the logits and the sampler's sort buffers (x4); plus fixed slack."""
    hidden, inter = model_config.hidden_size, model_config.intermediate_size
    qkv = (model_config.num_attention_heads + 2 * model_config.num_key_value_heads) * \
        model_config.head_dim
    per_token = 4 * (4 * hidden + 2 * qkv + 3 * inter)
    logits = 4 * 4 * max_num_seqs * model_config.vocab_size
    return max_num_batched_tokens * per_token + logits + ACTIVATION_SLACK_BYTES


def size_kv_pool(model_config, *, block_size, kv_dtype, max_num_seqs, max_model_len,
                 max_num_batched_tokens, utilization, mesh=None) -> int:
    """Blocks (sink included) that fit next to the weights already on the device.

    On an accelerator: utilization x the device's memory limit, minus what is in use now (the
    weights), minus the step's activation estimate. On the CPU: at most CPU_KV_BUDGET_BYTES, and
    no more than every sequence at full length needs. Too little memory is a ValueError at start,
    never an out-of-memory error later. Under tensor parallelism (mesh) the budget is one
    device's, and so are a block's bytes: its share of the (possibly repeated) kv heads.
    """
    per_block = kv_cache.bytes_per_block(
        model_config.num_hidden_layers,
        parallel.num_cache_kv_heads(model_config.num_key_value_heads, mesh),
        model_config.head_dim, block_size, jnp.dtype(kv_dtype)) // parallel.mesh_size(mesh)
    full_need = max_num_seqs * -(-max_model_len // block_size) + 1
    device = jax.devices()[0] if mesh is None else mesh.devices.flat[0]
    stats = device.memory_stats() or {}
    if "bytes_limit" not in stats:
        return max(2, min(full_need, CPU_KV_BUDGET_BYTES // per_block))
    budget = (utilization * stats["bytes_limit"] - stats.get("bytes_in_use", 0)
              - activation_reserve_bytes(model_config, max_num_batched_tokens, max_num_seqs))
    if budget < 2 * per_block:
        raise ValueError(
            f"gpu_memory_utilization={utilization}: after the weights "
            f"({stats.get('bytes_in_use', 0) / 2**30:.2f} GiB) and activations there is no room "
            f"for KV blocks of {per_block} bytes; raise gpu_memory_utilization or lower "
            "max_num_batched_tokens / max_num_seqs")
    return int(min(full_need, budget // per_block))

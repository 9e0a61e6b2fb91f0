"""From options to an engine: model loading, the start-up decisions (attention backend, warm-up,
lengths, KV dtype, matmul precision) and KV-pool sizing. The options themselves and their
checks: `jpaged.options`."""

import functools
import logging
from pathlib import Path

import jax
import jax.numpy as jnp

from jpaged import kv_cache, parallel
from jpaged.config import normalize_dtype
from jpaged.engine import compile_cache
from jpaged.logprobs import SCORED_POSITIONS_PER_STEP
from jpaged.models.attention import unsupported_reason
from jpaged.models.llama import check_batch_invariant, with_matmul_precision
from jpaged.models.loader import load_model, load_tokenizer
from jpaged.options import LOADING_OPTIONS, EngineConfig, OptionError, check_option, check_options

logger = logging.getLogger(__name__)

CPU_KV_BUDGET_BYTES = 1 << 30       # no memory statistics on the CPU: a fixed 1 GiB pool at most
ACTIVATION_SLACK_BYTES = 512 << 20  # allocator fragmentation, compiler scratch, kernels' partials


# "auto" on a CUDA GPU takes the first of these that can run the model on this device. To make
# the Hopper prefill kernel the default: ("pallas_mosaic_gpu", "pallas_gpu").
AUTO_GPU_BACKENDS = ("pallas_gpu",)
_NATIVE_PLATFORMS = {"pallas_gpu": ("gpu", "cuda", "rocm"), "pallas_mosaic_gpu": ("gpu", "cuda"),
                     "pallas_tpu": ("tpu",)}


def _auto_candidates(platform: str) -> tuple[str, ...]:
    if platform in ("gpu", "cuda"):
        return AUTO_GPU_BACKENDS
    return ({"tpu": "pallas_tpu"}.get(platform, "reference"),)


def resolve_attention_backend(name: str) -> tuple[str, bool]:
    """("auto" | explicit) -> (backend, interpret). Pallas backends interpret on the CPU.
    "auto" gives its first candidate; `choose_attention_backend` also tries the others."""
    check_option("attention_backend", name)
    platform = jax.default_backend()
    if name == "auto":
        name = _auto_candidates(platform)[0]
    native = _NATIVE_PLATFORMS
    if platform != "cpu" and platform not in native.get(name, (platform,)):
        raise ValueError(f"attention_backend {name!r} compiles for {' or '.join(native[name])} "
                         f"(or runs interpreted on the CPU), not for this {platform} backend; "
                         "use 'auto' or 'reference'")
    return name, name != "reference" and platform == "cpu"


def _device_problem(backend: str):
    """Why this machine's accelerator cannot run `backend`'s kernels (None: it can, or the CPU
    interprets them). Mosaic GPU's wgmma and TMA exist on Hopper (compute capability 9.x) only."""
    if backend != "pallas_mosaic_gpu" or jax.default_backend() == "cpu":
        return None
    capability = str(getattr(jax.devices()[0], "compute_capability", ""))
    if not capability.startswith("9."):
        return f"the Mosaic GPU prefill kernel needs a Hopper GPU (compute capability 9.x), " \
               f"this one has {capability or 'none reported'}"
    return None


def choose_attention_backend(name: str, model_config, *, dtype, kv_dtype,
                             block_size: int) -> tuple[str, bool]:
    """`resolve_attention_backend`, checked against the model: a backend whose kernels cannot run
    it (head size, dtype, block size, a layer's window or soft cap, the device) is refused by name
    when asked for; "auto" passes it over for its next candidate, and when none can run the model
    takes the reference and says why, once."""
    backend, interpret = resolve_attention_backend(name)
    candidates = _auto_candidates(jax.default_backend()) if name == "auto" else (backend,)
    reasons = []
    for candidate in candidates:
        reason = unsupported_reason(candidate, model_config, dtype=dtype, kv_dtype=kv_dtype,
                                    block_size=block_size) or _device_problem(candidate)
        if reason is None:
            return candidate, candidate != "reference" and jax.default_backend() == "cpu"
        reasons.append(f"{candidate!r} cannot run this model ({reason})")
    if name != "auto":
        raise ValueError(f"attention_backend {backend!r} cannot run this model: {reason}")
    _say_once(f"attention_backend 'auto': {'; '.join(reasons)}; using 'reference' (the jnp "
              "attention)")
    return "reference", False


@functools.cache
def _say_once(message: str):
    logger.warning(message)


def default_model_dir() -> Path:
    """The built-in model that ships with the package."""
    return Path(__file__).resolve().parent.parent / "assets" / "default_model"


def resolve_engine_config(model=None, **options):
    """Load the model (None: the built-in one) and tokenizer and size the engine.

    options: `jpaged.options.OPTIONS` (LLM's keywords), checked before anything loads. dtype and
    load_format are `load_model`'s; the model is split over tensor_parallel_size devices, the
    first ones of jax.devices() unless `devices` names them (a data-parallel replica's group).
    Returns (model, tokenizer, EngineConfig).
    """
    settings = check_options(options)
    model_dir = default_model_dir() if model is None else Path(model)
    mesh = parallel.make_mesh(settings["tensor_parallel_size"], settings["devices"])
    llm_model, _ = load_model(model_dir, dtype=settings["dtype"],
                              load_format=settings["load_format"], mesh=mesh,
                              expert_parallel=settings["enable_expert_parallel"])
    return llm_model, load_tokenizer(model_dir), decide_engine_config(llm_model, settings)


def build_engine_config(model, **options) -> EngineConfig:
    """Engine settings for a model already in memory (its weights count against the budget).

    options: `jpaged.options.OPTIONS` except those that load a model (dtype, load_format,
    devices). tensor_parallel_size must be the size of the mesh the model was built on
    (`model.mesh`).
    """
    loading = sorted(set(options) & set(LOADING_OPTIONS))
    if loading:
        raise OptionError(loading[0], f"{loading} apply when a model is loaded "
                                      "(LLMEngine.from_pretrained), not to a model already built")
    return decide_engine_config(model, check_options(options))


def decide_engine_config(model, settings: dict) -> EngineConfig:
    """The EngineConfig for `model` from checked settings (`check_options`): every start-up
    placeholder (None, "auto") decided. warmup None: compile at start on an accelerator, lazily on
    the CPU. compilation_cache_dir None: the user's cache directory. On a mesh, preemption "auto"
    means recompute (swapping knows one device's cache). matmul_precision "auto": the model's own
    (highest for float32 parameters, default for 16-bit ones).
    """
    tensor_parallel_size = settings["tensor_parallel_size"]
    if parallel.mesh_size(model.mesh) != tensor_parallel_size:
        raise ValueError(f"tensor_parallel_size={tensor_parallel_size} but the model is split "
                         f"over {parallel.mesh_size(model.mesh)} device(s): build it with "
                         "load_model(..., mesh=jpaged.parallel.make_mesh(n))")
    preemption_mode = settings["preemption_mode"]
    if model.mesh is not None:
        if preemption_mode == "swap":
            raise ValueError("preemption_mode='swap' needs a single-device engine; this model "
                             "is built on a mesh")
        preemption_mode = "recompute"
    model_config = model.config
    max_model_len = settings["max_model_len"] or model_config.max_model_len
    if max_model_len > model_config.max_model_len:
        raise ValueError(f"max_model_len={max_model_len} exceeds the model's limit "
                         f"{model_config.max_model_len} (max_position_embeddings)")
    block_size, max_num_seqs = settings["block_size"], settings["max_num_seqs"]
    max_num_batched_tokens = settings["max_num_batched_tokens"] or max(2048, block_size)
    kv_dtype = (model.dtype.name if settings["kv_cache_dtype"] == "auto"
                else normalize_dtype(settings["kv_cache_dtype"]))
    matmul_precision = (model.matmul_precision if settings["matmul_precision"] == "auto"
                        else settings["matmul_precision"])
    if settings["batch_invariant"]:
        try:
            check_batch_invariant(model_config, True)
        except ValueError as error:
            raise OptionError("batch_invariant", str(error)) from None
        backend, interpret = "batch_invariant", False
    else:
        backend, interpret = choose_attention_backend(
            settings["attention_backend"], model_config, dtype=model.dtype, kv_dtype=kv_dtype,
            block_size=block_size)
    num_kv_blocks = settings["num_kv_blocks"] or size_kv_pool(
        model_config, block_size=block_size, kv_dtype=kv_dtype, max_num_seqs=max_num_seqs,
        max_model_len=max_model_len, max_num_batched_tokens=max_num_batched_tokens,
        utilization=settings["gpu_memory_utilization"], mesh=model.mesh)
    warmup = settings["warmup"]
    return EngineConfig(
        num_kv_blocks=num_kv_blocks, block_size=block_size, max_num_seqs=max_num_seqs,
        max_model_len=max_model_len, max_num_batched_tokens=max_num_batched_tokens,
        seed=settings["seed"], kv_dtype=kv_dtype, matmul_precision=matmul_precision,
        attention_backend=backend, interpret=interpret,
        num_scheduler_steps=settings["num_scheduler_steps"],
        async_scheduling=settings["async_scheduling"], async_depth=settings["async_depth"],
        warmup=jax.default_backend() != "cpu" if warmup is None else warmup,
        strict_compilation=settings["strict_compilation"],
        compilation_cache_dir=(compile_cache.default_directory()
                               if settings["compilation_cache_dir"] is None
                               else settings["compilation_cache_dir"]),
        enable_prefix_caching=settings["enable_prefix_caching"],
        preemption_mode=preemption_mode, swap_space=settings["swap_space"],
        logprobs_mode=settings["logprobs_mode"], batch_invariant=settings["batch_invariant"],
        tensor_parallel_size=tensor_parallel_size)


def engine_model(model, config: EngineConfig):
    """The model as an engine of `config` runs it: at config.matmul_precision, batch-invariant or
    not (a copy sharing the parameters when the model's own settings differ; the caller's model
    stays as it was). Both are part of the model's graph, hence of every program's key: two
    settings never share a compiled or stored program."""
    return with_matmul_precision(model, config.matmul_precision, config.batch_invariant)


def activation_reserve_bytes(model_config, max_num_batched_tokens, max_num_seqs) -> int:
    """Peak bytes of one step's temporaries, an upper estimate in float32: per token the
    residual stream, q/k/v, attention output and the MLP's three intermediate-size tensors; per
    row of logits the logits and the sampler's sort buffers (x4); plus fixed slack. Rows of
    logits: a sampled row per sequence, or a step's scored prompt positions (prompt logprobs,
    `score`: at most SCORED_POSITIONS_PER_STEP, the scheduler's cap): the larger count. A
    mixture of experts' MLP holds each token's k rows (`jpaged.models.moe`)."""
    hidden, inter = model_config.hidden_size, model_config.intermediate_size
    qkv = (model_config.num_attention_heads + 2 * model_config.num_key_value_heads) * \
        model_config.head_dim
    mlp = 3 * inter
    experts = model_config.experts
    if experts is not None:   # each token's k rows: gathered input, gate/up, hidden, output
        mlp = max(mlp, experts.num_local_experts + experts.num_experts_per_tok * (
            2 * hidden + 3 * experts.moe_intermediate_size))
    per_token = 4 * (4 * hidden + 2 * qkv + mlp)
    scored = min(max_num_batched_tokens, SCORED_POSITIONS_PER_STEP)
    logits = 4 * 4 * max(max_num_seqs, scored) * model_config.vocab_size
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

"""Engine options: the one table of every setting `LLM(...)`, `LLMEngine.from_pretrained(...)` and
`python -m jpaged.serve` accept (vLLM's names), their checks, and the resolved `EngineConfig`.

Everything else is derived from `OPTIONS`: the server's flags (`jpaged.serve.cli`), the options
part of `LLM`'s docstring, README's options table (`markdown_table`, kept equal by a test) and the
defaults of `EngineConfig`. A low layer: it imports no engine, scheduler, model or kernel code.
"""

import dataclasses
import math
import os
import textwrap
from collections.abc import Callable, Mapping
from typing import Any

from jpaged.config import DTYPE_BYTES, normalize_dtype

ATTENTION_BACKENDS = ("auto", "reference", "pallas_gpu", "pallas_mosaic_gpu", "pallas_tpu",
                      "batch_invariant")
PREEMPTION_MODES = ("auto", "swap", "recompute")
# What CompletionOutput.logprobs report (vLLM's names; jpaged.sampling.sample applies them).
LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")
# What jpaged.models.loader reads; tests/test_config.py keeps the loader's own copy equal to this.
LOAD_FORMATS = ("auto", "dummy")
# jax.lax.Precision's names for the model's matmuls (jpaged.models.layers.DOT_PRECISIONS, which
# tests/test_config.py keeps equal to these), and "auto": the model's own (by its dtype).
MATMUL_PRECISIONS = ("auto", "highest", "high", "default")
# Options that load a model (from_pretrained); from_model, given a built model, refuses them.
LOADING_OPTIONS = ("dtype", "load_format", "devices", "enable_expert_parallel")


class OptionError(ValueError):
    """A bad option value or combination; `option` names the option (the server: its flag)."""

    def __init__(self, option: str, message: str):
        super().__init__(message)
        self.option = option


@dataclasses.dataclass(frozen=True)
class Option:
    """One engine option.

    check(value) returns what is wrong with a value ("must be ..."), or None; it never sees the
    None an option with default None accepts. is_decided_at_start: the default (None or "auto")
    is a placeholder that the builder replaces from the model, the device or the platform, so an
    EngineConfig never holds it.
    """
    name: str                  # vLLM's name; the flag is --name-with-dashes
    type: type                 # int, float, bool, str or list: the flag's type, the docs' type
    default: Any
    help: str
    check: Callable[[Any], str | None] | None = None
    choices: tuple | None = None
    is_decided_at_start: bool = False
    is_keyword: bool = True    # accepted by LLM(...) / LLMEngine.from_pretrained(...)
    is_flag: bool = True       # a flag of python -m jpaged.serve
    off_flag: str | None = None  # a second flag that sets the option to False

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def problem(self, value, *, is_resolved: bool = False) -> str | None:
        """What is wrong with `value`, or None. is_resolved: an EngineConfig's value."""
        if is_resolved and self.is_decided_at_start and value == self.default:
            return "must be decided before the engine is built (build_engine_config does)"
        if value is None and self.default is None:
            return None
        if self.choices is not None and value not in self.choices:
            return f"must be one of {self.choices}"
        return self.check(value) if self.check else None


# ---- checks: each returns what is wrong, or None ------------------------------------------------
def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value))


def positive_int(value):
    return None if _is_int(value) and value >= 1 else "must be a positive int"


def pool_size(value):
    if not _is_int(value) or value < 2:
        return "must be an int of at least 2 (one block is the sink)"
    return None


def non_negative_int(value):
    return None if _is_int(value) and value >= 0 else "must be a non-negative int"


def boolean(value):
    return None if isinstance(value, bool) else "must be True or False"


def fraction(value):
    return None if _is_number(value) and 0 < value <= 1 else "must be a number in (0, 1]"


def gibibytes(value):
    return None if _is_number(value) and value >= 0 else "must be a non-negative number of GiB"


def dtype_name(value):
    if value == "auto":
        return None
    try:
        normalize_dtype(value)
    except ValueError:
        return f"must be 'auto' or one of {sorted(DTYPE_BYTES)} (or bf16, fp16, fp32)"
    return None


def directory(value):
    return None if isinstance(value, (str, os.PathLike)) else "must be a directory path"


def directory_or_off(value):
    return None if value is False else directory(value) and "must be a directory path or False"


def device_list(value):
    return None if isinstance(value, (list, tuple)) and value else \
        "must be a non-empty list of jax devices"


# ---- the table ----------------------------------------------------------------------------------
OPTIONS: tuple[Option, ...] = (
    Option("dtype", str, "auto", "weight dtype: auto (the config's torch_dtype), float32, "
           "bfloat16 or float16", dtype_name, is_decided_at_start=True),
    Option("load_format", str, "auto", "auto: the weights in the model directory (safetensors or "
           "an orbax checkpoint/); dummy: random weights of the config's shapes (the directory "
           "needs only config.json, plus tokenizer.json for text), for benchmarks",
           choices=LOAD_FORMATS),
    Option("block_size", int, 16, "tokens per KV-cache block", positive_int),
    Option("num_kv_blocks", int, None, "KV blocks in the pool, the sink block included; fixes the "
           "pool exactly (None: sized from gpu_memory_utilization)", pool_size,
           is_decided_at_start=True),
    Option("gpu_memory_utilization", float, 0.9, "fraction of accelerator memory for weights + KV "
           "cache + activations: the pool gets what is left after the weights and an activation "
           "estimate (a ValueError at start if nothing fits, never an out-of-memory error later)",
           fraction),
    Option("max_num_seqs", int, 256, "most sequences in one batch", positive_int),
    Option("max_model_len", int, None, "longest prompt + output (None: the model's limit)",
           positive_int, is_decided_at_start=True),
    Option("max_num_batched_tokens", int, None, "most tokens in one step (None: max(2048, "
           "block_size))", positive_int, is_decided_at_start=True),
    Option("seed", int, 0, "seed for requests that give none", non_negative_int),
    Option("attention_backend", str, "auto", "auto: the Pallas kernels on GPU/TPU, the jnp "
           "reference on CPU; pallas_mosaic_gpu: pallas_gpu with the Hopper (Mosaic GPU) prefill "
           "kernel; the Pallas backends run in interpret mode on a CPU; batch_invariant: the "
           "batch_invariant mode's attention (auto picks it in that mode, and only there)",
           choices=ATTENTION_BACKENDS, is_decided_at_start=True),
    Option("kv_cache_dtype", str, "auto", "KV-cache dtype (auto: the weight dtype)", dtype_name,
           is_decided_at_start=True),
    Option("matmul_precision", str, "auto", "precision of the model's float32 matmuls, "
           "attention's included (jax.lax.Precision's names): highest (full float32, as torch "
           "computes them); high or default (TF32 on a GPU: faster, ~1e-3 relative error, "
           "enough to change greedy tokens; fewer bf16 passes on a TPU); auto: highest for a "
           "float32 model, default for a bfloat16/float16 one",
           choices=MATMUL_PRECISIONS, is_decided_at_start=True),
    Option("batch_invariant", bool, False, "bitwise-reproducible numbers: a request's logits, "
           "logprobs and seeded tokens do not change with what else is batched, how its prompt "
           "is chunked, prefix-cache hits, preemption or num_scheduler_steps, and equal "
           "jpaged.models.sequence_logprobs (the training forward); every row-wise op has one "
           "computation per row (on a GPU one kernel launch each), every matmul one fixed tiling "
           "and attention one key order (the trace 1.25x slower on an H100; not for "
           "mixture-of-experts models)", boolean),
    Option("num_scheduler_steps", int, 1, "decode steps run on the device per scheduler step "
           "(multi-step decoding); a waiting request joins at once", positive_int),
    Option("async_scheduling", bool, True, "start the next decode loop while the host processes "
           "the last one's tokens (off: the host waits for each loop before the next)", boolean),
    Option("async_depth", int, 2, "with async_scheduling, decode loops kept in flight behind the "
           "host", positive_int),
    Option("warmup", bool, None, "compile every bucket shape at start: a first request's "
           "programs before the engine is ready, the rest in the background (None: on an "
           "accelerator, not on the CPU)", boolean, is_decided_at_start=True),
    Option("strict_compilation", bool, False, "after warm-up, any new compilation is an error "
           "(needs warmup)", boolean),
    Option("compilation_cache_dir", str, None, "persist compiled programs here so a restart "
           "skips compiling (None: $XDG_CACHE_HOME/jpaged or ~/.cache/jpaged; False: no "
           "persistent cache). Programs are stored by what decides them (program, shapes, "
           "model, jpaged's source, jax install, host processor), so a warm start loads them "
           "without tracing; each entry is checked against its caller's shapes before use, "
           "and one that fails is dropped and compiled again; an edit to jpaged starts new "
           "entries. JAX's own process-wide cache is left as the user set it",
           directory_or_off,
           is_decided_at_start=True, off_flag="--no-compilation-cache"),
    Option("enable_prefix_caching", bool, True, "reuse the KV blocks of prompt prefixes already "
           "computed (automatic prefix caching)", boolean),
    Option("preemption_mode", str, "auto", "when KV blocks run out, a victim's blocks are swapped "
           "to host memory (swap), dropped and prefilled again later (recompute), or whichever "
           "the transfer and prefill rates (measured at the first preemption) say is cheaper "
           "for that victim (auto; recompute under tensor or data parallelism)",
           choices=PREEMPTION_MODES),
    Option("logprobs_mode", str, "raw_logprobs", "what the sampled tokens' logprobs report: "
           "log_softmax of the raw model logits (raw_logprobs), or of the distribution sampled "
           "from, after temperature and top-k/top-p/min-p (processed_logprobs)",
           choices=LOGPROBS_MODES),
    Option("swap_space", float, 4.0, "GiB of host memory for swapped-out KV blocks (0: never "
           "swap)", gibibytes),
    Option("tensor_parallel_size", int, 1, "devices each engine splits the model and KV cache "
           "over (Megatron-style heads and MLP columns; docs/parallelism.md)", positive_int),
    Option("enable_expert_parallel", bool, False, "a mixture-of-experts model's experts split "
           "whole over the tensor_parallel_size devices (expert parallelism) rather than each "
           "expert's intermediate dimension (tensor parallelism); a dense model ignores it",
           boolean),
    Option("devices", list, None, "the devices for tensor_parallel_size (None: the first of "
           "jax.devices())", device_list, is_decided_at_start=True, is_flag=False),
    Option("data_parallel_size", int, 1, "independent engine replicas on disjoint groups of "
           "tensor_parallel_size devices; each request goes to the replica with the most free KV "
           "blocks", positive_int, is_keyword=False),
)
BY_NAME: dict[str, Option] = {option.name: option for option in OPTIONS}


# ---- validation: the only place option values are checked ---------------------------------------
def check_option(name: str, value, *, is_resolved: bool = False):
    """Raise OptionError naming `name` if `value` is not a valid value for it."""
    problem = BY_NAME[name].problem(value, is_resolved=is_resolved)
    if problem:
        raise OptionError(name, f"{name} {problem}, got {value!r}")


def check_combinations(values: Mapping[str, Any]):
    """Rules between options; an option `values` lacks takes no part."""
    mode = values.get("preemption_mode")
    backend = values.get("attention_backend", "auto")
    if values.get("batch_invariant") and backend not in ("auto", "batch_invariant"):
        raise OptionError("attention_backend", f"batch_invariant=True runs its own attention: "
                          f"attention_backend must be 'auto', not {backend!r}")
    if backend == "batch_invariant" and not values.get("batch_invariant", False):
        raise OptionError("attention_backend", "attention_backend='batch_invariant' is the "
                          "batch_invariant mode's: set batch_invariant=True instead")
    if values.get("strict_compilation") and values.get("warmup") is False:
        raise OptionError("strict_compilation", "strict_compilation=True needs warmup=True "
                                                "(nothing is compiled yet)")
    if mode == "swap" and values.get("swap_space") == 0:
        raise OptionError("preemption_mode", "preemption_mode='swap' needs swap_space > 0 "
                                             "(GiB of host memory)")
    if mode == "swap" and (values.get("tensor_parallel_size", 1) > 1 or values.get(
            "data_parallel_size", 1) > 1 or values.get("devices") is not None):
        raise OptionError("preemption_mode", "preemption_mode='swap' needs a single-device "
                          "engine (swapping moves blocks of one device's cache): no "
                          "tensor_parallel_size > 1, data_parallel_size > 1 or devices")


def check_options(values: Mapping[str, Any], *, for_server: bool = False) -> dict:
    """All options of LLM(...) (for_server: of the server's flags), each the given value or the
    table's default, checked one by one and together; a bad or unknown one raises OptionError."""
    known = {o.name: o for o in OPTIONS if (o.is_flag if for_server else o.is_keyword)}
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise OptionError(unknown[0], f"unknown option(s) {unknown}; the options are "
                                      f"{sorted(known)}")
    settings = {name: values.get(name, option.default) for name, option in known.items()}
    for name, value in settings.items():
        check_option(name, value)
    check_combinations(settings)
    return settings


def _default(name: str):
    return BY_NAME[name].default


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Resolved engine settings: the table's options once the builder (`jpaged.engine.builder`)
    has decided the start-up ones: pool size, lengths, dtype, matmul precision, backend, warm-up.
    Checked when built, by the table's checks; the defaults of decided options stand in for
    tests and tools (they describe a float32 model)."""
    num_kv_blocks: int
    block_size: int = _default("block_size")
    max_num_seqs: int = _default("max_num_seqs")
    max_model_len: int = 2048
    max_num_batched_tokens: int = 2048
    seed: int = _default("seed")
    kv_dtype: str = "float32"          # kv_cache_dtype, decided
    matmul_precision: str = "highest"  # decided: the model's own for "auto" (a float32 one's)
    attention_backend: str = "reference"
    interpret: bool = False            # run the Pallas backend interpreted (on the CPU)
    num_scheduler_steps: int = _default("num_scheduler_steps")
    async_scheduling: bool = _default("async_scheduling")
    async_depth: int = _default("async_depth")
    warmup: bool = False
    strict_compilation: bool = _default("strict_compilation")
    compilation_cache_dir: str | bool = False  # decided: a directory, or False (off)
    enable_prefix_caching: bool = _default("enable_prefix_caching")
    preemption_mode: str = _default("preemption_mode")
    swap_space: float = _default("swap_space")
    logprobs_mode: str = _default("logprobs_mode")
    batch_invariant: bool = _default("batch_invariant")
    tensor_parallel_size: int = _default("tensor_parallel_size")

    def __post_init__(self):
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        values["kv_cache_dtype"] = values.pop("kv_dtype")
        if not isinstance(values.pop("interpret"), bool):
            raise OptionError("interpret", f"interpret must be True or False, got "
                                           f"{self.interpret!r}")
        for name, value in values.items():
            check_option(name, value, is_resolved=True)
        check_combinations(values)
        if self.tensor_parallel_size > 1 and self.preemption_mode != "recompute":
            raise OptionError("preemption_mode", "swapping moves blocks of a single-device "
                              "cache: with tensor_parallel_size > 1 preemption_mode must be "
                              "'recompute' (the builder decides 'auto' so)")


# ---- documentation derived from the table -------------------------------------------------------
def _type_text(option: Option, *, union: str) -> str:
    if option.choices is not None:
        return "{" + ", ".join(option.choices) + "}"
    name = option.type.__name__
    return f"{name}{union}None" if option.default is None else name


def _default_text(option: Option) -> str:
    return f'"{option.default}"' if isinstance(option.default, str) else repr(option.default)


def markdown_table() -> str:
    """README's options table: every option, its flag, type, default and meaning."""
    rows = ["| option | flag | type | default | meaning |", "|---|---|---|---|---|"]
    for option in OPTIONS:
        keyword = f"`{option.name}`" if option.is_keyword else "(server only)"
        flag = "(Python only)"
        if option.is_flag:
            flag = f"`--[no-]{option.flag[2:]}`" if option.type is bool else f"`{option.flag}`"
            if option.off_flag:
                flag += f", `{option.off_flag}`"
        meaning = option.help.replace("|", r"\|")   # a bare | would end the cell
        rows.append(f"| {keyword} | {flag} | {_type_text(option, union=' or ')} | "
                    f"`{_default_text(option)}` | {meaning} |")
    return "\n".join(rows) + "\n"


def options_doc(indent: str = "    ") -> str:
    """The keyword options as a docstring section (LLM's): name, type, default, then the help."""
    lines = []
    for option in OPTIONS:
        if option.is_keyword:
            lines.append(f"{indent}{option.name}: {_type_text(option, union=' | ')} = "
                         f"{_default_text(option)}")
            lines += textwrap.wrap(option.help, width=92, initial_indent=indent * 2,
                                   subsequent_indent=indent * 2)
    return "\n".join(lines) + "\n"

"""Every jax-version-dependent Pallas name, in one place (CPU runs jax 0.10.2, the H200 0.11.2).

Kernels import `pl`, `plgpu`, `pltpu` and the helpers below from here, never the moving names
directly, so a jax upgrade touches this file only. What moved between versions is listed in
/work/shared/ENV_NOTES.md; the notes below say which choice each helper makes and why.
"""

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as plgpu

try:  # Mosaic GPU: present in both versions, but only 0.11+ can interpret it on a CPU.
    from jax.experimental.pallas import mosaic_gpu as plmgpu
except ImportError:  # pragma: no cover - depends on the jax build
    plmgpu = None

JAX_VERSION = tuple(int(part) for part in jax.__version__.split(".")[:3])

__all__ = ["pl", "plgpu", "pltpu", "plmgpu", "JAX_VERSION", "triton_params", "tpu_params",
           "tpu_interpret", "mosaic_gpu_interpret", "mosaic_gpu_problem", "dot_f32",
           "float32_precision", "mosaic_tpu_precision",
           "bundled_gpu_paged_attention"]

MOSAIC_GPU_MIN_JAX = (0, 11, 0)  # the Mosaic GPU kernels here use 0.11's API (and interpreter)


def triton_params(num_warps, num_stages):
    """Triton compiler params. Always explicit: with None, 0.10.2 lowers to Mosaic GPU instead."""
    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def tpu_params(dimension_semantics):
    """Mosaic TPU compiler params (`pltpu.CompilerParams`, named TPUCompilerParams in old jax)."""
    return pltpu.CompilerParams(dimension_semantics=tuple(dimension_semantics))


def tpu_interpret(interpret):
    """The `interpret=` value for a TPU-style kernel.

    `pltpu.InterpretParams()` rather than `True`: it models SMEM/VMEM/DMA/semaphores, fills
    uninitialized scratch with NaN and raises IndexError on an out-of-range block-table read, where
    `interpret=True` would silently read another page.
    """
    return pltpu.InterpretParams() if interpret else False


def mosaic_gpu_interpret(interpret):
    """The `interpret=` value for a Mosaic GPU kernel: its own interpreter, which exists from 0.11.

    None (not False) means "compile": that is what `plmgpu.kernel` takes by default.
    """
    if not interpret:
        return None
    params = getattr(plmgpu, "InterpretGPUParams", None)
    if params is None:
        raise NotImplementedError(f"jax {jax.__version__} cannot interpret Mosaic GPU kernels "
                                  "(InterpretGPUParams arrived in jax 0.11)")
    return params()


def mosaic_gpu_problem():
    """None if this jax can build the Mosaic GPU kernels, else why not (`unsupported_reason`)."""
    if plmgpu is None:
        return "this jax build has no Pallas Mosaic GPU backend"
    if JAX_VERSION < MOSAIC_GPU_MIN_JAX:
        return (f"the Mosaic GPU kernels need jax >= {'.'.join(map(str, MOSAIC_GPU_MIN_JAX))}, "
                f"this is {jax.__version__}")
    return None


def float32_precision(precision=None):
    """The `lax.Precision` of matmuls on float32 operands: `precision` (a `lax.Precision` or one
    of its names, "highest", "high", "default"), or HIGHEST when None.

    HIGHEST by default because the GPU's DEFAULT for float32 is TF32 (10-bit mantissas, ~1e-3
    relative error), in XLA's dots and Triton's alike. Raises ValueError naming `precision`.
    """
    if precision is None:
        return lax.Precision.HIGHEST
    if isinstance(precision, (str, lax.Precision)):
        try:
            return lax.Precision(precision)
        except ValueError:
            pass
    raise ValueError(f"precision must be None, a jax.lax.Precision or one of 'highest', "
                     f"'high', 'default', got {precision!r}")


def mosaic_tpu_precision(precision=None):
    """`float32_precision` for a Mosaic TPU kernel, which lowers only DEFAULT and HIGHEST: HIGH
    (more than one bf16 pass asked for) gets HIGHEST."""
    precision = float32_precision(precision)
    return lax.Precision.HIGHEST if precision == lax.Precision.HIGH else precision


def dot_f32(a, b, *, transpose_b=False, precision=None):
    """a @ b (or a @ b.T) accumulated in float32, in any Pallas backend.

    `pl.dot` is gone in 0.11.2; `lax.dot_general` lowers on Triton, Mosaic TPU and the interpreter.
    float32 operands run at `float32_precision(precision)` (HIGHEST unless the caller asks for
    less: Triton's DEFAULT is TF32, ~3e-4 relative error); 16-bit operands at DEFAULT, whatever
    precision says (their products are exact in the float32 accumulator).
    """
    contract_b = 1 if transpose_b else 0
    precision = (float32_precision(precision) if a.dtype == jnp.float32
                 else lax.Precision.DEFAULT)
    return lax.dot_general(a, b, (((a.ndim - 1,), (contract_b,)), ((), ())),
                           precision=precision, preferred_element_type=jnp.float32)


def bundled_gpu_paged_attention():
    """JAX's own `ops.gpu.paged_attention` (deprecated in 0.11), or None. Benchmarks only."""
    try:
        from jax.experimental.pallas.ops.gpu import paged_attention as bundled
    except ImportError:  # pragma: no cover - removed in some future jax
        return None
    return bundled.paged_attention

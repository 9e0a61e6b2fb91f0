"""Pallas GPU kernels: paged decode, ragged prefill and cache writes (Triton), and a Hopper ragged
prefill (Mosaic GPU: wgmma, TMA) in `prefill_mgpu`."""

from pallas_kernels.gpu.prefill_mgpu import (
    paged_attention_prefill as paged_attention_prefill_mosaic_gpu)

__all__ = ["paged_attention_prefill_mosaic_gpu"]

"""Pallas TPU kernels (Mosaic TPU): paged decode and ragged prefill attention, pages fetched by DMA."""

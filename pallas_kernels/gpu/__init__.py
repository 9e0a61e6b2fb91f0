"""Pallas GPU kernels (Triton backend): paged decode and ragged prefill attention."""

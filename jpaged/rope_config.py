"""Rotary embedding settings (`RopeConfig`) and how a Hugging Face config.json spells them
(`read_ropes`: transformers 5's `rope_parameters` or the older `rope_theta` + `rope_scaling`)."""

import dataclasses
import math

import numpy as np


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding settings; `rope_type` is 'default', 'linear', 'llama3' or 'longrope'.

    longrope (Phi-3's "su"): frequencies divided by `short_factor` per pair, or by `long_factor`
    at positions >= original_max_position_embeddings, and cos/sin scaled by `attention_factor`.
    partial_rotary_factor < 1 rotates only the first int(D * factor) dims of each head (Phi-3).
    """
    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    short_factor: tuple = ()
    long_factor: tuple = ()
    attention_factor: float = 1.0
    partial_rotary_factor: float = 1.0

    def __post_init__(self):
        if self.rope_type not in ("default", "llama3", "linear", "longrope"):
            raise ValueError(f"rope_scaling type {self.rope_type!r} is not supported "
                             "(supported: default, linear, llama3, longrope)")
        if self.rope_type == "longrope" and (
                not self.short_factor or len(self.short_factor) != len(self.long_factor)):
            raise ValueError("rope_scaling type 'longrope' needs short_factor and long_factor "
                             f"of one length, got {len(self.short_factor)} and "
                             f"{len(self.long_factor)}")
        if not 0.0 < self.partial_rotary_factor <= 1.0:
            raise ValueError(f"partial_rotary_factor must be in (0, 1], got "
                             f"{self.partial_rotary_factor}")

    def rotary_dim(self, head_dim: int) -> int:
        """Rotated dims of each head (transformers' int(head_dim * partial_rotary_factor))."""
        return int(head_dim * self.partial_rotary_factor)

    def inv_frequencies(self, head_dim: int) -> np.ndarray:
        """Per-pair inverse frequencies [R/2] (R = rotary_dim), float64, with the configured
        scaling applied (longrope: the short factors)."""
        dim = self.rotary_dim(head_dim)
        inv_freq = 1.0 / (self.theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
        if self.rope_type == "linear":
            return inv_freq / self.factor
        if self.rope_type == "longrope":
            return inv_freq / np.asarray(self.short_factor, np.float64)
        if self.rope_type == "llama3":
            low_wavelen = self.original_max_position_embeddings / self.low_freq_factor
            high_wavelen = self.original_max_position_embeddings / self.high_freq_factor
            wavelen = 2 * np.pi / inv_freq
            scaled = np.where(wavelen > low_wavelen, inv_freq / self.factor, inv_freq)
            smooth = (self.original_max_position_embeddings / wavelen - self.low_freq_factor) / (
                self.high_freq_factor - self.low_freq_factor)
            smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
            is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
            return np.where(is_medium, smoothed, scaled)
        return inv_freq

    def long_inv_frequencies(self, head_dim: int) -> np.ndarray | None:
        """longrope's frequencies [R/2] for positions >= original_max_position_embeddings; None
        for the other types."""
        if self.rope_type != "longrope":
            return None
        dim = self.rotary_dim(head_dim)
        base = self.theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
        return 1.0 / (np.asarray(self.long_factor, np.float64) * base)

    @property
    def attention_scaling(self) -> float:
        """The factor transformers multiplies cos and sin by (longrope's attention factor)."""
        return self.attention_factor if self.rope_type == "longrope" else 1.0


def read_ropes(raw: dict, source: str, *, is_gemma3: bool,
               is_phi3: bool) -> tuple[RopeConfig, RopeConfig | None]:
    """(rope, local_rope): transformers 5 `rope_parameters` (Gemma 3: one dict per layer type)
    or the older top-level `rope_theta` + `rope_scaling` (+ Gemma 3's `rope_local_base_freq`).
    is_gemma3: the sliding layers have a rope of their own (else local_rope is None); is_phi3:
    Phi-3's older type names and partial rotation are accepted."""
    params = dict(raw.get("rope_parameters") or {})
    scaling = dict(raw.get("rope_scaling") or {})
    if not is_gemma3:
        return _read_rope({**scaling, **params}, raw, source, is_phi3=is_phi3), None
    if "full_attention" in params or "sliding_attention" in params:
        full = dict(params.get("full_attention") or {})
        local = dict(params.get("sliding_attention") or {})
    else:
        full, local = {**scaling, **params}, {}
    full.setdefault("rope_theta", raw["rope_theta"])
    local.setdefault("rope_theta", raw["rope_local_base_freq"])
    return (_read_rope(full, raw, source, is_phi3=is_phi3),
            _read_rope(local, raw, f"{source} (sliding layers)", is_phi3=is_phi3))


def _read_rope(merged: dict, raw: dict, source: str, *, is_phi3: bool) -> RopeConfig:
    """One RopeConfig from a merged rope_scaling / rope_parameters dict."""
    rope_type = merged.get("rope_type", merged.get("type", "default")) or "default"
    partial = float(merged.get("partial_rotary_factor", raw.get("partial_rotary_factor")) or 1.0)
    if is_phi3:
        rope_type = "longrope" if rope_type in ("su", "yarn") else rope_type  # Phi-3's old names
    elif partial != 1.0:
        raise ValueError(f"{source}: field 'partial_rotary_factor' must be 1.0, got {partial}")
    max_positions = int(raw.get("max_position_embeddings") or 2048)
    # Phi-3 keeps the pre-training length at the top level, and transformers prefers it there
    original = int(raw.get("original_max_position_embeddings")
                   or merged.get("original_max_position_embeddings")
                   or (max_positions if rope_type in ("llama3", "longrope") else 8192))
    factor = float(merged.get("factor") or (max_positions / original
                                            if rope_type == "longrope" else 1.0))
    try:
        return RopeConfig(
            theta=float(merged.get("rope_theta", raw.get("rope_theta", 10000.0))),
            rope_type=rope_type, factor=factor,
            low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
            high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=original,
            short_factor=tuple(float(f) for f in merged.get("short_factor") or ()),
            long_factor=tuple(float(f) for f in merged.get("long_factor") or ()),
            attention_factor=float(merged.get("attention_factor") or (
                _longrope_attention_factor(factor, original) if rope_type == "longrope" else 1.0)),
            partial_rotary_factor=partial,
        )
    except ValueError as err:
        raise ValueError(f"{source}: field 'rope_scaling': {err}") from err


def _longrope_attention_factor(factor: float, original_max_position_embeddings: int) -> float:
    """The cos/sin scale transformers derives when a longrope config gives none."""
    if factor <= 1.0:
        return 1.0
    return math.sqrt(1 + math.log(factor) / math.log(original_max_position_embeddings))

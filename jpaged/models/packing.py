"""Packed projections: q/k/v in one `qkv_proj`, gate/up in one `gate_up_proj`, and the map
between their rows and Hugging Face's separate tensors.

Why: one GEMM reads each packed weight. Kept apart on the H200 (8B shape, batch 64), XLA merged
the q/k/v products into one Triton GEMM (23.2 us per layer) or, with cuBLAS, concatenated the
weights again every step (a 26 us copy of 48 MB per layer) before a 15.8 us GEMM; packed, one
cuBLAS GEMM takes 16.2 us (benchmarks/results/roofline_8b_h200.md).

Row layout for P tensor-parallel shards (P = 1 without a mesh): the packed weight [R, E] is split
along R into P equal blocks, and block i holds what shard i needs, in order: its query heads'
rows, its kv heads' K rows, their V rows (qkv); or its slice of gate's rows, then the same slice
of up's (gate/up). The column-parallel split is then local, and reshaping the product to
[..., P, rows per shard] recovers each part. With more shards than kv heads, every shard holds
the K/V rows of the kv head it reads (`parallel.num_cache_kv_heads`), so those rows appear more
than once. Everything outside the model (checkpoints, transformers, the loader's checks) sees
Hugging Face's names; `Packing` converts both ways. A checkpoint that is already packed (Phi-3's
`qkv_proj` and `gate_up_proj`) is a Packing of one part.

Layout: the projections' weights (`is_transposed`) are stored [in, out], the transpose of the
checkpoints' (torch.nn.Linear's) [out, in], because cuBLAS reads them faster at decode batch
sizes. Measured on the H200 (8B shape, decode step at batch 64 / 128): 6.66 / 8.82 ms stored
[in, out] against 6.88 / 9.06 ms [out, in]; the down projection's split-K reduce went away at
64. Packing acts on the checkpoint layout (rows = output features); `to_checkpoint` and the
loader transpose at the boundary.
"""

import dataclasses
import functools

import numpy as np

# More runs than this (head dims reordered for partial rotation): one gather instead of slices.
MAX_RUNS = 64

# packed module name -> its Hugging Face parts, in the order their rows are packed
PACKED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


@dataclasses.dataclass(frozen=True)
class Packing:
    """How one packed parameter's rows come from its parts.

    parts: the parts' names (Hugging Face module or tensor names); part_rows: rows of each;
    rows: row r of the packed parameter is row rows[r] of the parts stacked along axis 0.
    """
    parts: tuple[str, ...]
    part_rows: tuple[int, ...]
    rows: tuple[int, ...]

    def pack(self, arrays):
        """The packed array from the parts (numpy or jax arrays, in `parts` order): slices of
        the parts concatenated when the rows come in a few contiguous runs (one or a few per
        shard unless the head dims are reordered), a row gather otherwise. On the H200 the
        gather ran at a few percent of the copy rate on device arrays; slices run at it."""
        runs = self.runs
        if len(runs) > MAX_RUNS:
            return _concatenate(arrays)[np.asarray(self.rows)]
        pieces = [arrays[part][begin:end] for part, begin, end in runs]
        return pieces[0] if len(pieces) == 1 else _concatenate(pieces)

    @functools.cached_property
    def runs(self) -> tuple[tuple[int, int, int], ...]:
        """(part, first row, end row) slices whose concatenation is the packed array: maximal
        runs of consecutive rows within one part."""
        starts = np.cumsum((0,) + self.part_rows)
        rows = np.asarray(self.rows)
        breaks = np.flatnonzero((np.diff(rows) != 1)
                                | np.isin(rows[1:], starts[1:-1])) + 1   # a part begins
        runs = []
        for chunk in np.split(rows, breaks):
            part = int(np.searchsorted(starts, chunk[0], side="right")) - 1
            runs.append((part, int(chunk[0] - starts[part]), int(chunk[-1] + 1 - starts[part])))
        return tuple(runs)

    def unpack(self, packed) -> dict:
        """{part name: its array}, each row taken from its first copy in `packed`."""
        rows = np.asarray(self.rows)
        first = np.full(sum(self.part_rows), -1)
        first[rows[::-1]] = np.arange(len(rows))[::-1]  # the last write wins: the first copy
        starts = np.cumsum((0,) + self.part_rows)
        return {name: packed[first[start:end]]
                for name, start, end in zip(self.parts, starts[:-1], starts[1:])}

    def renamed(self, parts: tuple[str, ...]) -> "Packing":
        return dataclasses.replace(self, parts=parts)

    def part_shapes(self, shape: tuple) -> dict[str, tuple]:
        """{part name: its shape}, for the packed array's `shape` (checkpoint layout)."""
        return {part: (rows, *shape[1:]) for part, rows in zip(self.parts, self.part_rows)}


@dataclasses.dataclass(frozen=True)
class Stacked:
    """A mixture of experts' parameter [X, rows, in] (checkpoint layout) from per-expert
    checkpoint tensors: expert x's rows are its parts packed by `inner` (gate and up), or its one
    part (down). parts: every expert's part names, expert by expert."""
    parts: tuple[str, ...]
    num_experts: int
    inner: Packing | None = None

    @property
    def parts_per_expert(self) -> int:
        return len(self.parts) // self.num_experts

    def pack(self, arrays):
        """The stacked array from the parts (numpy or jax arrays, in `parts` order)."""
        per = self.parts_per_expert
        experts = [arrays[x * per:(x + 1) * per] for x in range(self.num_experts)]
        rows = [parts[0] if self.inner is None else self.inner.pack(parts)
                for parts in experts]
        if all(isinstance(a, np.ndarray) for a in rows):
            return np.stack(rows)
        import jax.numpy as jnp
        return jnp.stack(rows)

    def unpack(self, stacked) -> dict:
        """{part name: its array}."""
        per, tensors = self.parts_per_expert, {}
        for x in range(self.num_experts):
            names = self.parts[x * per:(x + 1) * per]
            if self.inner is None:
                tensors[names[0]] = stacked[x]
            else:
                tensors.update(zip(names, self.inner.unpack(stacked[x]).values()))
        return tensors

    def part_shapes(self, shape: tuple) -> dict[str, tuple]:
        """{part name: its shape}, for the stacked array's `shape` [X, rows, in]."""
        if self.inner is None:
            return {part: tuple(shape[1:]) for part in self.parts}
        per_expert = list(self.inner.part_shapes(tuple(shape[1:])).values())
        return dict(zip(self.parts, per_expert * self.num_experts))


def anonymous(packed: "Packing | Stacked | None"):
    """`packed` with its parts named by position: what packing does without whose tensors it
    packs, so every layer's q/k/v (or gate/up, or experts) shares one program keyed on it."""
    if packed is None:
        return None
    names = tuple(str(index) for index in range(len(packed.parts)))
    if isinstance(packed, Stacked):
        return dataclasses.replace(packed, parts=names, inner=anonymous(packed.inner))
    return packed.renamed(names)


def _concatenate(arrays):
    if all(isinstance(a, np.ndarray) for a in arrays):
        return np.concatenate(arrays, axis=0)
    import jax.numpy as jnp
    return jnp.concatenate(arrays, axis=0)


def qkv_packing(num_heads: int, num_kv_heads: int, head_dim: int, shards: int, *,
                rotary_dim: int | None = None, fused: bool = False) -> Packing:
    """q [H*D], k [K*D], v [K*D] rows -> shards x (H/P query heads, C/P kv heads of K, of V),
    C = max(K, P) cache kv heads (a kv head repeated on every shard that reads it).

    rotary_dim R < D (partial rotation): each query and key head's dims are reordered so the
    rotated ones sit at [0, R/2) and [D/2, D/2 + R/2) (`layers.Rotary`); queries and keys share
    the order, so their dot products are unchanged. fused: one checkpoint part `qkv_proj`
    holding q, k and v stacked (Phi-3), instead of three.
    """
    cache_heads = max(num_kv_heads, shards)
    local_q, local_kv = num_heads // shards, cache_heads // shards
    heads = []  # row offsets of each head, in packed order
    for shard in range(shards):
        heads += [h for h in range(shard * local_q, (shard + 1) * local_q)]
        kv = [c * num_kv_heads // cache_heads
              for c in range(shard * local_kv, (shard + 1) * local_kv)]
        heads += [num_heads + g for g in kv] + [num_heads + num_kv_heads + g for g in kv]
    heads = np.asarray(heads)
    dims = np.tile(np.arange(head_dim), (len(heads), 1))               # [heads, D]
    is_rotated = heads < num_heads + num_kv_heads                      # queries and keys
    dims[is_rotated] = _rotary_order(head_dim, rotary_dim or head_dim)
    rows = (heads[:, None] * head_dim + dims).reshape(-1)
    part_rows = (num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim)
    if fused:
        return Packing(("qkv_proj",), (sum(part_rows),), tuple(rows.tolist()))
    return Packing(PACKED["qkv_proj"], part_rows, tuple(rows.tolist()))


def _rotary_order(head_dim: int, rotary_dim: int) -> np.ndarray:
    """[D] checkpoint dim at each packed dim: first halves of the rotated and the passed dims,
    then their second halves (identity when every dim rotates)."""
    half, rest = rotary_dim // 2, (head_dim - rotary_dim) // 2
    rotated, passed = np.arange(rotary_dim), rotary_dim + np.arange(head_dim - rotary_dim)
    return np.concatenate([rotated[:half], passed[:rest], rotated[half:], passed[rest:]])


def gate_up_shards(intermediate_size: int, shards: int) -> int:
    """Row blocks of gate/up: one per shard when the intermediate size divides, else 1 (the
    weight is then replicated, `parallel.param_spec`)."""
    return shards if intermediate_size % shards == 0 else 1


def gate_up_packing(intermediate_size: int, shards: int, *, fused: bool = False) -> Packing:
    """gate [F], up [F] rows -> blocks x (F/blocks of gate, the same of up). fused: one
    checkpoint part `gate_up_proj` holding gate then up (Phi-3)."""
    blocks = gate_up_shards(intermediate_size, shards)
    local = intermediate_size // blocks
    rows = tuple(np.arange(2 * intermediate_size).reshape(2, blocks, local).transpose(1, 0, 2)
                 .reshape(-1).tolist())
    if fused:
        return Packing(("gate_up_proj",), (2 * intermediate_size,), rows)
    return Packing(PACKED["gate_up_proj"], (intermediate_size, intermediate_size), rows)


def model_qkv_packing(config, shards: int) -> Packing:
    """The q/k/v packing of a `ModelConfig`'s attention (parts named as in its layer)."""
    return qkv_packing(config.num_attention_heads, config.num_key_value_heads, config.head_dim,
                       shards, rotary_dim=config.rope.rotary_dim(config.head_dim),
                       fused=config.has_fused_checkpoint)


def model_gate_up_packing(config, shards: int) -> Packing:
    return gate_up_packing(config.intermediate_size, shards, fused=config.has_fused_checkpoint)


# Mixture-of-experts checkpoints, per architecture: the module holding a layer's router and
# experts, and each expert's gate and up tensors and its down tensor
EXPERT_CHECKPOINT_NAMES = {"MixtralForCausalLM": ("block_sparse_moe", ("w1", "w3"), "w2"),
                           "Qwen3MoeForCausalLM": ("mlp", ("gate_proj", "up_proj"), "down_proj")}
# A mixture of experts' parameters (in the model as in transformers 5): `<layer>.mlp.gate.weight`
# (the router, [X, E]), `<layer>.mlp.experts.gate_up_proj` ([X, E, 2F]) and `...down_proj`
# ([X, F, E]); the experts' are stored [in, out] per expert, like the projections
EXPERT_PARAMETERS = ("experts.gate_up_proj", "experts.down_proj")


def expert_packing(name: str, config, shards: int) -> Packing | Stacked | None:
    """The checkpoint tensors of a mixture of experts' parameter `name` (a Stacked for the
    experts, a Packing of one renamed part for a router whose module the checkpoint names
    otherwise), or None for any other parameter."""
    layer, _, rest = name.partition(".mlp.")
    if config.experts is None or rest not in EXPERT_PARAMETERS + ("gate.weight",):
        return None
    block, gate_up, down = EXPERT_CHECKPOINT_NAMES[config.architecture]
    prefix = f"{layer}.{block}"
    if rest == "gate.weight":
        rows = config.experts.num_local_experts
        return None if block == "mlp" else Packing((f"{prefix}.gate.weight",), (rows,),
                                                   tuple(range(rows)))
    num_experts = config.experts.num_local_experts
    if rest == "experts.down_proj":
        return Stacked(tuple(f"{prefix}.experts.{x}.{down}.weight" for x in range(num_experts)),
                       num_experts)
    blocks = 1 if config.experts.expert_parallel else shards   # `parallel.expert_spec`
    inner = gate_up_packing(config.experts.moe_intermediate_size, blocks)
    return Stacked(tuple(f"{prefix}.experts.{x}.{part}.weight"
                         for x in range(num_experts) for part in gate_up), num_experts, inner)


def packing_for(name: str, config, shards: int) -> Packing | Stacked | None:
    """The Packing of parameter `name` (e.g. 'model.layers.0.self_attn.qkv_proj.weight') with
    its parts named as checkpoint tensors, a mixture of experts' `expert_packing`, or None for a
    parameter that is not packed."""
    if config.experts is not None and ".mlp." in name and (
            name.endswith(EXPERT_PARAMETERS) or name.endswith(".mlp.gate.weight")):
        return expert_packing(name, config, shards)
    module, _, kind = name.rpartition(".")
    prefix, _, layer = module.rpartition(".")
    if layer == "qkv_proj":
        packing = model_qkv_packing(config, shards)
    elif layer == "gate_up_proj":
        packing = model_gate_up_packing(config, shards)
    else:
        return None
    return packing.renamed(tuple(f"{prefix}.{part}.{kind}" for part in packing.parts))


def is_transposed(name: str) -> bool:
    """Whether parameter `name` is stored transposed from its checkpoint tensors (its last two
    axes swapped): the Linear projections' weights ('....o_proj.weight', '....qkv_proj.weight',
    ...) and the experts' ('....experts.gate_up_proj'), stored [in, out]."""
    return name.endswith("_proj.weight") or name.endswith(EXPERT_PARAMETERS)


def transposed(array):
    """`array` (numpy or jax) with its last two axes swapped: a parameter's layout from its
    checkpoint's or back (`is_transposed`)."""
    return array.swapaxes(-1, -2)


def transposed_shape(shape) -> tuple:
    return (*shape[:-2], shape[-1], shape[-2])


def checkpoint_shapes(name: str, shape: tuple, config, shards: int) -> dict[str, tuple]:
    """{checkpoint tensor name: shape} that parameter `name` of `shape` is built from."""
    shape = transposed_shape(shape) if is_transposed(name) else tuple(shape)
    packing = packing_for(name, config, shards)
    if packing is None:
        return {name: shape}
    return packing.part_shapes(shape)


def to_checkpoint(name: str, value, config, shards: int) -> dict:
    """{checkpoint tensor name: array} of parameter `name`'s value: transposed back to the
    checkpoint layout and unpacked into its parts."""
    value = transposed(value) if is_transposed(name) else value
    packing = packing_for(name, config, shards)
    return {name: value} if packing is None else packing.unpack(value)

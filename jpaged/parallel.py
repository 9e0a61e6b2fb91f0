"""Tensor parallelism on JAX's SPMD machinery: the device mesh, the partition specs of the
parameters and the KV cache, the per-shard wrapper the kernels run in, device groups for
data-parallel replicas, and the multi-host start.

One mesh axis, AXIS ("tp"). Parameters are split the Megatron way, by their names: the packed
qkv_proj and gate_up_proj are column-parallel (output features: whole attention heads, MLP
columns, ordered so each device's block is its own; see `jpaged.models.packing`), o and
down are row-parallel (input features), so each decoder block ends in a partial sum that XLA
all-reduces; no collective is written here. The embedding table is split along the hidden axis
(a local lookup, then an all-gather of [T, E]) and the LM head along the vocabulary (logits
all-gathered for sampling). Norms and biases of row-parallel layers are replicated; an axis that
does not divide by the mesh size stays replicated.

The KV cache [K, N, S, D] is split along K. With more devices than kv heads, the cache holds
`num_cache_kv_heads` = mesh size heads, each kv head repeated on mesh_size / K devices next to the
query heads that read it; each device's block of qkv_proj then holds its kv head's columns, and the
model writes every copy.
The kernels see only their device's heads: `per_shard` runs them under shard_map. The block
manager and the step inputs are replicated.

Without tensor parallelism there is no mesh (None) and nothing here touches the program, so the
single-device step compiles exactly as before.
"""

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

AXIS = "tp"
HEADS = PartitionSpec(None, AXIS)     # [T, H or K, D]: heads split
PAGES = PartitionSpec(AXIS)           # [K, N, S, D]: kv heads split
REPLICATED = PartitionSpec()

# Projection weights are stored [in, out] (`packing.is_transposed`); lm_head is [V, E].
_COLUMN = ("qkv_proj", "gate_up_proj")   # split the outputs: weight axis 1, bias axis 0
_ROW = ("o_proj", "down_proj")           # split the inputs: weight axis 0


def make_mesh(tensor_parallel_size: int = 1, devices=None) -> Mesh | None:
    """The mesh over `devices` (default: the first tensor_parallel_size of jax.devices()), or None
    for one device with no devices given: the single-device path, no mesh at all."""
    if isinstance(tensor_parallel_size, bool) or not isinstance(tensor_parallel_size, int) \
            or tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size must be a positive int, "
                         f"got {tensor_parallel_size!r}")
    if devices is None:
        if tensor_parallel_size == 1:
            return None
        available = jax.devices()
        if tensor_parallel_size > len(available):
            raise ValueError(f"tensor_parallel_size={tensor_parallel_size} but only "
                             f"{len(available)} devices are visible ({available[0].platform})")
        devices = available[:tensor_parallel_size]
    devices = list(devices)
    if len(devices) != tensor_parallel_size:
        raise ValueError(f"tensor_parallel_size={tensor_parallel_size} but {len(devices)} devices "
                         "were given")
    return Mesh(np.array(devices), (AXIS,))


def mesh_size(mesh: Mesh | None) -> int:
    return 1 if mesh is None else mesh.shape[AXIS]


def device_groups(data_parallel_size: int, tensor_parallel_size: int, devices=None) -> list:
    """Disjoint groups of tensor_parallel_size devices, one per data-parallel replica."""
    devices = list(jax.devices() if devices is None else devices)
    needed = data_parallel_size * tensor_parallel_size
    if data_parallel_size < 1 or needed > len(devices):
        raise ValueError(f"data_parallel_size={data_parallel_size} x tensor_parallel_size="
                         f"{tensor_parallel_size} needs {needed} devices; {len(devices)} visible")
    return [devices[i * tensor_parallel_size:(i + 1) * tensor_parallel_size]
            for i in range(data_parallel_size)]


def check_config(config, mesh: Mesh | None):
    """ValueError unless the model's heads, and its experts (whole, or along their intermediate
    dimension), split evenly over the mesh."""
    size = mesh_size(mesh)
    experts = config.experts
    if experts is not None and experts.expert_parallel and experts.num_local_experts % size:
        raise ValueError(f"tensor_parallel_size={size} with expert parallelism must divide "
                         f"num_local_experts={experts.num_local_experts}")
    if experts is not None and not experts.expert_parallel \
            and experts.moe_intermediate_size % size:
        raise ValueError(f"tensor_parallel_size={size} must divide the experts' intermediate "
                         f"size {experts.moe_intermediate_size} (or enable expert parallelism)")
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    if heads % size:
        raise ValueError(f"tensor_parallel_size={size} must divide num_attention_heads={heads}")
    if kv_heads % size and size % kv_heads:
        raise ValueError(f"tensor_parallel_size={size} must divide, or be a multiple of, "
                         f"num_key_value_heads={kv_heads}")


def num_cache_kv_heads(num_kv_heads: int, mesh: Mesh | None) -> int:
    """Kv heads the cache holds: every head once, or each repeated up to one per device."""
    return max(num_kv_heads, mesh_size(mesh))


def param_spec(name: str, shape, config, size: int) -> PartitionSpec:
    """The partition spec of the parameter with this name and shape on `size` devices."""
    module, _, kind = name.rpartition(".")
    layer = module.rpartition(".")[2]
    if layer == "experts":
        return expert_spec(kind, config.experts.expert_parallel)
    if layer == "gate_up_proj" and config.intermediate_size % size:
        return REPLICATED  # its rows are not in per-device blocks (packing.gate_up_shards)
    if layer in _COLUMN:
        spec = (AXIS,) if kind == "bias" else (None, AXIS)
    elif layer in _ROW and kind == "weight":
        spec = (AXIS, None)
    elif layer == "lm_head":
        spec = (AXIS, None)
    elif layer == "embed_tokens":
        spec = (None, AXIS)
    else:
        return REPLICATED
    if any(axis and dim % size for axis, dim in zip(spec, shape)):
        return REPLICATED
    return PartitionSpec(*spec)


def expert_spec(kind: str, expert_parallel: bool) -> PartitionSpec:
    """The spec of a mixture of experts' `gate_up_proj` [X, E, 2F] or `down_proj` [X, F, E]:
    split along X (expert parallelism), else column-parallel gate/up and row-parallel down
    along F (each expert's gate/up columns in per-device blocks, `packing.gate_up_packing`)."""
    if expert_parallel:
        return PartitionSpec(AXIS)
    return PartitionSpec(None, None, AXIS) if kind == "gate_up_proj" else PartitionSpec(None, AXIS)


def param_sharding(name: str, shape, config, mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, param_spec(name, shape, config, mesh_size(mesh)))


def cache_sharding(mesh: Mesh | None) -> NamedSharding | None:
    """Each layer's pages split along the kv-head axis (None: one device)."""
    return None if mesh is None else NamedSharding(mesh, PAGES)


def replicated(mesh: Mesh | None) -> NamedSharding | None:
    """Where the block manager and step inputs live (None: the default device)."""
    return None if mesh is None else NamedSharding(mesh, REPLICATED)


def per_shard(fn, mesh: Mesh, in_specs, out_specs):
    """fn run on each device's shard (shard_map). Kernels are local: no replication checks."""
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)


def initialize_multihost(coordinator_address: str, num_processes: int, process_id: int):
    """Join the processes of a multi-host run (one per host, each started the same way; see
    docs/parallelism.md). Afterwards jax.devices() lists every host's devices, and a mesh over them
    runs one program on all hosts (CPU hosts talk through gloo, GPUs through NCCL)."""
    jax.distributed.initialize(coordinator_address=coordinator_address,
                               num_processes=num_processes, process_id=process_id)

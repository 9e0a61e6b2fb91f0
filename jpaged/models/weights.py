"""Weights by their Hugging Face names, both ways, for in-place updates of a built model and
for building one from weights in memory (`model_from_weights`).

`new_parameters` turns a mapping {checkpoint tensor name: array} (numpy or jax, in the
checkpoint's layout and shape) or a checkpoint directory into new values of the model's
parameters, each with the shape, dtype and sharding of the one it replaces; `checkpoint_weights`
is the way back. Both reuse the loader's map between checkpoint names and parameters
(`loader.parameter_targets`: packed q/k/v and gate/up, transposed projections, tied
embeddings), so the two directions cannot drift apart.

Everything is checked before the first new value is made: a missing, extra, mis-shaped or
non-floating tensor raises ValueError naming it, and nothing on the device has changed. Floating
tensors of another precision are cast to the parameter's dtype, as the loader does.

Host arrays are transferred as they are, each tensor in its own layout and dtype (no host
copy, cast or packing), several in flight, then converted on the device like jax arrays. Jax
arrays stay on the device: packed, transposed, cast and resharded there by one jitted program per
parameter layout (never through the host); the caller's arrays are not consumed. A host tensor
that already is its parameter (same layout and dtype) goes straight into its shards.
"""

import collections
import functools
import os
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

from jpaged import parallel
from jpaged.models import packing
from jpaged.models.loader import checkpoint_stream, checkpoint_tensors, parameter_targets

# Host-to-device transfers in flight at once (threads), and how far (bytes of checkpoint
# tensors) they may run ahead of the parameter being converted: what runs ahead is extra device
# memory. On the H200, pageable transfers of an 8B model's tensors ran at 2.8 GB/s on one
# thread and 30 GB/s on four to sixteen; two parameters ahead (about 0.3 GB) kept the pipe
# half empty (14 GB/s).
TRANSFER_THREADS = 8
IN_FLIGHT_BYTES = 2 << 30


def parameter_names(treedef) -> list[str]:
    """The parameter name ('model.layers.0.self_attn.qkv_proj.weight') of each leaf of a flat
    model state (`device_step.split_model`'s leaves), in leaf order."""
    skeleton = jax.tree_util.tree_unflatten(treedef, range(treedef.num_leaves))
    names = []
    for path, _ in jax.tree_util.tree_flatten_with_path(skeleton)[0]:
        names.append(".".join(str(key.key) for key in path
                              if isinstance(key, jax.tree_util.DictKey)))
    return names


def checkpoint_weights(model) -> dict[str, jax.Array]:
    """{Hugging Face tensor name: array} of a model, with the names its checkpoint uses (Gemma
    3's multimodal checkpoints nest the text model under a prefix)."""
    prefix = model.config.checkpoint_prefix
    return {prefix + name: array for name, array in checkpoint_tensors(model).items()}


def new_parameters(model, weights, current: dict[str, jax.Array]):
    """Checks `weights` against `model` (its config, dtype and mesh), then returns an iterator
    of (parameter name, new value), each value with the shape, dtype and sharding of
    `current[name]`, made one at a time (the caller can drop the old value before the next is
    made, so device memory holds one extra parameter at most; from host arrays, plus the
    transfers of up to IN_FLIGHT_BYTES ahead).

    model: the model, or anything with its `config`, `dtype` and `mesh`.
    weights: a Mapping {Hugging Face tensor name: numpy or jax array} or a checkpoint
    directory (str or Path; safetensors or orbax, as `load_model` reads). Raises ValueError
    naming the first bad tensor, before anything is placed.
    """
    plan = _plan(model.config, model.dtype, model.mesh)
    targets = plan.targets
    if isinstance(weights, (str, os.PathLike)):
        if not Path(weights).is_dir():
            raise ValueError(f"weights: checkpoint directory not found: {weights}")
        tensors = checkpoint_stream(targets, Path(weights), model.config)
    else:
        tensors = _checked_mapping(targets, weights, model.config)
    # Only the old values' shapes, dtypes and shardings from here on: holding the arrays
    # would keep every replaced parameter alive until the last new one is made.
    return _placed(plan, tensors, {name: jax.ShapeDtypeStruct(old.shape, old.dtype,
                                                              sharding=old.sharding)
                                   for name, old in current.items()})


def model_from_weights(config, weights, *, dtype, mesh=None):
    """A model of `config` whose parameters are made from `weights` (a mapping {Hugging Face
    tensor name: numpy or jax array}, checked as `new_parameters` checks it), with no checkpoint
    on disk: jax arrays are converted where they live (or moved device to device), never
    through the host. Parameters go to the default device, or to their shards of `mesh`."""
    dtype = jnp.dtype(dtype)
    parallel.check_config(config, mesh)
    targets = parameter_targets(config, dtype, mesh)
    home = SingleDeviceSharding(jax.devices()[0])
    shapes = {}
    for name, (_, var, _) in targets.params.items():
        struct = var.get_value()
        sharding = (home if mesh is None
                    else parallel.param_sharding(name, struct.shape, config, mesh))
        shapes[name] = jax.ShapeDtypeStruct(struct.shape, struct.dtype, sharding=sharding)
    shell = _Shell(config, dtype, mesh)
    values = dict(new_parameters(shell, weights, shapes))
    state = nnx.from_flat_state([(path, var.replace(values[name]))
                                 for name, (path, var, _) in targets.params.items()])
    return nnx.merge(targets.graphdef, state)


class _Shell:
    """What `new_parameters` reads of a model (its config, dtype and mesh), for one not built
    yet."""

    def __init__(self, config, dtype, mesh):
        self.config, self.dtype, self.mesh = config, dtype, mesh


def _checked_mapping(targets, weights, config) -> list:
    """[(checkpoint name, array)] for every tensor the model needs, each checked for presence,
    type, shape and a floating dtype; the model's checkpoint prefix is optional on names."""
    if not hasattr(weights, "items"):
        raise ValueError("weights must be a mapping {tensor name: array} or a checkpoint "
                         f"directory, got {type(weights).__name__}")
    prefix = config.checkpoint_prefix
    named = {(name[len(prefix):] if prefix and name.startswith(prefix) else name): array
             for name, array in weights.items()}
    ignorable = {"lm_head.weight"} if config.tie_word_embeddings else set()
    extra = sorted(n for n in set(named) - set(targets.shapes)
                   if n not in ignorable and not n.endswith("rotary_emb.inv_freq"))
    if extra:
        raise ValueError(f"weights: tensor {extra[0]} is not a parameter of this "
                         f"{config.architecture} model ({len(extra)} unknown tensor(s))")
    missing = sorted(set(targets.shapes) - set(named))
    if missing:
        raise ValueError(f"weights: tensor {missing[0]} is missing ({len(missing)} missing "
                         "tensor(s))")
    for name, struct in sorted(targets.shapes.items()):
        _check_tensor(name, named[name], struct)
    return [(name, named[name]) for name in sorted(targets.shapes)]


def _check_tensor(name: str, array, expected: jax.ShapeDtypeStruct):
    if not isinstance(array, (np.ndarray, jax.Array)):
        raise ValueError(f"weights: tensor {name} is a {type(array).__name__}, expected a numpy "
                         "or jax array")
    if tuple(array.shape) != tuple(expected.shape):
        raise ValueError(f"weights: tensor {name} has shape {tuple(array.shape)}, the model's "
                         f"is {tuple(expected.shape)}")
    if not jnp.issubdtype(array.dtype, jnp.floating):
        raise ValueError(f"weights: tensor {name} has dtype {array.dtype}, expected floating "
                         f"point (the model's is {expected.dtype})")


def _placed(plan, tensors, current: dict):
    """(parameter name, value on the device) from checked (checkpoint name, array) pairs.

    Each host tensor is transferred as it is (its own layout and dtype, one `device_put`), on
    TRANSFER_THREADS threads, so that many transfers are in flight while earlier parameters
    are converted. The conversion (pack, transpose, cast, reshard) is the device path's
    program. Host transfers run at most IN_FLIGHT_BYTES ahead of the parameter yielded (and at
    least one parameter), so that much extra device memory at most is in use beyond the
    parameter being replaced.
    """
    home = _replicated(next(iter(current.values())).sharding)
    with ThreadPoolExecutor(TRANSFER_THREADS) as pool:
        ahead = collections.deque()   # (name, futures of its parts on the device, is_placed, bytes)
        in_flight = 0
        for name, parts in plan.targets.grouped(tensors):
            shardings, is_placed = plan.transfers(name, parts, current[name], home)
            size = sum(part.nbytes for part in parts if isinstance(part, np.ndarray))
            while ahead and in_flight + size > IN_FLIGHT_BYTES:
                *done, done_size = ahead.popleft()
                in_flight -= done_size
                yield plan.converted(*done, current)
            ahead.append((name, [_transfer(pool, part, sharding)
                                 for part, sharding in zip(parts, shardings)], is_placed, size))
            in_flight += size
        while ahead:
            yield plan.converted(*ahead.popleft()[:3], current)


def _transfer(pool, array, sharding) -> Future:
    """A future of `array` on `sharding`: a host array as it is (no host copy or cast); a jax
    array moved only when it lives on other devices or in another memory (e.g. pinned host
    memory: a direct transfer), else at once as it is (cast with the transpose, on the
    device)."""
    if isinstance(array, np.ndarray) or array.sharding.device_set != sharding.device_set \
            or array.sharding.memory_kind != sharding.memory_kind:
        return pool.submit(jax.device_put, array, sharding)
    done = Future()
    done.set_result(array)
    return done


class _Plan:
    """What converting a model's weights needs and keeps between updates: the loader's map
    (`parameter_targets`, slow to build: it traces the model abstractly) and each parameter's
    conversion program."""

    def __init__(self, config, dtype, mesh):
        self.targets = parameter_targets(config, dtype, mesh)
        self.programs = {}   # (parameter name, dtype, sharding) -> jitted conversion

    def transfers(self, name: str, parts, old, home) -> tuple[list, bool]:
        """([where each part goes before its conversion], is_placed). A parameter that is its
        one host part as it is (same layout and dtype: norms, embeddings) goes straight into
        its shards, with no program (is_placed). Otherwise an unpacked part goes to the
        parameter's shards (in the checkpoint layout when transposed), so no device receives
        more than its shards; packed parts are split along their rows over every device (the
        program regathers them over the devices' links rather than each device receiving
        whole copies from the host)."""
        packed, transposed = self.targets.params[name][2], packing.is_transposed(name)
        if packed is None and not transposed and isinstance(parts[0], np.ndarray) \
                and parts[0].dtype == old.dtype:
            return [old.sharding], True
        if packed is None:
            return [_checkpoint_sharding(old.sharding, transposed)], False
        return [_row_split(home, part.shape[0]) for part in parts], False

    def converted(self, name: str, futures, is_placed: bool, current: dict):
        """(name, the new value) once its parts are on the device."""
        parts = [future.result() for future in futures]
        if is_placed:
            return name, parts[0]
        return name, self.program(name, current[name])(*parts)

    def program(self, name: str, old):
        """The parameter's `_device_program`, found by name (a Packing is slow to hash); every
        layer's parameter of one layout shares one program (`packing.anonymous`)."""
        key = (name, old.dtype, old.sharding)
        if key not in self.programs:
            packed = packing.anonymous(self.targets.params[name][2])
            self.programs[key] = _device_program(packed, packing.is_transposed(name), old.dtype,
                                                 old.sharding)
        return self.programs[key]


@functools.lru_cache(maxsize=4)
def _plan(config, dtype, mesh) -> _Plan:
    return _Plan(config, jnp.dtype(dtype), mesh)


def _replicated(sharding):
    """Every device of `sharding`, holding a whole copy."""
    if isinstance(sharding, NamedSharding):
        return NamedSharding(sharding.mesh, PartitionSpec())
    return sharding


def _checkpoint_sharding(sharding, transposed: bool):
    """`sharding` of a parameter, for its tensor in the checkpoint layout."""
    if not transposed or not isinstance(sharding, NamedSharding):
        return sharding
    spec = tuple(sharding.spec) + (None,) * (2 - len(sharding.spec))
    return NamedSharding(sharding.mesh, PartitionSpec(*packing.transposed_shape(spec)))


def _row_split(home, rows: int):
    """`home`'s devices, each holding an equal block of rows (a whole copy each when the rows
    do not divide)."""
    if not isinstance(home, NamedSharding) or rows % home.mesh.size:
        return home
    return NamedSharding(home.mesh, PartitionSpec(home.mesh.axis_names))


@functools.lru_cache(maxsize=None)
def _device_program(packed, transposed: bool, dtype, sharding):
    """A parameter from its parts' device arrays in the checkpoint layout: packed (a `Packing`,
    or None for one part), transposed when stored so, cast, and laid out on `sharding` (the
    replaced parameter's), in one jitted program. The inputs are not donated: they are the
    caller's."""
    def convert(*parts):
        array = parts[0] if packed is None else packed.pack(parts)
        return (packing.transposed(array) if transposed else array).astype(dtype)
    return jax.jit(convert, out_shardings=sharding)

"""Weights by their Hugging Face names, both ways, for in-place updates of a built model.

`new_parameters` turns a mapping {checkpoint tensor name: array} (numpy or jax, in the
checkpoint's layout and shape) or a checkpoint directory into new values of the model's
parameters, each with the shape, dtype and sharding of the one it replaces; `checkpoint_weights`
is the way back. Both reuse the loader's map between checkpoint names and parameters
(`loader.parameter_targets`: packed q/k/v and gate/up, transposed projections, tied
embeddings), so the two directions cannot drift apart.

Everything is checked before the first new value is made: a missing, extra, mis-shaped or
non-floating tensor raises ValueError naming it, and nothing on the device has changed. Floating
tensors of another precision are cast to the parameter's dtype, as the loader does.

Host arrays are packed on the host and placed straight into their shards (one transfer per
parameter). Jax arrays stay on the device: packed, transposed, cast and resharded there by one
jitted program per parameter layout (never through the host; a parameter mixing host and jax
parts takes that path too); the caller's arrays are not consumed.
"""

import functools
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jpaged.models import packing
from jpaged.models.loader import (checkpoint_stream, checkpoint_tensors, parameter_targets,
                                  place_parameter)


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
    made, so device memory holds one extra parameter at most).

    weights: a Mapping {Hugging Face tensor name: numpy or jax array} or a checkpoint
    directory (str or Path; safetensors or orbax, as `load_model` reads). Raises ValueError
    naming the first bad tensor, before anything is placed.
    """
    targets = parameter_targets(model.config, model.dtype, model.mesh)
    if isinstance(weights, (str, os.PathLike)):
        if not Path(weights).is_dir():
            raise ValueError(f"weights: checkpoint directory not found: {weights}")
        tensors = checkpoint_stream(targets, Path(weights), model.config)
    else:
        tensors = _checked_mapping(targets, weights, model.config)
    return _placed(targets, tensors, current)


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


def _placed(targets, tensors, current: dict):
    """(parameter name, value on the device) from checked (checkpoint name, array) pairs."""
    for name, parts in targets.grouped(_casted(targets, tensors, current)):
        packed, sharding = targets.params[name][2], current[name].sharding
        if all(isinstance(part, np.ndarray) for part in parts):
            array = parts[0] if packed is None else packed.pack(parts)
            yield name, place_parameter(name, array, sharding)
        else:
            yield name, _device_program(packed, packing.is_transposed(name), current[name].dtype,
                                        sharding)(*parts)


def _casted(targets, tensors, current: dict):
    """Host arrays cast to their parameter's dtype; jax arrays moved onto the engine's devices
    when they live elsewhere (they are cast with the transpose, on the device)."""
    home = _replicated(next(iter(current.values())).sharding)
    for name, array in tensors:
        if isinstance(array, np.ndarray):
            yield name, array.astype(targets.shapes[name].dtype, copy=False)
        elif array.sharding.device_set != home.device_set:
            yield name, jax.device_put(array, home)
        else:
            yield name, array


def _replicated(sharding):
    """Every device of `sharding`, holding a whole copy."""
    if isinstance(sharding, NamedSharding):
        return NamedSharding(sharding.mesh, PartitionSpec())
    return sharding


@functools.lru_cache(maxsize=None)
def _device_program(packed, transposed: bool, dtype, sharding):
    """A parameter from its parts' device arrays in the checkpoint layout: packed (a `Packing`,
    or None for one part), transposed when stored so, cast, and laid out on `sharding` (the
    replaced parameter's), in one jitted program. The inputs are not donated: they are the
    caller's."""
    def convert(*parts):
        array = parts[0] if packed is None else packed.pack(parts)
        return (array.T if transposed else array).astype(dtype)
    return jax.jit(convert, out_shardings=sharding)

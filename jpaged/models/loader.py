"""Load a model directory without torch: config.json, tokenizer.json and the weights, either
Hugging Face safetensors (one file or shards plus an index) or an orbax-checkpoint folder
`checkpoint/` whose tree is the Hugging Face names split at the dots (`tools/train_tiny.py` writes
one; the built-in default model is one). Or, with load_format "dummy", no weights at all: random
parameters of the config's shapes, for benchmarks (vLLM's `--load-format dummy`).

Parameters are built straight from the tensors: the model is traced abstractly
(`nnx.eval_shape`, no memory), then every variable is filled from its checkpoint tensor(s), one
tensor at a time (a packed q/k/v or gate/up parameter once its parts are read, see
`jpaged.models.packing`), so host memory peaks at about one layer's tensors rather than a second
copy of the model. `checkpoint_tensors` goes the other way.
Every tensor's name, shape and dtype is checked against the config (from the safetensors
headers) before any is read, so a bad checkpoint fails before any device memory is taken. (An
orbax folder is restored in one call, so it peaks at a host copy of the model: fine for the
small models saved that way.)
"""

import dataclasses
import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy before safetensors reads it)
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec
from safetensors import SafetensorError, safe_open

from jpaged import parallel
from jpaged.config import ModelConfig, normalize_dtype
from jpaged.hf_config import read_eos_token_ids
from jpaged.models import packing
from jpaged.models.llama import LlamaForCausalLM
from jpaged.options import LOAD_FORMATS

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
ORBAX_DIR = "checkpoint"
DUMMY_SEED = 0  # fixed, so two dummy loads of one config give the same model
DUMMY_STDDEV = 0.02
# Checkpoint tensors that are safe to skip: rotary tables, which are recomputed from the config.
# (A tied model's saved `lm_head.weight`, a copy of the embedding, is skipped too.)
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")  # safetensors' names


def load_model(model_dir, *, dtype="auto", load_format="auto", mesh=None,
               expert_parallel: bool = False) -> tuple[LlamaForCausalLM, ModelConfig]:
    """(model, config) from a Hugging Face directory; dtype "auto" = the config's torch_dtype.

    load_format "auto" reads the directory's weights (safetensors or orbax); "dummy" reads only
    config.json and draws random weights (seed DUMMY_SEED, `random_model`) on the device: one
    jitted draw and cast per tensor, so nothing passes through the host and at most one tensor
    exists in float32 at a time.

    config.eos_token_ids merges config.json's and generation_config.json's `eos_token_id`.
    mesh: a tensor-parallel mesh (`jpaged.parallel.make_mesh`): every tensor goes straight to
    its shards (`parallel.param_spec`), never whole onto one device. expert_parallel: a mixture
    of experts' experts split whole over the mesh rather than along their intermediate dimension
    (`ExpertsConfig.expert_parallel`; a dense model ignores it).
    Raises FileNotFoundError naming a missing file, ValueError naming a bad field or tensor.
    """
    model_dir = Path(model_dir)
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")
    if not model_dir.is_dir():
        raise FileNotFoundError(f"model directory not found: {model_dir}")
    config = ModelConfig.from_json(model_dir / "config.json")
    config = dataclasses.replace(config, eos_token_ids=_merged_eos_ids(model_dir, config))
    if expert_parallel and config.experts is not None:
        config = dataclasses.replace(config, experts=dataclasses.replace(
            config.experts, expert_parallel=True))
    dtype = jnp.dtype(config.torch_dtype if dtype == "auto" else normalize_dtype(dtype))
    parallel.check_config(config, mesh)
    if load_format == "dummy":
        return random_model(config, dtype=dtype, mesh=mesh), config
    targets = _Targets(config, dtype, mesh)

    def place(name, array):
        """A host tensor (packed, in the checkpoint layout) straight into its shards."""
        shape = (packing.transposed_shape(array.shape) if packing.is_transposed(name)
                 else array.shape)
        return place_parameter(name, array, None if mesh is None
                               else parallel.param_sharding(name, shape, config, mesh))

    state = targets.assemble(checkpoint_stream(targets, model_dir, config), place)
    return nnx.merge(targets.graphdef, state), config


class _Targets:
    """Where each checkpoint tensor goes: the model's abstract parameters, the checkpoint names
    and shapes they are built from, and the assembly of packed parameters from their parts."""

    def __init__(self, config: ModelConfig, dtype, mesh):
        abstract = nnx.eval_shape(lambda: LlamaForCausalLM(config, dtype=dtype,
                                                           rngs=nnx.Rngs(0), mesh=mesh))
        self.graphdef, abstract_state = nnx.split(abstract)
        shards = parallel.mesh_size(mesh)
        self.params = {}   # parameter name -> (path, abstract variable, Packing or None)
        self.shapes = {}   # checkpoint name -> (shape, dtype)
        self.owner = {}    # checkpoint name -> parameter name
        for path, var in nnx.to_flat_state(abstract_state):
            name, struct = _param_name(path), var.get_value()
            self.params[name] = (path, var, packing.packing_for(name, config, shards))
            for part, shape in packing.checkpoint_shapes(name, struct.shape, config,
                                                         shards).items():
                self.shapes[part] = jax.ShapeDtypeStruct(shape, struct.dtype)
                self.owner[part] = name

    def grouped(self, tensors):
        """(parameter name, its parts' arrays in packing order) from (checkpoint name, array)
        pairs in any order: a parameter comes once all its parts have arrived (so memory holds
        at most the parts of the parameters in progress). Numpy or jax arrays."""
        pending = {}
        for part, array in tensors:
            name = self.owner[part]
            packed = self.params[name][2]
            if packed is None:
                yield name, [array]
                continue
            parts = pending.setdefault(name, {})
            parts[part] = array
            if len(parts) == len(packed.parts):
                del pending[name]
                yield name, [parts[p] for p in packed.parts]
        if pending:
            raise ValueError(f"parts of {sorted(pending)} never arrived")

    def packed(self, tensors):
        """(parameter name, array in the checkpoint layout), packed from its parts (`grouped`)."""
        for name, parts in self.grouped(tensors):
            packed = self.params[name][2]
            yield name, parts[0] if packed is None else packed.pack(parts)

    def assemble(self, tensors, place):
        """The filled nnx state from (checkpoint name, host array) pairs (`packed`), each
        parameter `place`d on the device as it is completed."""
        loaded = []
        for name, array in self.packed(tensors):
            path, var, _ = self.params[name]
            loaded.append((path, var.replace(place(name, array))))
        return nnx.from_flat_state(loaded)


def parameter_targets(config: ModelConfig, dtype, mesh=None) -> _Targets:
    """The map between a model's parameters and its checkpoint tensors (`_Targets`), for
    callers that move weights in and out of a model already built (`jpaged.models.weights`)."""
    return _Targets(config, jnp.dtype(dtype), mesh)


def checkpoint_tensors(model: LlamaForCausalLM) -> dict[str, jax.Array]:
    """{Hugging Face tensor name: array} of a model's parameters, packed ones split into their
    parts (e.g. 'model.layers.0.mlp.up_proj.weight'): what a checkpoint of it would hold."""
    shards = parallel.mesh_size(model.mesh)
    tensors = {}
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        tensors.update(packing.to_checkpoint(_param_name(path), var.get_value(), model.config,
                                             shards))
    return tensors


def random_model(config: ModelConfig, *, dtype, mesh=None, seed=DUMMY_SEED) -> LlamaForCausalLM:
    """A model of random weights (load_format "dummy"), drawn on the device tensor by tensor:
    matrices normal with std DUMMY_STDDEV (the model's own init scale), norms the identity
    (weights one; zero for Gemma's (1 + weight) norms), biases zero.

    A tensor's values depend only on the seed and its place in name order, not on the mesh (JAX's
    partitionable threefry), so every tensor_parallel_size serves the same model. With a mesh,
    each tensor is drawn by a program whose output is already sharded (jit out_shardings): every
    device draws only its shards, and a model larger than one device (a 70B in bf16) never
    exists whole on one device or on the host. (One jitted init of the whole model would do the
    same but compiles for minutes at 80 layers; per tensor, a few shapes compile once each:
    a draw program is keyed on shapes, dtype and layout, never on a tensor's name, so every
    layer shares its programs and their number does not grow with the depth.)
    """
    parallel.check_config(config, mesh)
    targets = _Targets(config, jnp.dtype(dtype), mesh)
    index = {part: i for i, part in enumerate(targets.shapes)}  # a tensor's place in name order
    root = jax.random.key(seed)
    loaded = []
    for name, (path, var, packed) in targets.params.items():
        is_norm = name.endswith("norm.weight")
        kind = ("zeros" if name.endswith(".bias") or (is_norm and config.is_gemma)
                else "ones" if is_norm else "normal")
        parts = (name,) if packed is None else packed.parts
        sharding = (None if mesh is None
                    else parallel.param_sharding(name, var.get_value().shape, config, mesh))
        draw = _draw_program(tuple(tuple(targets.shapes[p].shape) for p in parts),
                             jnp.dtype(var.get_value().dtype).name, kind,
                             packing.anonymous(packed), packing.is_transposed(name), sharding)
        keys = jnp.stack([jax.random.fold_in(root, index[p]) for p in parts])
        loaded.append((path, var.replace(draw(keys))))
    return nnx.merge(targets.graphdef, nnx.from_flat_state(loaded))


@functools.lru_cache(maxsize=None)
def _draw_program(shapes: tuple, dtype: str, kind: str, packed, transposed: bool, sharding):
    """The jitted draw of one parameter from one key per part (shapes, checkpoint layout),
    packed when `packed` is a Packing, then transposed when `transposed`, placed on `sharding`
    (None: the default device)."""
    def draw(keys):
        if kind == "normal":
            parts = [(DUMMY_STDDEV * jax.random.normal(keys[i], shape, jnp.float32)).astype(dtype)
                     for i, shape in enumerate(shapes)]
        else:
            parts = [(jnp.ones if kind == "ones" else jnp.zeros)(shape, dtype)
                     for shape in shapes]
        value = parts[0] if packed is None else packed.pack(parts)
        return packing.transposed(value) if transposed else value

    return jax.jit(draw) if sharding is None else jax.jit(draw, out_shardings=sharding)


@functools.lru_cache(maxsize=None)
def _transpose_program(sharding):
    """A jitted swap of the last two axes (`packing.transposed`) onto `sharding` (None: the
    default device), consuming its input: the device holds one projection weight twice at most
    while loading."""
    if sharding is None:
        return jax.jit(packing.transposed, donate_argnums=0)
    return jax.jit(packing.transposed, out_shardings=sharding, donate_argnums=0)


# A transposed parameter up to this size is transposed on the host: a device transpose is one
# program per shape, and tracing it and finding it in the compilation cache took longer on a
# warm start than a host copy of a small tensor (CPU, 2-layer 64-wide checkpoint: a third of
# LLM()'s 0.7 s went to placing its 15 parameters).
HOST_TRANSPOSE_BYTES = 16 << 20


def place_parameter(name: str, array, sharding):
    """Parameter `name` from its host array in the checkpoint layout (packed), on `sharding`
    (None: the default device, uncommitted): transposed when the parameter is stored so, on
    the host when small, else on the device, the checkpoint-layout copy consumed by the
    transpose."""
    if not packing.is_transposed(name):
        return jax.device_put(array, sharding)
    if array.nbytes <= HOST_TRANSPOSE_BYTES:
        return jax.device_put(np.ascontiguousarray(packing.transposed(array)), sharding)
    checkpoint_sharding = sharding
    if isinstance(sharding, NamedSharding):
        checkpoint_sharding = NamedSharding(
            sharding.mesh, PartitionSpec(*packing.transposed_shape(_padded(sharding.spec,
                                                                           array.ndim))))
    return _transpose_program(sharding)(jax.device_put(array, checkpoint_sharding))


def checkpoint_stream(targets: "_Targets", model_dir: Path, config: ModelConfig):
    """(checkpoint name, host array cast to the parameter dtype) for every tensor the model
    needs from a directory (safetensors or orbax). Every name, shape and dtype is checked now,
    before the first tensor is read or anything is placed: a ValueError names the bad one."""
    if _is_orbax(model_dir):
        return _orbax_stream(targets, model_dir / ORBAX_DIR, config)
    prefix = config.checkpoint_prefix
    tensor_files = _tensor_files(model_dir, prefix)
    _check_names(targets.shapes, tensor_files, config, model_dir)
    _check_headers(targets.shapes, tensor_files, prefix)
    return _read_tensors(targets, tensor_files, prefix)


def _padded(spec, ndim: int) -> tuple:
    return tuple(spec) + (None,) * (ndim - len(spec))


def load_tokenizer(model_dir):
    """The `tokenizers.Tokenizer` from tokenizer.json, or None when the directory has none."""
    import tokenizers

    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        return None
    try:
        return tokenizers.Tokenizer.from_file(str(path))
    except Exception as err:  # tokenizers raises a bare Exception on a malformed file
        raise ValueError(f"{path}: cannot be read as a tokenizer ({err})") from err


def _param_name(path) -> str:
    """nnx state path ('model', 'layers', 0, 'mlp', 'up_proj', 'weight') -> HF tensor name."""
    return ".".join(str(part) for part in path)


def _merged_eos_ids(model_dir: Path, config: ModelConfig) -> tuple:
    path = model_dir / "generation_config.json"
    if not path.is_file():
        return config.eos_token_ids
    try:
        generation_eos = read_eos_token_ids(json.loads(path.read_text()).get("eos_token_id"))
    except (json.JSONDecodeError, TypeError, ValueError) as err:
        raise ValueError(f"{path}: cannot read eos_token_id ({err})") from err
    return tuple(dict.fromkeys(config.eos_token_ids + generation_eos))


def _tensor_files(model_dir: Path, prefix: str = "") -> dict[str, Path]:
    """Every checkpoint tensor name under `prefix` (the name after it) -> the safetensors file
    holding it."""
    index_path = model_dir / INDEX_FILE
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise ValueError(f"{index_path}: not a safetensors index ({err!r})") from err
        for shard in sorted(set(weight_map.values())):
            if not (model_dir / shard).is_file():
                raise FileNotFoundError(f"shard {shard} named in {index_path} not found")
        return {name[len(prefix):]: model_dir / shard for name, shard in weight_map.items()
                if name.startswith(prefix)}
    single = model_dir / SINGLE_FILE
    if not single.is_file():
        raise FileNotFoundError(f"no {SINGLE_FILE}, {INDEX_FILE} or orbax {ORBAX_DIR}/ folder "
                                f"in {model_dir}")
    with _open(single, prefix) as reader:
        return {name: single for name in reader.keys()}


def _check_names(wanted: dict, tensor_files: dict, config: ModelConfig, model_dir: Path):
    missing = sorted(set(wanted) - set(tensor_files))
    if missing:
        raise ValueError(f"checkpoint {model_dir} is missing {len(missing)} tensor(s) the "
                         f"{config.architecture} config needs, e.g. {missing[:5]}")
    ignorable = {"lm_head.weight"} if config.tie_word_embeddings else set()
    unexpected = sorted(name for name in set(tensor_files) - set(wanted)
                        if name not in ignorable and not name.endswith(_IGNORED_SUFFIXES))
    if unexpected:
        raise ValueError(f"checkpoint {model_dir} has {len(unexpected)} tensor(s) the "
                         f"{config.architecture} config does not use (wrong config?), "
                         f"e.g. {unexpected[:5]}")


def _check_headers(wanted: dict, tensor_files: dict, prefix: str):
    """Every wanted tensor is in its file, floating point and of the shape the config implies,
    read from the files' headers alone: a bad tensor fails before any is placed on a device."""
    for file, names in _group_by_file(tensor_files, wanted).items():
        with _open(file, prefix) as reader:
            present = set(reader.keys())
            for name in names:
                if name not in present:
                    raise ValueError(f"{file}: tensor {name}, listed in the index, is not in it")
                header = reader.get_slice(name)
                shape, expected = tuple(header.get_shape()), tuple(wanted[name].shape)
                if shape != expected:
                    raise ValueError(f"{file}: tensor {name} has shape {shape}, the config "
                                     f"implies {expected}")
                if header.get_dtype() not in _FLOAT_DTYPES:
                    raise ValueError(f"{file}: tensor {name} has dtype {header.get_dtype()}, "
                                     f"expected one of {', '.join(_FLOAT_DTYPES)}")


def _read_tensors(targets: _Targets, tensor_files: dict, prefix: str):
    """Each file opened once, each tensor read and cast (their names, shapes and dtypes already
    checked: `_check_headers`)."""
    for file, names in _group_by_file(tensor_files, targets.shapes).items():
        with _open(file, prefix) as reader:
            for name in names:
                yield name, _read_tensor(reader, name, file, targets.shapes[name])


def _group_by_file(tensor_files: dict, wanted: dict) -> dict[Path, list[str]]:
    by_file: dict[Path, list[str]] = {}
    for name in sorted(wanted):
        by_file.setdefault(tensor_files[name], []).append(name)
    return by_file


def _open(file: Path, prefix: str = ""):
    try:
        return _Prefixed(safe_open(str(file), framework="numpy"), prefix)
    except (SafetensorError, OSError) as err:
        raise ValueError(f"{file}: not a readable safetensors file ({err})") from err


class _Prefixed:
    """A safetensors file seen through `prefix`: only the tensors named under it, by their names
    after it ("" sees everything as it is)."""

    def __init__(self, handle, prefix: str):
        self.handle, self.prefix = handle, prefix

    def __enter__(self):
        self.reader = self.handle.__enter__()
        return self

    def __exit__(self, *exc_info):
        return self.handle.__exit__(*exc_info)

    def keys(self) -> list[str]:
        return [name[len(self.prefix):] for name in self.reader.keys()
                if name.startswith(self.prefix)]

    def get_slice(self, name: str):
        return self.reader.get_slice(self.prefix + name)

    def get_tensor(self, name: str):
        return self.reader.get_tensor(self.prefix + name)


def _read_tensor(reader, name: str, file: Path, expected: jax.ShapeDtypeStruct) -> np.ndarray:
    """One tensor, shape-checked before it is read, cast to the parameter dtype on the host."""
    shape = tuple(reader.get_slice(name).get_shape())
    if shape != tuple(expected.shape):
        raise ValueError(f"{file}: tensor {name} has shape {shape}, the config implies "
                         f"{tuple(expected.shape)}")
    try:
        array = reader.get_tensor(name)
    except SafetensorError as err:
        raise ValueError(f"{file}: cannot read tensor {name} ({err})") from err
    if not jnp.issubdtype(array.dtype, jnp.floating):
        raise ValueError(f"{file}: tensor {name} has dtype {array.dtype}, expected floating point")
    return array.astype(expected.dtype, copy=False)


# ---- orbax-checkpoint folders ------------------------------------------------------------------
def _is_orbax(model_dir: Path) -> bool:
    """An orbax folder and no safetensors: safetensors win when both are present."""
    return ((model_dir / ORBAX_DIR).is_dir() and not (model_dir / SINGLE_FILE).is_file()
            and not (model_dir / INDEX_FILE).is_file())


def _orbax_stream(targets: _Targets, folder: Path, config: ModelConfig):
    """`checkpoint_stream` of an orbax checkpoint; names and shapes checked from its metadata
    before any tensor is read, dtypes once it is restored (one call), before any is yielded."""
    import orbax.checkpoint as ocp  # imported here: it is slow to import and most models are HF

    folder = folder.resolve()  # orbax finds no metadata under a relative path
    checkpointer = ocp.PyTreeCheckpointer()
    try:
        metadata = checkpointer.metadata(folder)
    except Exception as err:  # orbax raises several types (FileNotFoundError, ValueError, ...)
        raise ValueError(f"{folder}: not a readable orbax checkpoint ({err})") from err
    tree = getattr(metadata, "item_metadata", metadata)
    tree = getattr(tree, "tree", tree)
    if not tree:
        raise ValueError(f"{folder}: not a readable orbax checkpoint (no tensor metadata)")
    shapes = {".".join(str(k.key) for k in path): tuple(leaf.shape)
              for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}
    _check_names(targets.shapes, shapes, config, folder)
    for name, struct in sorted(targets.shapes.items()):
        expected = tuple(struct.shape)
        if shapes[name] != expected:
            raise ValueError(f"{folder}: tensor {name} has shape {shapes[name]}, the config "
                             f"implies {expected}")
    restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
    try:
        restored = checkpointer.restore(folder, restore_args=restore_args)
    except Exception as err:
        raise ValueError(f"{folder}: cannot read the orbax checkpoint ({err})") from err
    arrays = {".".join(str(k.key) for k in path): leaf
              for path, leaf in jax.tree_util.tree_flatten_with_path(restored)[0]}

    for name in sorted(targets.shapes):
        dtype = np.asarray(arrays[name]).dtype
        if not jnp.issubdtype(dtype, jnp.floating):
            raise ValueError(f"{folder}: tensor {name} has dtype {dtype}, expected floating point")
    return ((name, np.asarray(arrays[name]).astype(struct.dtype, copy=False))
            for name, struct in sorted(targets.shapes.items()))

"""Compiled programs kept between processes and found without tracing: the first place a warm
start looks, in front of JAX's persistent compilation cache.

JAX's cache is keyed on the lowered program, so every hit still traces and lowers it first: on
the H200 machine a warm start spent 26 s of thread time lowering the 14 programs a first request
needs (the step and decode programs, 4-6 s each, taking turns on the GIL) against 2.6 s loading
them. This store keys an executable on what determines it before tracing: the program's name and
compiler options (a jitted program's `compiler_options` attribute, set where it is made), its
static arguments, its arguments' shapes, dtypes and shardings, the model (config, dtype, graph
and parameter structure), the source of jpaged and its kernels, and the jax install and devices
(see `Store.key`). A hit deserializes the executable (`jax.experimental.serialize_executable`);
anything else (no entry, an unreadable or stale one) falls back to lowering, where JAX's cache
may still hit, and the compiled program is stored for next time.

Entries live in `<compilation cache directory>/executables/<source fingerprint>/`: an edit to the
code starts a new directory and the least recently used ones beyond KEEP_SOURCES are removed.
Entries are loaded from the user's own cache directory only, where jpaged wrote them: loading
one runs its code, like any compiled program, so the directory must not be shared with
untrusted writers.

The store is a cache, never a source of truth. An entry records its own key and the program's
input and output signature (tree structure, shapes, dtypes, shardings, donation); `load` checks
both against what the caller asks for, so an entry under the wrong name (a stale, colliding or
cross-written store) is dropped and compiled again instead of running the wrong program. A
stored program is also run once under watch before it is trusted (`programs.Programs`): one
that fails there is dropped, compiled and run again on its inputs.

Only freshly compiled executables are stored. One that JAX's own persistent cache supplied loses
its code when serialized again on XLA:CPU (it deserializes, and its first dispatch fails with
"Function ... not found"): a store left after several processes shared one cache directory
answered every request that way. So JAX's persistent cache is off while the store is in use
(`compile_cache.configure`).
"""

import functools
import hashlib
import os
import pickle
import platform
import shutil
import threading
import uuid
import warnings
from pathlib import Path

import jax
from jax.experimental import serialize_executable

KEEP_SOURCES = 4        # source fingerprints whose entries are kept
FORMAT = 2              # of an entry's payload: bumped when its fields change
_PACKAGES = ("jpaged", "pallas_kernels")


@functools.cache
def source_fingerprint() -> str:
    """sha256 of every Python file of jpaged and pallas_kernels (names and contents)."""
    digest = hashlib.sha256()
    root = Path(__file__).resolve().parents[2]
    for package in _PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            digest.update(str(path.relative_to(root)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


@functools.cache
def host_processor() -> str:
    """The host processor's model and instruction-set features. XLA:CPU compiles for the host it
    runs on, so a cache directory shared between machines (a network home) must never hand one
    machine code built for another; host code of accelerator programs is keyed on it too."""
    fields = {}
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                name, _, value = line.partition(":")
                name = name.strip()
                if name in ("model name", "flags", "Features", "CPU implementer", "CPU part"):
                    fields.setdefault(name, " ".join(sorted(value.split())))
                if not line.strip() and fields:   # the first processor is enough
                    break
    except OSError:
        pass
    return repr((platform.machine(), platform.processor(), sorted(fields.items())))


@functools.cache
def _install_fingerprint() -> str:
    """The jax install, its configuration, the devices programs are built for and the host."""
    import jaxlib

    devices = jax.devices()
    return repr((jax.__version__, jaxlib.__version__, jax.default_backend(),
                 [(d.id, d.device_kind) for d in devices], os.environ.get("XLA_FLAGS", ""),
                 jax.config.jax_enable_x64, jax.config.jax_default_matmul_precision,
                 host_processor()))


def _spec_fingerprint(spec) -> tuple:
    sharding = getattr(spec, "sharding", None)
    devices = getattr(sharding, "_device_assignment", None) or ()
    return (tuple(spec.shape), str(spec.dtype), repr(sharding), tuple(d.id for d in devices))


def _signature(compiled) -> tuple:
    """What a caller relies on of an executable: its input tree and each input's shape, dtype,
    sharding and donation, its output tree and each output's shape, dtype and sharding."""
    infos = jax.tree_util.tree_leaves(compiled.args_info)
    shardings = jax.tree_util.tree_leaves(compiled.input_shardings)
    inputs = tuple((tuple(info.shape), str(info.dtype), repr(sharding), bool(info.donated))
                   for info, sharding in zip(infos, shardings, strict=True))
    outputs = tuple((tuple(out.shape), str(out.dtype), repr(out.sharding))
                    for out in jax.tree_util.tree_leaves(compiled.out_info))
    return (repr(compiled.in_tree), inputs, repr(compiled.out_tree), outputs)


def _matches_specs(compiled, specs) -> bool:
    """Does the executable take exactly the arguments `specs` describe (tree, shapes, dtypes,
    and shardings where the caller's arrays have one)?"""
    leaves, treedef = jax.tree_util.tree_flatten((tuple(specs), {}))
    if treedef != compiled.in_tree:
        return False
    infos = jax.tree_util.tree_leaves(compiled.args_info)
    shardings = jax.tree_util.tree_leaves(compiled.input_shardings)
    for spec, info, sharding in zip(leaves, infos, shardings, strict=True):
        if (tuple(spec.shape), jax.numpy.dtype(spec.dtype)) != (tuple(info.shape),
                                                                 jax.numpy.dtype(info.dtype)):
            return False
        wanted = getattr(spec, "sharding", None)
        if wanted is not None and not wanted.is_equivalent_to(sharding, len(spec.shape)):
            return False
    return True


class Store:
    """Executables on disk by key. `context`: what else determines every program of one engine
    (its model: config, dtype, graph, parameter structure), as a string."""

    def __init__(self, directory, context: str):
        self.directory = Path(directory) / "executables" / source_fingerprint()[:24]
        self.context = context
        self._warned = threading.Event()
        self._usable = self._prepare()

    def _prepare(self) -> bool:
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            os.utime(self.directory)   # most recently used
            siblings = sorted((p for p in self.directory.parent.iterdir() if p.is_dir()),
                              key=lambda p: p.stat().st_mtime, reverse=True)
            for stale in siblings[KEEP_SOURCES:]:
                shutil.rmtree(stale, ignore_errors=True)
        except OSError as err:
            self._warn(f"cannot use {self.directory} ({type(err).__name__}: {err})")
            return False
        return True

    def key(self, program, specs, static: dict) -> str:
        """A digest of everything that decides the executable of program(*specs, **static)."""
        leaves, treedef = jax.tree_util.tree_flatten(specs)
        name = program_name(program)
        options = sorted(getattr(program, "compiler_options", {}).items())  # jit can't tell
        parts = (name, options, _install_fingerprint(), self.context, repr(treedef),
                 [_spec_fingerprint(leaf) for leaf in leaves],
                 sorted((k, _static_repr(v)) for k, v in static.items()))
        return hashlib.sha256(repr(parts).encode()).hexdigest()

    def load(self, key: str, specs):
        """The stored executable of `key` for arguments `specs`, or None: none stored, or one
        that cannot be used (unreadable, or not what it claims: another key's program, another
        signature than it recorded or than `specs` need), which is removed."""
        if not self._usable:
            return None
        path = self.directory / key
        try:
            payload = path.read_bytes()
        except OSError:
            return None
        try:
            entry = pickle.loads(payload)
            compiled = serialize_executable.deserialize_and_load(
                entry["executable"], entry["in_tree"], entry["out_tree"])
        except Exception as err:   # a torn, corrupt or incompatible entry: compile instead
            return self._drop(path, f"ignoring the unreadable stored program {path.name} "
                                    f"({type(err).__name__}: {err})")
        if entry.get("format") != FORMAT or entry.get("key") != key:
            return self._drop(path, f"ignoring the stale stored program {path.name} (it "
                                    f"records the key {str(entry.get('key'))[:16]}...)")
        if _signature(compiled) != entry["signature"] or not _matches_specs(compiled, specs):
            return self._drop(path, f"ignoring the stale stored program {path.name} "
                                    f"({entry.get('program')}: its signature is not the one "
                                    "asked for)")
        return compiled

    def remove(self, key: str, reason: str):
        """Drop `key`'s entry (one that failed when it ran), with one warning."""
        self._drop(self.directory / key, f"dropped the stored program {key[:16]}... ({reason})")

    def _drop(self, path: Path, message: str):
        self._warn(message)
        path.unlink(missing_ok=True)
        return None

    def save(self, key: str, compiled, program_name: str = "") -> bool:
        """Store `compiled` under `key` (atomically: a reader never sees half an entry), with
        its key and signature. False where it cannot be serialized (e.g. host callbacks) or
        written. `compiled` must come from the compiler, not from a cache (see the module's
        docstring)."""
        if not self._usable:
            return False
        try:
            serialized, in_tree, out_tree = serialize_executable.serialize(compiled)
            payload = pickle.dumps(dict(format=FORMAT, key=key, program=program_name,
                                        executable=serialized, in_tree=in_tree,
                                        out_tree=out_tree, signature=_signature(compiled)))
        except Exception:   # not serializable: compiled at every start
            return False
        temporary = self.directory / f".{key}.{uuid.uuid4().hex}"
        try:
            temporary.write_bytes(payload)
            temporary.replace(self.directory / key)
        except OSError as err:
            temporary.unlink(missing_ok=True)
            self._warn(f"cannot write to {self.directory} ({type(err).__name__}: {err})")
            return False
        return True

    def _warn(self, message: str):
        if not self._warned.is_set():
            self._warned.set()
            warnings.warn(f"jpaged program store: {message}; compiling instead", stacklevel=2)


def program_name(program) -> str:
    return f"{getattr(program, '__module__', '')}.{getattr(program, '__qualname__', '')}"


def _static_repr(value) -> str:
    """A static argument as text that is the same in every process (no addresses): objects
    that define `fingerprint` (the model) give it."""
    return getattr(value, "fingerprint", None) or repr(value)

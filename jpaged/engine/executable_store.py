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
"""

import functools
import hashlib
import os
import pickle
import shutil
import threading
import uuid
import warnings
from pathlib import Path

import jax
from jax.experimental import serialize_executable

KEEP_SOURCES = 4        # source fingerprints whose entries are kept
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
def _install_fingerprint() -> str:
    """The jax install, its configuration and the devices programs are built for."""
    import jaxlib

    devices = jax.devices()
    return repr((jax.__version__, jaxlib.__version__, jax.default_backend(),
                 [(d.id, d.device_kind) for d in devices], os.environ.get("XLA_FLAGS", ""),
                 jax.config.jax_enable_x64, jax.config.jax_default_matmul_precision))


def _spec_fingerprint(spec) -> tuple:
    sharding = getattr(spec, "sharding", None)
    devices = getattr(sharding, "_device_assignment", None) or ()
    return (tuple(spec.shape), str(spec.dtype), repr(sharding), tuple(d.id for d in devices))


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
        name = f"{getattr(program, '__module__', '')}.{getattr(program, '__qualname__', '')}"
        options = sorted(getattr(program, "compiler_options", {}).items())  # jit can't tell
        parts = (name, options, _install_fingerprint(), self.context, repr(treedef),
                 [_spec_fingerprint(leaf) for leaf in leaves],
                 sorted((k, _static_repr(v)) for k, v in static.items()))
        return hashlib.sha256(repr(parts).encode()).hexdigest()

    def load(self, key: str):
        """The stored executable of `key`, or None (none stored, or unreadable: then removed)."""
        if not self._usable:
            return None
        path = self.directory / key
        try:
            payload = path.read_bytes()
        except OSError:
            return None
        try:
            serialized, in_tree, out_tree = pickle.loads(payload)
            return serialize_executable.deserialize_and_load(serialized, in_tree, out_tree)
        except Exception as err:   # a torn, corrupt or incompatible entry: compile instead
            self._warn(f"ignoring the unreadable stored program {path.name} "
                       f"({type(err).__name__}: {err})")
            path.unlink(missing_ok=True)
            return None

    def save(self, key: str, compiled) -> bool:
        """Store `compiled` under `key` (atomically: a reader never sees half an entry). False
        where it cannot be serialized (e.g. host callbacks) or written."""
        if not self._usable:
            return False
        try:
            payload = pickle.dumps(serialize_executable.serialize(compiled))
        except Exception:   # not serializable: JAX's own cache still has it
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


def _static_repr(value) -> str:
    """A static argument as text that is the same in every process (no addresses): objects
    that define `fingerprint` (the model) give it."""
    return getattr(value, "fingerprint", None) or repr(value)

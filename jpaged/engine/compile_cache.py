"""The persistent compilation cache: where compiled programs are kept between processes (JAX's
persistent cache, in the user's cache directory by default), and turning it on or off.

The cache is a process-wide JAX setting: every engine in a process shares it, and the last engine
built decides the directory. Entries live in a subdirectory named after the jax version, the
backend and the device kind: JAX's own cache key already hashes the jaxlib version, the platform
and the devices, and the name keeps entries of different installs apart even where it would not
(the jax Python version is not in the key), and makes a stale directory easy to delete.
"""

import os
import uuid
import warnings
from pathlib import Path

import jax
from jax.experimental.compilation_cache import compilation_cache


def default_directory() -> Path:
    """$XDG_CACHE_HOME/jpaged, else ~/.cache/jpaged."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "jpaged"


def versioned_directory(directory) -> Path:
    """The subdirectory of `directory` this install's entries go to."""
    device = jax.devices()[0]
    kind = "".join(c if c.isalnum() or c in "-._" else "-" for c in device.device_kind)
    return Path(directory) / f"jax-{jax.__version__}-{device.platform}-{kind}"


def _writable(directory: Path) -> str | None:
    """None if files can be written in `directory` (made if missing), else why not."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / f".probe-{uuid.uuid4().hex}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        return f"{type(err).__name__}: {err}"
    return None


def configure(directory) -> Path | None:
    """Use the persistent cache under `directory` (False or None: no persistent cache). Returns
    the directory entries go to, or None when the cache is off. A directory that cannot be
    written turns the cache off with one warning; the engine then compiles as without it.

    Every program is cached, however small or quick to compile: JAX's thresholds (compile time,
    entry size) would skip the block operations and small steps, which together are most of a
    start's programs."""
    path = None
    if directory:
        path = versioned_directory(directory)
        problem = _writable(path)
        if problem:
            warnings.warn(f"the compilation cache directory {path} cannot be written "
                          f"({problem}); compiling without a persistent cache", stacklevel=3)
            path = None
    current = jax.config.jax_compilation_cache_dir
    wanted = None if path is None else str(path)
    if wanted != current:
        jax.config.update("jax_compilation_cache_dir", wanted)
        compilation_cache.reset_cache()   # JAX reads the directory once, at its first compile
    if path is not None:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    return path

"""The persistent compilation cache: where compiled programs are kept between processes (the
program store, `executable_store.py`, in the user's cache directory by default), and turning it
on or off.

Entries live in a subdirectory named after the jax version, the backend and the device kind:
the store's key holds all of these too, and the name keeps entries of different installs apart
and makes a stale directory easy to delete.
"""

import os
import uuid
import warnings
from pathlib import Path

import jax


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
    """The directory the program store keeps its entries in, under `directory` (False or None:
    no persistent cache), or None when the cache is off. A directory that cannot be written
    turns the cache off with one warning; the engine then compiles as without it.

    JAX's own persistent cache is not turned on: an executable it supplies cannot be stored
    again faithfully (`executable_store`'s docstring), and every program an engine compiles
    goes through the store. A process that turned it on itself keeps it; the store then never
    keeps an executable that came from it."""
    if not directory:
        return None
    path = versioned_directory(directory)
    problem = _writable(path)
    if problem:
        warnings.warn(f"the compilation cache directory {path} cannot be written "
                      f"({problem}); compiling without a persistent cache", stacklevel=3)
        return None
    return path

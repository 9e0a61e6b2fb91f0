"""Compiled programs by shape key: ahead-of-time lowering and compilation of the jitted device
programs, on a thread pool (warm-up in the background) or on demand, the executables that
dispatch calls, and the accounting (programs, compile seconds, persistent-cache hits).

A program is compiled once per key and engine: a dispatch whose program is still compiling on the
pool waits for that compile, it never starts a second one; a dispatch whose program is still
queued on the pool takes it and compiles it at once (a request arriving during warm-up never
waits behind the programs queued before its own). Executables are also shared between
engines of one process (the same program, static arguments and argument shapes), as jit's own
cache shared them before compilation moved ahead of time. XLA releases the GIL while it
compiles, so the pool's threads compile in parallel; tracing and lowering take turns on it.

An executable from the program store runs under watch the first time (`Programs.run`): the
inputs it donates are copied to the host first, and if it fails, its entry is dropped, the
program compiled and run again on the copies, so no request sees a bad entry.
"""

import atexit
import os
import queue
import threading
import time
from concurrent.futures import Future

import jax
import numpy as np

from jpaged.engine.executable_store import program_name

_SHARED: dict = {}                  # signature -> Future of an executable, process-wide
_SHARED_LOCK = threading.Lock()
_COMPILING = threading.local()      # this thread's persistent-cache hits; is it a pool thread

# Pool threads tracing and lowering at once. Lowering is Python holding the GIL (XLA's compile
# after it releases it): more threads lowering side by side go no faster, and each one more
# takes GIL time from the thread serving requests. A cold start on the H200 answered its first
# request in 0.42 s while 54 programs lowered behind it on 16 threads.
LOWERING_THREADS = 2
_LOWERING = threading.BoundedSemaphore(LOWERING_THREADS)

# The pool's threads yield the processor to the thread serving requests: compiles behind ready
# share the machine with a first request. CPU, 2 cores, LLM() with warm-up on an empty cache
# (6 starts each, medians): first generate 0.31 -> 0.25 s, ready 10.4 -> 9.7 s.
POOL_NICENESS = 10

# A stored program's first run keeps host copies of the inputs it donates, to run again on them
# if it fails, where those inputs are at most this large (the block-manager state always; the
# KV cache of small engines). A larger donation is not copied: a failure there loses the
# engine's device state, as any failed step does.
RECOVERABLE_BYTES = 256 * 2**20


_PROBE = "/jpaged/programs/listener_probe"
_LISTENING = threading.Lock()


def _count_cache_hit(event: str, **kwargs):
    if event == "/jax/compilation_cache/cache_hits":
        _COMPILING.hits = getattr(_COMPILING, "hits", 0) + 1
    elif event == _PROBE:
        _COMPILING.heard = True


def _listen_for_cache_hits():
    """Make sure `_count_cache_hit` hears JAX's events: another library may clear every JAX
    listener of the process (Tunix's metrics logger does when it closes), after which cache
    hits would go uncounted and the store would keep programs JAX's cache supplied. A probe
    event, heard in this thread or not, says whether the listener is still there."""
    _COMPILING.heard = False
    jax.monitoring.record_event(_PROBE)
    if _COMPILING.heard:
        return
    with _LISTENING:
        jax.monitoring.record_event(_PROBE)   # another thread may have registered it since
        if not _COMPILING.heard:
            jax.monitoring.register_event_listener(_count_cache_hit)


jax.monitoring.register_event_listener(_count_cache_hit)


class _Pool:
    """The process's compile threads, started on first use, POOL_NICENESS steps lower in priority
    than the process (where the system lets a thread set its own). Daemon threads: a process that is
    done exits without waiting for the programs still queued. At exit the queue is dropped and
    the compiles already running are waited for: a thread killed inside XLA's compiler aborts
    the process (exit status 134 for a script that was done)."""

    def __init__(self):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._closing = False
        self._idle = threading.Condition()
        self._unfinished = 0   # submitted and not yet done (queued or running)

    def submit(self, fn, *args):
        with self._lock:
            if self._closing:
                return
            if not self._threads:
                self._threads = [threading.Thread(target=self._work, daemon=True,
                                                  name=f"jpaged-compile-{index}")
                                 for index in range(os.cpu_count() or 1)]
                for thread in self._threads:
                    thread.start()
                atexit.register(self.close)
        with self._idle:
            self._unfinished += 1
        self._queue.put((fn, args))

    def wait_idle(self):
        """Block until every piece of work submitted so far has finished."""
        with self._idle:
            self._idle.wait_for(lambda: self._unfinished == 0)

    def close(self):
        """Drop the queued work, let each thread finish what it is running, and join them."""
        with self._lock:
            self._closing = True
            threads = self._threads
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
            self._done()
        for _ in threads:
            self._queue.put(None)
        for thread in threads:
            thread.join()

    def _work(self):
        _COMPILING.is_pool = True
        try:   # Linux: this thread's own nice value (and that of the compiler processes it starts)
            thread = threading.get_native_id()
            os.setpriority(os.PRIO_PROCESS, thread,
                           min(19, os.getpriority(os.PRIO_PROCESS, thread) + POOL_NICENESS))
        except (AttributeError, OSError):
            pass
        while True:
            work = self._queue.get()
            if work is None:
                return
            fn, args = work
            try:
                fn(*args)
            finally:
                self._done()

    def _done(self):
        with self._idle:
            self._unfinished -= 1
            if not self._unfinished:
                self._idle.notify_all()


_POOL = _Pool()


def wait_idle():
    """Block until the compile pool has finished everything submitted to it, by any engine
    of the process (its programs compiled, into the engines' entries and the shared ones)."""
    _POOL.wait_idle()


class StoredExecutable:
    """An executable loaded from the program store, with its store key; `checked` once it has
    run successfully in this process."""
    __slots__ = ("compiled", "store_key", "checked")

    def __init__(self, compiled, store_key: str):
        self.compiled, self.store_key, self.checked = compiled, store_key, False

    def __call__(self, *args):
        return self.compiled(*args)


def clear_shared():
    """Forget the executables engines share (with `jax.clear_caches`, to release their memory)."""
    with _SHARED_LOCK:
        _SHARED.clear()


def _spec(value):
    if isinstance(value, jax.ShapeDtypeStruct):
        return value
    if isinstance(value, jax.Array):
        return jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=value.sharding)
    value = np.asarray(value)
    return jax.ShapeDtypeStruct(value.shape, value.dtype)


def argument_specs(args) -> tuple:
    """Shapes, dtypes and shardings of args: all lowering needs, taken at once because a
    background compile may lower after the arrays were donated to another program."""
    return jax.tree_util.tree_map(_spec, args)


class Programs:
    """An engine's compiled programs, by key (a tuple naming the program and its shape buckets).

    strict: a key not yet known is an error (set after warm-up by strict compilation).
    store: an `executable_store.Store` consulted before lowering (None: always lower).
    """

    def __init__(self, store=None):
        self.store = store
        self._lock = threading.Lock()
        self._entries: dict[tuple, Future] = {}
        self._queued: dict[tuple, tuple] = {}   # key -> (program, specs, static): not yet taken
        self.strict = False
        self.compile_seconds = 0.0   # summed over threads, compiles of this engine only
        self.num_compiled = 0        # compiled (or loaded from the persistent cache) here
        self.num_cache_hits = 0      # of those, loaded from the persistent cache
        self._rejected: set[str] = set()   # store keys whose entries failed: never loaded again

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key) -> bool:
        return key in self._entries

    def run(self, key: tuple, program, args: tuple, static: dict):
        """(program(*args, **static) through the executable of `key`, is_new): see
        `executable`. A stored executable's first run is watched (the module's docstring)."""
        executable, is_new = self.executable(key, program, args, static)
        if isinstance(executable, StoredExecutable) and not executable.checked:
            return self._first_run(key, program, executable, args, static), is_new
        return executable(*args), is_new

    def _first_run(self, key: tuple, program, executable: StoredExecutable, args: tuple,
                   static: dict):
        leaves, treedef = jax.tree_util.tree_flatten(args)
        specs = argument_specs(args)   # a failed run may have deleted the donated arrays
        donated = [info.donated for info in jax.tree_util.tree_leaves(
            executable.compiled.args_info)]
        size = sum(leaf.nbytes for leaf, is_donated in zip(leaves, donated) if is_donated)
        # np.array copies: np.asarray of a CPU array may view the buffer a donation reuses.
        copies = ([np.array(leaf) if is_donated else None
                   for leaf, is_donated in zip(leaves, donated)]
                  if size <= RECOVERABLE_BYTES else None)
        try:
            out = jax.block_until_ready(executable(*args))
        except Exception as err:
            self._forget(key, program, specs, static, executable,
                         f"its first run failed: {type(err).__name__}: {err}"[:300])
            if copies is None:
                raise
            args = jax.tree_util.tree_unflatten(treedef, [
                leaf if copy is None else jax.device_put(copy, spec.sharding)
                for leaf, copy, spec in zip(leaves, copies, jax.tree_util.tree_leaves(specs))])
            fresh, _ = self.executable(key, program, args, static, recompile=True)
            return fresh(*args)
        executable.checked = True
        return out

    def _forget(self, key, program, specs, static, executable: StoredExecutable, reason: str):
        """Drop a stored executable that failed: its store entry, this engine's entry and the
        process-wide one, so the next request for it compiles."""
        self.store.remove(executable.store_key, reason)
        with self._lock:
            self._entries.pop(key, None)
        with _SHARED_LOCK:
            _SHARED.pop(_signature(program, specs, static), None)
        with self._lock:
            self._rejected.add(executable.store_key)

    def executable(self, key: tuple, program, args: tuple, static: dict, *,
                   recompile: bool = False):
        """(the compiled program of `key`, is_new). A new key compiles here and now, and so
        does one still queued on the pool (taken from it); a key compiling on the pool is
        waited for. recompile: a key dropped just now (strict compilation allows it)."""
        with self._lock:
            future = self._entries.get(key)
            is_new = future is None
            if is_new:
                if self.strict and not recompile:
                    raise RuntimeError(f"shape {key} was not compiled at warm-up and strict "
                                       "compilation is on")
                future = self._entries[key] = Future()
            job = self._queued.pop(key, None)
        if is_new:
            self._resolve(future, program, argument_specs(args), static)
        elif job is not None:
            self._resolve(future, *job)
        return future.result(), is_new

    def submit(self, key: tuple, program, args: tuple, static: dict) -> Future:
        """Compile `key` on the pool (unless known); its Future. Until a pool thread takes it,
        a dispatch that needs it compiles it itself (`executable`)."""
        specs = argument_specs(args)
        with self._lock:
            if key in self._entries:
                return self._entries[key]
            future = self._entries[key] = Future()
            self._queued[key] = (program, specs, static)
        _POOL.submit(self._take_queued, key, future)
        return future

    def _take_queued(self, key: tuple, future: Future):
        """A pool thread's turn at a submitted program, unless a dispatch has taken it."""
        with self._lock:
            job = self._queued.pop(key, None)
        if job is not None:
            self._resolve(future, *job)

    def pending(self) -> list[Future]:
        with self._lock:
            return [future for future in self._entries.values() if not future.done()]

    def wait(self):
        """Block until every program submitted so far is compiled (errors raise)."""
        for future in self.pending():
            future.result()

    def _resolve(self, future: Future, program, specs: tuple, static: dict):
        try:
            future.set_result(self._compile(program, specs, static))
        except BaseException as err:   # the waiting dispatch re-raises it
            future.set_exception(err)

    def _compile(self, program, specs: tuple, static: dict):
        signature = _signature(program, specs, static)
        with _SHARED_LOCK:
            shared = _SHARED.get(signature)
            is_owner = shared is None
            if is_owner:
                shared = _SHARED[signature] = Future()
        if not is_owner:
            return shared.result()
        _listen_for_cache_hits()
        hits, start = getattr(_COMPILING, "hits", 0), time.perf_counter()
        try:
            compiled, is_stored = self._lowered_or_stored(program, specs, static)
        except BaseException as err:
            with _SHARED_LOCK:
                _SHARED.pop(signature, None)
            shared.set_exception(err)
            raise
        with self._lock:
            self.compile_seconds += time.perf_counter() - start
            self.num_compiled += 1
            self.num_cache_hits += getattr(_COMPILING, "hits", 0) - hits + is_stored
        shared.set_result(compiled)
        return compiled

    def _lowered_or_stored(self, program, specs: tuple, static: dict):
        """(executable, came from the store): the store's entry, else lowered and compiled
        (then stored, unless JAX's persistent cache supplied it: see `executable_store`)."""
        if self.store is None:
            return _lowered(program, specs, static).compile(), False
        key = self.store.key(program, specs, static)
        compiled = None if key in self._rejected else self.store.load(key, specs)
        if compiled is not None:
            return StoredExecutable(compiled, key), True
        hits = getattr(_COMPILING, "hits", 0)
        compiled = _lowered(program, specs, static).compile()
        if getattr(_COMPILING, "hits", 0) == hits:
            self.store.save(key, compiled, program_name(program))
        return compiled, False


def _signature(program, specs: tuple, static: dict) -> tuple:
    """What makes two compiles the same program, for sharing executables in the process."""
    leaves, treedef = jax.tree_util.tree_flatten(specs)
    return (program, tuple(sorted(static.items())), treedef, tuple(leaves))


def _lowered(program, specs: tuple, static: dict):
    """program lowered for specs; on a pool thread, at most LOWERING_THREADS at a time (a
    dispatch compiling on demand never waits for the pool's turn)."""
    if not getattr(_COMPILING, "is_pool", False):
        return program.lower(*specs, **static)
    with _LOWERING:
        return program.lower(*specs, **static)

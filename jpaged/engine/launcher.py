"""The thread that dispatches decode loops holding a host callback.

A compiled program that calls back into Python runs inside the call that dispatches it: the call
returns when the program has ended, not when it is queued (measured on an H100: 10-11 ms for an
8.7 ms loop, 0.8 ms for the same loop without the callback; on the CPU likewise). A constrained
decode loop advances its rows' matchers that way, so dispatched from the engine's own thread it
would hold that thread for the whole loop, and the host work that asynchronous scheduling
overlaps with the device (processing the previous loop, planning the next) would run with the
device idle. The executor dispatches such loops here instead, one at a time in the order they
were submitted, and whatever reads the device state they hand on (block manager, KV cache) from
any other thread first waits for them (`settle`).
"""

import threading
from concurrent.futures import Future, ThreadPoolExecutor

_ON_LAUNCHER = threading.local()


def _mark_launcher_thread():
    _ON_LAUNCHER.active = True


def resolved(value) -> Future:
    """A Future already holding value."""
    future = Future()
    future.set_result(value)
    return future


class Launcher:
    """One thread, started on first use; its work runs in submission order."""

    def __init__(self):
        self._pool: ThreadPoolExecutor | None = None
        self._pending: Future | None = None    # the newest work submitted, until settled

    def submit(self, fn, *args) -> Future:
        """Run fn(*args) on the launcher thread after the work submitted before it."""
        if self._pool is None:
            # The thread keeps no reference to its owner: an engine dropped with its launcher
            # idle is collected, and the thread ends with the pool.
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="jpaged-loops",
                                            initializer=_mark_launcher_thread)
        self._pending = self._pool.submit(fn, *args)
        return self._pending

    def settle(self):
        """Wait until the submitted work has run (nothing to wait for on the launcher thread
        itself, where it runs in order). Raises what that work raised, now and on every later
        call: the device state it was to hand on is lost."""
        pending = self._pending
        if pending is None or getattr(_ON_LAUNCHER, "active", False):
            return
        pending.result()
        if self._pending is pending:
            self._pending = None

"""Hold a serving engine's thread at its next step, and watch the aborts the server sends it, so
that a test acts while a request is surely in flight, however fast the machine runs the model."""

import contextlib
import threading

# Only against a hang: a test that never lets a held step go (or an abort that never comes)
# fails with the reason instead of waiting for ever.
GUARD_SECONDS = 120


class StepHold:
    """Lets steps run until `after_outputs` of them have returned outputs, then holds the engine
    thread before each later step until `release` (after which every step runs)."""

    def __init__(self, after_outputs: int):
        self._outputs_to_come = after_outputs
        self._released = threading.Event()
        self.is_holding = threading.Event()   # the engine thread waits at a held step

    def release(self):
        self._released.set()

    def before_step(self):
        if self._outputs_to_come > 0:
            return
        self.is_holding.set()
        if not self._released.wait(GUARD_SECONDS):
            raise RuntimeError(f"a held engine step was not released within {GUARD_SECONDS} s")

    def after_step(self, outputs: list):
        if outputs:
            self._outputs_to_come -= 1


@contextlib.contextmanager
def held_steps(engine, *, after_outputs: int = 0):
    """`engine.step` held as `StepHold` says while the block runs; released on the way out,
    whatever happened, so the engine thread never stays held after the test."""
    hold = StepHold(after_outputs)
    step = engine.step

    def held_step():
        hold.before_step()
        outputs = step()
        hold.after_step(outputs)
        return outputs

    engine.step = held_step
    try:
        yield hold
    finally:
        hold.release()
        del engine.step   # the class's method again


class AbortWatch:
    """The request ids an AsyncEngine was asked to abort, and a way to wait for one."""

    def __init__(self):
        self._condition = threading.Condition()
        self.request_ids: list[str] = []

    def record(self, request_id: str):
        with self._condition:
            self.request_ids.append(request_id)
            self._condition.notify_all()

    def wait_for_any(self) -> list[str]:
        with self._condition:
            if not self._condition.wait_for(lambda: self.request_ids, GUARD_SECONDS):
                raise AssertionError(f"the server sent no abort within {GUARD_SECONDS} s")
            return list(self.request_ids)


@contextlib.contextmanager
def watched_aborts(async_engine):
    """Record every `async_engine.abort` call (made by the server when a client goes) while the
    block runs; the abort itself goes through unchanged."""
    watch = AbortWatch()
    abort = async_engine.abort

    def watched_abort(request_id: str):
        abort(request_id)   # queued first: a test woken by the record finds it queued
        watch.record(request_id)

    async_engine.abort = watched_abort
    try:
        yield watch
    finally:
        del async_engine.abort

"""Processes the tests start (servers, multi-device workers, scripts) end with the test that
started them: on Linux the kernel kills a child whose parent dies, however the parent ends (a
test timeout that ends the pytest worker included), and a child that passes its time limit is
killed before the test fails.

The child asks for that itself: it starts as this file run as a script, which sets its parent
death signal and then execs the real command (the signal survives exec). The pytest process
runs no Python between fork and exec, which is unsafe in a process with JAX's threads.
"""

import ctypes
import os
import signal
import subprocess
import sys

_PR_SET_PDEATHSIG = 1


def _wrapped(args) -> list[str]:
    if sys.platform != "linux":
        return list(args)
    return [sys.executable, __file__, str(os.getpid()), *map(str, args)]


def popen(args, **kwargs) -> subprocess.Popen:
    """subprocess.Popen(args, **kwargs) for a child that dies with this process."""
    return subprocess.Popen(_wrapped(args), **kwargs)


def run(args, **kwargs) -> subprocess.CompletedProcess:
    """subprocess.run (which kills the child when `timeout` passes) for a child that dies with
    this process."""
    return subprocess.run(_wrapped(args), **kwargs)


def communicate(process: subprocess.Popen, timeout: float) -> tuple[str, str]:
    """process.communicate(timeout); past it, the child is killed and the test fails with the
    end of what it wrote."""
    try:
        return process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        out, err = process.communicate()
        raise AssertionError(f"{process.args!r} ran past {timeout} s and was killed; "
                             f"its output ended with:\n{(out or '')[-2000:]}\n"
                             f"{(err or '')[-3000:]}") from None


def _exec_dying_with(parent: int, command: list[str]):
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:   # the parent died before the signal was set
        sys.exit(f"the test process {parent} is gone")
    os.execvp(command[0], command)


if __name__ == "__main__":
    _exec_dying_with(int(sys.argv[1]), sys.argv[2:])

"""A real `python -m jpaged.serve` in a subprocess on a free 127.0.0.1 port, for tests."""

import contextlib
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from tests import child_process

ROOT = Path(__file__).resolve().parent.parent


@contextlib.contextmanager
def running_server(flags: list[str], log_path: Path, timeout: float = 180):
    """Start the server with `flags`, wait until /health answers, yield its URL, stop it.
    The server compiles a first request's programs before /health answers."""
    with server_process(flags, log_path, timeout=timeout) as (url, _):
        yield url


@contextlib.contextmanager
def server_process(flags: list[str], log_path: Path, *, command=("-m", "jpaged.serve"),
                   timeout: float = 180):
    """`running_server` yielding (URL, the subprocess.Popen); `command` (after the python
    executable, before the flags) may run a wrapper that takes the server's flags."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with open(log_path, "w") as log:
        process = child_process.popen(
            [sys.executable, *command, "--host", "127.0.0.1", f"--port={port}", *flags],
            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, text=True)
        url = f"http://127.0.0.1:{port}"
        try:
            _wait_healthy(process, url, log_path, timeout)
            yield url, process
        finally:
            process.terminate()
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _wait_healthy(process, url: str, log_path: Path, timeout: float):
    deadline = time.monotonic() + timeout
    while True:
        if process.poll() is not None:
            pytest.fail(f"server exited early:\n{log_path.read_text()}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            pytest.fail(f"server did not become healthy within {timeout} s")
        time.sleep(0.2)

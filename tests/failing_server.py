"""`python -m jpaged.serve` whose engine steps fail on demand, for tests/test_serve_health.py.

python -m tests.failing_server CONTROL_FILE [server flags...]
    Before each engine step the control file is read: "once" makes that step raise and deletes
    the file, "always" makes every step raise; no file (or anything else) leaves steps alone.
    The server is idle between a test's requests, so a test decides which request's steps fail.
"""

import sys
from pathlib import Path

from jpaged.engine.llm_engine import LLMEngine
from jpaged.serve.cli import main


def fail_on_demand(control: Path):
    real_step = LLMEngine.step

    def step(engine):
        mode = control.read_text().strip() if control.exists() else ""
        if mode == "once":
            control.unlink()
        if mode in ("once", "always"):
            raise RuntimeError(f"injected step failure ({mode})")
        return real_step(engine)

    LLMEngine.step = step


if __name__ == "__main__":
    fail_on_demand(Path(sys.argv[1]))
    sys.exit(main(sys.argv[2:]))

"""`make run`: the OpenAI-compatible server on the built-in default model.

Prints the URL and an example curl, loads the model and serves on 127.0.0.1:8000 until stopped
(Ctrl-C). Extra arguments are `python -m jpaged.serve` flags, e.g. `--port 8080`.
"""

import sys


def main(argv=None) -> int:
    try:
        from jpaged import serve
    except ImportError as err:  # the server's packages are the `serve` extra
        print(f"jpaged: the server needs the 'serve' extra ({err.name} is missing): "
              "pip install -e '.[serve]'", file=sys.stderr)
        return 1
    return serve.main(sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    sys.exit(main())

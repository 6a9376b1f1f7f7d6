"""`python -m kernels.cpu --build [--cache-dir DIR]`: the older spelling of `xlaserve build-kernels`."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    """Runs `xlaserve build-kernels` with the other arguments (its output and exit codes)."""
    argv = sys.argv[1:] if argv is None else argv
    if "--build" not in argv:
        print("usage: python -m kernels.cpu --build [--cache-dir DIR]  (same as xlaserve build-kernels)",
              file=sys.stderr)
        return 2
    # The one exception to kernels importing no other project package, in this entry point only (nothing
    # imports it): the build must resolve its compiler, switch and cache directory from the environment
    # exactly as the server that loads the library will, and serve/ alone reads the environment.
    from serve.cli import main as xlaserve

    return xlaserve(["build-kernels", *(arg for arg in argv if arg != "--build")])


if __name__ == "__main__":
    sys.exit(main())

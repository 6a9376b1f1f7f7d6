"""`python -m kernels.cpu --build [--cache-dir DIR]`: compile the native CPU kernels ahead of time."""

from __future__ import annotations

import argparse
import os
import sys

from kernels.cpu import build


def main(argv: list[str] | None = None) -> int:
    """Builds (or finds already built) the kernel library and prints its path: exit 0. Prints why the
    kernels are unavailable to stderr and exits 1 otherwise, so an image build that cannot compile them
    fails there instead of serving on the slow references."""
    parser = argparse.ArgumentParser(prog="python -m kernels.cpu", description=__doc__)
    parser.add_argument(
        "--build",
        action="store_true",
        required=True,
        help="compile the library into the kernel cache (a no-op when it is there)",
    )
    parser.add_argument(
        "--cache-dir",
        default=None,
        help="xlaserve's cache directory, as the server's --cache-dir (default: "
        "$XLASERVE_CACHE_DIR, else the user cache); the library goes to its cpu_kernels/",
    )
    ns = parser.parse_args(argv)
    if ns.cache_dir:
        build.set_cache_dir(os.path.join(os.path.expanduser(ns.cache_dir), "cpu_kernels"))
    result = build.build()
    if result.path is None:
        print(f"native CPU kernels unavailable: {result.reason}", file=sys.stderr)
        return 1
    print(result.path)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``python -m vattn`` (and the ``vattn`` console script): what this installation can run.

Prints the versions of Python, torch, Triton, FlashInfer and FlashAttention, the device, every
registry backend (available here and what it serves, unavailable here and why, or not
implemented in this version), the backend chosen for a default layer, and the ``VATTN_*``
variables in effect. ``--json`` prints the same as JSON; ``--support-matrix`` prints the
implemented backends' declared support as a Markdown table (README.md's).
"""

from __future__ import annotations

import argparse
import json
import sys

from vattn import info

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """Print the report (or the support matrix); returns the exit status (0)."""
    parser = argparse.ArgumentParser(
        prog="vattn",
        description="Show what this vattn installation can run: versions, device, backends and why "
        "not, the backend chosen for a default layer, and the VATTN_* variables.",
    )
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--json", action="store_true", help="print the report as JSON")
    what.add_argument("--support-matrix", action="store_true",
                      help="print the implemented backends' declared support as a Markdown table")
    args = parser.parse_args(argv)
    if args.support_matrix:
        sys.stdout.write(info.support_matrix_markdown())
    elif args.json:
        print(json.dumps(info.collect(), indent=2, default=str))
    else:
        print(info.render_text(info.collect()))
    return 0


if __name__ == "__main__":
    sys.exit(main())

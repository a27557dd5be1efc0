"""Roofline: the device's measured copy / read bandwidth and bf16 matmul rate, in the same run.

Every benchmark reports its achieved TB/s and TFLOP/s as a fraction of these ceilings, which
are measured in the same process just before the sweep (not taken from a datasheet), so the
fractions stay honest across clock states, power limits and machines.

| ceiling | how | unit |
| --- | --- | --- |
| ``copy_tbps`` | ``dst.copy_(src)`` of a large bf16 buffer; bytes read + bytes written | TB/s (1e12 B/s) |
| ``read_tbps`` | ``src.sum(dtype=float32)``: a read-only reduction; bytes read | TB/s |
| ``bf16_tflops`` | ``torch.mm`` of two n x n bf16 matrices (default n = 8192); 2 n^3 flops | TFLOP/s |

CLI: ``PYTHONPATH=$PWD python benchmarks/roofline.py [--quick] [--device cpu --tiny]`` prints
the ceilings and writes ``roofline-<device>-<date>.json``.
"""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):  # run as a script: make `benchmarks` and `vattn` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import common  # noqa: E402

__all__ = ["Roofline", "fraction", "measure"]

logger = logging.getLogger("vattn.benchmarks.roofline")


def fraction(value: float | None, ceiling: float | None) -> float | None:
    """``value / ceiling``, or None when either is missing or the ceiling is not positive."""
    if value is None or ceiling is None or not ceiling > 0:
        return None
    return value / ceiling


@dataclass(frozen=True)
class Roofline:
    """Measured ceilings of one device.

    Args:
        copy_tbps: device-to-device copy bandwidth, (bytes read + written) / s / 1e12.
        read_tbps: read-only reduction bandwidth, bytes read / s / 1e12.
        bf16_tflops: dense bf16 matmul rate, flops / s / 1e12.
        device: the device measured (``"cuda"`` / ``"cpu"``).
        copy_bytes: bytes of the copied buffer (each of source and destination).
        matmul_n: the square matmul size.
    """

    copy_tbps: float
    read_tbps: float
    bf16_tflops: float
    device: str = "cuda"
    copy_bytes: int = 0
    matmul_n: int = 0

    def frac_copy(self, tbps: float | None) -> float | None:
        """An achieved bandwidth (TB/s) as a fraction of the copy bandwidth."""
        return fraction(tbps, self.copy_tbps)

    def frac_read(self, tbps: float | None) -> float | None:
        """An achieved bandwidth (TB/s) as a fraction of the read-only bandwidth."""
        return fraction(tbps, self.read_tbps)

    def frac_matmul(self, tflops: float | None) -> float | None:
        """An achieved compute rate (TFLOP/s) as a fraction of the bf16 matmul rate."""
        return fraction(tflops, self.bf16_tflops)

    def fractions(self, *, tbps: float | None = None, tflops: float | None = None) -> dict[str, float | None]:
        """Row columns ``frac_copy_bw``, ``frac_read_bw``, ``frac_matmul`` for a measurement."""
        return {
            "frac_copy_bw": self.frac_copy(tbps),
            "frac_read_bw": self.frac_read(tbps),
            "frac_matmul": self.frac_matmul(tflops),
        }

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _sizes(device: torch.device, quick: bool, tiny: bool) -> tuple[int, int]:
    """(copy buffer bytes, matmul n) for the device and mode."""
    if tiny or device.type != "cuda":
        return (2 if tiny else 64) * 2**20, 128 if tiny else 1024
    free, _ = torch.cuda.mem_get_info(device)
    copy_bytes = min((1 if quick else 2) * 2**30, free // 4)  # src + dst must fit with room to spare
    return int(copy_bytes), 8192


def _time_copy_and_read(numel: int, device: torch.device, warmup: float, rep: float) -> tuple[float, float]:
    """Median ms of copying and of summing a bf16 buffer of ``numel`` elements."""
    src = torch.randn(numel, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    t_copy = common.bench(lambda: dst.copy_(src), warmup=warmup, rep=rep, device=device)["median_ms"]
    t_read = common.bench(lambda: src.sum(dtype=torch.float32), warmup=warmup, rep=rep, device=device)["median_ms"]
    return t_copy, t_read


def _time_matmul(n: int, device: torch.device, warmup: float, rep: float) -> float:
    """Median ms of an n x n x n bf16 matmul."""
    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    c = torch.empty(n, n, dtype=torch.bfloat16, device=device)
    return common.bench(lambda: torch.mm(a, b, out=c), warmup=warmup, rep=rep, device=device)["median_ms"]


def measure(
    device: torch.device | str | None = None,
    *,
    quick: bool = False,
    tiny: bool = False,
    copy_bytes: int | None = None,
    matmul_n: int | None = None,
) -> Roofline:
    """Measure the ceilings on ``device`` (default: CUDA if available, else CPU).

    Args:
        quick: shorter timing (and a 1 GiB instead of 2 GiB copy buffer on CUDA).
        tiny: CPU-test sizes (2 MiB copy, 128^3 matmul).
        copy_bytes / matmul_n: override the sizes.
    """
    device = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    default_bytes, default_n = _sizes(device, quick, tiny)
    nbytes = int(copy_bytes or default_bytes)
    n = int(matmul_n or default_n)
    warmup, rep = (5, 20) if (quick or tiny) else (25, 200)

    numel = nbytes // 2
    t_copy, t_read = _time_copy_and_read(numel, device, warmup, rep)
    t_mm = _time_matmul(n, device, warmup, rep)
    common.free_memory()
    return Roofline(
        copy_tbps=2 * numel * 2 / (t_copy * 1e-3) / 1e12,
        read_tbps=numel * 2 / (t_read * 1e-3) / 1e12,
        bf16_tflops=2 * n**3 / (t_mm * 1e-3) / 1e12,
        device=device.type,
        copy_bytes=numel * 2,
        matmul_n=n,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    parser.add_argument("--quick", action="store_true", help="shorter timing, 1 GiB copy buffer")
    parser.add_argument("--tiny", action="store_true", help="tiny sizes (CPU smoke test)")
    args = parser.parse_args(argv)
    roof = measure(args.device, quick=args.quick, tiny=args.tiny)
    rows = [
        {"ceiling": "copy_tbps", "value": roof.copy_tbps, "unit": "TB/s", "size": f"{roof.copy_bytes / 2**30:.3g} GiB"},
        {"ceiling": "read_tbps", "value": roof.read_tbps, "unit": "TB/s", "size": f"{roof.copy_bytes / 2**30:.3g} GiB"},
        {"ceiling": "bf16_tflops", "value": roof.bf16_tflops, "unit": "TFLOP/s", "size": f"{roof.matmul_n}^3"},
    ]
    table = common.Table(["ceiling", "value", "unit", "size"], title=f"roofline ({roof.device})")
    table.extend(rows)
    table.print()
    path = common.write_results("roofline", {"rows": rows, "summary": {"roofline": roof.to_dict(), "quick": args.quick}})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Shared benchmark helpers: environment capture, timing, result files, progress, tables, plots.

Every benchmark script in ``benchmarks/`` uses these so that its JSON has one schema (see
``write_results``) and ``benchmarks/report.py`` can render it without knowing the benchmark.

Timing: ``bench`` returns the median and the 20th/80th percentiles of many timed runs after a
warm-up: ``triton.testing.do_bench`` on CUDA (CUDA events, L2 flushed before every run), plain
CUDA events when Triton is missing, and ``time.perf_counter`` on CPU (so ``--quick`` smoke runs
work on the CPU-only development machines). ``bench_cuda_graph`` times replays of a captured
call; ``bench_wall`` times whole steps including their host work.

KV-cache helpers (``split_kv_cache``, ``fill_random_kv_``) give every benchmark the same random,
layout-independent cache contents, so outputs can be compared across backends.

Benchmark scripts read one environment variable, ``OUT`` (the device tool's output folder);
the vattn package itself reads none outside ``vattn/envs.py``.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import gc
import importlib.metadata as _md
import inspect
import json
import logging
import math
import numbers
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence, TypeVar

import torch

__all__ = [
    "REPO_ROOT",
    "RESULTS_DIR",
    "Table",
    "bench",
    "bench_cuda_graph",
    "bench_wall",
    "device_slug",
    "env_info",
    "fmt",
    "fill_random_kv_",
    "free_memory",
    "plot_panels",
    "profile_kernels",
    "progress",
    "result_path",
    "split_kv_cache",
    "write_results",
]

logger = logging.getLogger("vattn.benchmarks")

# vattn.compile keeps Dynamo's trace in ~/.cache/vattn by default: benchmark processes trace
# afresh, so no run depends on files a previous one left (bench_compile's cold start sets
# the trace directory of each start itself).
os.environ.setdefault("VATTN_DISABLE_COMPILE_CACHE", "1")

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"

T = TypeVar("T")

#: Distribution name(s) of each library whose version goes into ``env_info()`` (first found wins).
_DISTRIBUTIONS: dict[str, tuple[str, ...]] = {
    "torch": ("torch",),
    "triton": ("triton", "pytorch-triton"),
    "flashinfer": ("flashinfer-python", "flashinfer"),
    "flash_attn": ("flash-attn-4", "fa4", "flash-attn", "flash_attn_3"),
    "cutlass_dsl": ("nvidia-cutlass-dsl",),
    "transformers": ("transformers",),
    "numpy": ("numpy",),
}


# ---- environment ------------------------------------------------------------------------


def _version(names: Sequence[str]) -> str | None:
    for name in names:
        try:
            return _md.version(name)
        except _md.PackageNotFoundError:
            continue
        except Exception:  # a broken install must not break a benchmark
            continue
    return None


def _run(cmd: Sequence[str], timeout: float = 10.0) -> str | None:
    """stdout of ``cmd`` stripped, or None when it is missing, fails or hangs."""
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO_ROOT, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return res.stdout.strip() if res.returncode == 0 else None


def _gpu_clocks(index: int) -> dict[str, Any] | None:
    """Current and maximum SM / memory clocks (MHz), power limit (W) and driver, via nvidia-smi."""
    fields = ("clocks.sm", "clocks.mem", "clocks.max.sm", "clocks.max.mem", "power.limit", "driver_version")
    keys = ("sm_mhz", "mem_mhz", "max_sm_mhz", "max_mem_mhz", "power_limit_w", "driver")
    out = _run(["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits", "-i", str(index)])
    if not out:
        return None
    values = [v.strip() for v in out.splitlines()[0].split(",")]
    clocks: dict[str, Any] = {}
    for key, value in zip(keys, values):
        try:
            clocks[key] = value if key == "driver" else float(value)
        except ValueError:  # "[N/A]"
            clocks[key] = None
    return clocks


def _git() -> tuple[str | None, bool | None]:
    commit = _run(["git", "rev-parse", "HEAD"])
    if commit is None:
        return None, None
    status = _run(["git", "status", "--porcelain", "--untracked-files=no"])
    return commit, (bool(status) if status is not None else None)


def token_counts(text: str) -> tuple[int, ...]:
    """``"1,8"`` -> ``(1, 8)``; ``""`` -> ``()`` (a ``--compile-sizes`` value)."""
    return tuple(int(x) for x in text.split(",") if x.strip())


def device_slug(name: str) -> str:
    """A file-name-safe slug of a device name: ``"NVIDIA H100 80GB HBM3"`` -> ``"nvidia-h100-80gb-hbm3"``."""
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    return slug or "unknown"


def env_info(device: torch.device | str | None = None) -> dict[str, Any]:
    """Facts that make a measurement reproducible; every missing piece is ``None``, never an error.

    Keys: ``device_type``, ``device_name``, ``compute_capability``, ``sm_count``, ``gpu_memory_gib``,
    ``gpu_clocks`` (dict from nvidia-smi or None), ``torch``, ``triton``, ``flashinfer``,
    ``flash_attn``, ``cutlass_dsl``, ``transformers``, ``numpy``, ``vattn``, ``cuda``, ``python``,
    ``platform``, ``date`` (UTC ISO 8601), ``git_commit``, ``git_dirty``.

    Args:
        device: the device measured (default: the current CUDA device when CUDA is available,
            else the CPU).
    """
    if device is None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    info: dict[str, Any] = {"device_type": device.type}
    if device.type == "cuda" and torch.cuda.is_available():
        index = device.index if device.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        info.update(
            device_name=props.name,
            compute_capability=f"{props.major}.{props.minor}",
            sm_count=props.multi_processor_count,
            gpu_memory_gib=round(props.total_memory / 2**30, 2),
            gpu_clocks=_gpu_clocks(index),
        )
    else:
        cpu = platform.processor() or platform.machine() or "cpu"
        info.update(device_name=f"cpu ({cpu})", compute_capability=None, sm_count=None,
                    gpu_memory_gib=None, gpu_clocks=None)
    for key, names in _DISTRIBUTIONS.items():
        info[key] = _version(names)
    info["torch"] = info["torch"] or torch.__version__
    try:
        import vattn

        info["vattn"] = vattn.__version__
    except Exception:
        info["vattn"] = None
    commit, dirty = _git()
    info.update(
        cuda=torch.version.cuda,
        python=platform.python_version(),
        platform=platform.platform(terse=True),
        date=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        git_commit=commit,
        git_dirty=dirty,
    )
    return info


# ---- timing -------------------------------------------------------------------------------


def _quantile(sorted_times: Sequence[float], q: float) -> float:
    """Linear-interpolated quantile (as ``torch.quantile``) of an ascending list."""
    pos = q * (len(sorted_times) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return sorted_times[lo] + (sorted_times[hi] - sorted_times[lo]) * (pos - lo)


def _summary(times: Sequence[float], method: str) -> dict[str, Any]:
    ts = sorted(float(t) for t in times)
    return {"median_ms": _quantile(ts, 0.5), "p20": _quantile(ts, 0.2), "p80": _quantile(ts, 0.8),
            "n": len(ts), "method": method}


def _bench_cpu(fn: Callable[[], Any], warmup: float, rep: float) -> dict[str, Any]:
    fn()
    deadline = time.perf_counter() + warmup / 1e3
    while time.perf_counter() < deadline:
        fn()
    times: list[float] = []
    end = time.perf_counter() + rep / 1e3
    while not times or (time.perf_counter() < end and len(times) < 10_000) or len(times) < 3:
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return _summary(times, "perf_counter")


def _bench_cuda_events(fn: Callable[[], Any], warmup: float, rep: float) -> dict[str, Any]:
    """``triton.testing.do_bench``'s procedure with torch's CUDA events (L2 flushed before each run)."""
    flush = torch.empty(256 * 2**20 // 4, dtype=torch.int32, device="cuda")
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        flush.zero_()
        fn()
    end.record()
    torch.cuda.synchronize()
    estimate = max(start.elapsed_time(end) / 5, 1e-3)
    n_warmup, n_rep = max(1, int(warmup / estimate)), max(1, int(rep / estimate))
    for _ in range(n_warmup):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n_rep)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n_rep)]
    for s, e in zip(starts, ends):
        flush.zero_()
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return _summary([s.elapsed_time(e) for s, e in zip(starts, ends)], "cuda_events")


def _bench_triton(do_bench: Callable[..., Any], fn: Callable[[], Any], warmup: float, rep: float) -> dict[str, Any]:
    params = inspect.signature(do_bench).parameters
    if "return_mode" in params:  # every run's time ("all"): we compute n and the quantiles
        try:
            times = do_bench(fn, warmup=warmup, rep=rep, return_mode="all")
        except AssertionError:  # a Triton without return_mode="all" asserts before running fn
            times = None
        if isinstance(times, (list, tuple)) and times:
            return _summary(times, "triton.do_bench")
    p50, p20, p80 = do_bench(fn, warmup=warmup, rep=rep, quantiles=[0.5, 0.2, 0.8])
    return {"median_ms": p50, "p20": p20, "p80": p80, "n": None, "method": "triton.do_bench"}


def bench(
    fn: Callable[[], Any],
    *,
    warmup: float = 25,
    rep: float = 100,
    device: torch.device | str | None = None,
) -> dict[str, Any]:
    """Time ``fn()`` after a warm-up; every figure in milliseconds.

    Args:
        fn: the work to time; called many times, must not change what it computes.
        warmup: milliseconds of untimed runs first (at least one run: JIT compilation happens there).
        rep: milliseconds of timed runs (at least three on the CPU path).
        device: ``"cuda"`` (default when CUDA is available) times GPU work with
            ``triton.testing.do_bench`` (CUDA events if Triton is missing); ``"cpu"`` uses
            ``time.perf_counter`` per call.

    Returns:
        ``{"median_ms", "p20", "p80", "n", "method"}``: the median and the 20th / 80th
        percentile run time, the number of timed runs (None when Triton only reports
        quantiles) and which timer was used.
    """
    if warmup < 0 or rep <= 0:
        raise ValueError(f"bench: warmup must be >= 0 and rep > 0 (milliseconds), got warmup={warmup}, rep={rep}.")
    dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type != "cuda":
        return _bench_cpu(fn, warmup, rep)
    try:
        from triton.testing import do_bench  # Triton 3.6 and 3.9 share this signature
    except Exception:  # not installed, or a broken install
        return _bench_cuda_events(fn, warmup, rep)
    return _bench_triton(do_bench, fn, warmup, rep)


def bench_wall(fn: Callable[[], Any], *, warmup: float = 25, rep: float = 100) -> dict[str, Any]:
    """Wall-clock time of ``fn()`` including its host work, the GPU drained after every call.

    For whole steps (metadata building, Python, launches and kernels): ``bench`` on CUDA times
    the GPU timeline between events, and the L2 flush it queues before each run lets up to
    ~0.1 ms of ``fn``'s host work start early, unseen. Here each call is
    ``perf_counter`` -> ``fn()`` -> ``torch.cuda.synchronize()`` -> ``perf_counter``.

    Returns ``bench``'s dict (``method`` ``"wall+sync"``).
    """
    if not torch.cuda.is_available():
        res = _bench_cpu(fn, warmup, rep)
    else:
        def call() -> None:
            fn()
            torch.cuda.synchronize()

        torch.cuda.synchronize()
        res = _bench_cpu(call, warmup, rep)
    res["method"] = "wall+sync"
    return res


def bench_cuda_graph(
    fn: Callable[[], Any],
    *,
    warmup: float = 25,
    rep: float = 100,
    capture_warmup: int = 3,
) -> dict[str, Any]:
    """Capture one call of ``fn`` in a CUDA graph and time its replays with ``bench``.

    ``fn`` runs ``capture_warmup`` times on a side stream first (lazy initialisation, JIT,
    allocator warm-up), as CUDA-graph capture requires; the tensors ``fn`` reads and writes must
    stay alive while it is timed. The graph (and its memory pool) is released on return.

    Returns ``bench``'s dict with ``method`` prefixed by ``"cuda_graph+"``.

    Raises:
        RuntimeError: CUDA is not available (graphs need a GPU).
    """
    if not torch.cuda.is_available():
        raise RuntimeError("bench_cuda_graph needs a CUDA GPU; use bench() on the CPU.")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(max(1, capture_warmup)):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    from vattn.compile_passes.piecewise import capture_graph

    graph, _ = capture_graph(fn)  # its own pool and cuBLAS workspace (see capture_graph)
    torch.cuda.synchronize()
    res = bench(graph.replay, warmup=warmup, rep=rep, device="cuda")
    res["method"] = "cuda_graph+" + str(res["method"])
    del graph
    return res


def _short_kernel_name(name: str) -> str:
    """A kernel name without ``void`` and its trailing parameter list, at most 100 characters."""
    name = name.removeprefix("void ").strip()
    if name.endswith(")"):
        depth = 0
        for i in range(len(name) - 1, -1, -1):
            depth += {")": 1, "(": -1}.get(name[i], 0)
            if depth == 0:
                name = name[:i] if i else name
                break
    return name[:100]


def profile_kernels(fn: Callable[[], Any], *, steps: int = 3, top: int = 25) -> dict[str, Any]:
    """CUDA kernels one call of ``fn`` runs, from a torch-profiler trace of ``steps`` calls.

    Kernels inside CUDA-graph replays are listed too (CUPTI reports graph nodes). memcpy /
    memset activities are counted apart.

    Returns:
        ``{"kernels_per_step", "kernel_ms_per_step" (sum of kernel durations: the GPU's busy
        time), "copies_per_step", "top": [{"name", "count_per_step", "ms_per_step"}, ...]}``,
        ``top`` sorted by time, names shortened (``_short_kernel_name``).
    """
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    by: dict[str, list[float]] = {}
    copies = 0
    for e in prof.events():
        if e.device_type != DeviceType.CUDA:
            continue
        if e.name.lower().startswith(("memcpy", "memset")):
            copies += 1
            continue
        by.setdefault(_short_kernel_name(e.name), []).append(e.time_range.elapsed_us() / 1e3)
    rows = sorted(({"name": k, "count_per_step": len(v) / steps, "ms_per_step": sum(v) / steps}
                   for k, v in by.items()), key=lambda r: -r["ms_per_step"])
    return {"kernels_per_step": sum(len(v) for v in by.values()) / steps,
            "kernel_ms_per_step": sum(sum(v) for v in by.values()) / steps,
            "copies_per_step": copies / steps, "top": rows[:top]}


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Build under ``dtype`` (vattn layers record the default dtype at construction as the model's)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def free_memory() -> None:
    """Drop unreferenced tensors and return cached CUDA memory (between benchmark points)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def split_kv_cache(cache: torch.Tensor, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(key, value) views, each (num_blocks, block_size, Hk, D), of a vattn backend's 5-D KV cache.

    Handles ``(2, num_blocks, ...)`` (TORCH_SDPA, TRITON_ATTN, FLASH_ATTN) and ``(num_blocks, 2, ...)``
    (FLASHINFER); the views keep the physical layout's strides (NHD or HND).

    Raises:
        ValueError: the shape is neither.
    """
    if cache.dim() == 5 and cache.shape[0] == 2 and cache.shape[1] == num_blocks:
        return cache[0], cache[1]
    if cache.dim() == 5 and cache.shape[1] == 2 and cache.shape[0] == num_blocks:
        return cache[:, 0], cache[:, 1]
    raise ValueError(
        f"split_kv_cache: unknown KV cache shape {tuple(cache.shape)}; expected (2, {num_blocks}, block_size, "
        f"Hk, D) or ({num_blocks}, 2, block_size, Hk, D)."
    )


def fill_random_kv_(k: torch.Tensor, v: torch.Tensor, seed: int) -> None:
    """Fill (num_blocks, block_size, Hk, D) key/value views with N(0, 1) values (any dtype, fp8 too).

    Chunked over blocks with one generator seed per chunk, so every cache layout (and a raw
    library's own cache) gets identical contents from the same seed, without a full-size
    temporary: benchmarks can then compare outputs across backends.
    """
    per_block = max(1, k[0].numel())
    chunk = max(1, (1 << 25) // per_block)
    for which, view in enumerate((k, v)):
        for start in range(0, view.shape[0], chunk):
            gen = torch.Generator(device=view.device).manual_seed(seed * 1_000_003 + which * 7919 + start)
            part = view[start : start + chunk]
            part.copy_(torch.randn(part.shape, generator=gen, device=view.device, dtype=torch.float32))


# ---- results ------------------------------------------------------------------------------


def result_path(name: str, env: Mapping[str, Any] | None = None) -> Path:
    """Where ``write_results(name, ...)`` writes: ``$OUT/<file>`` if ``OUT`` is set, else
    ``benchmarks/results/<file>``; ``<file>`` = ``<name>-<device-slug>-<YYYY-MM-DD>.json``."""
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
        raise ValueError(f"result name must be letters, digits, '_', '.' or '-', got {name!r}; e.g. 'kernels'.")
    env = env if env is not None else env_info()
    date = str(env.get("date") or _dt.datetime.now(_dt.timezone.utc).isoformat())[:10]
    out = os.environ.get("OUT")
    folder = Path(out) if out else RESULTS_DIR
    return folder / f"{name}-{device_slug(str(env.get('device_name') or 'unknown'))}-{date}.json"


def _flat(value: Any) -> Any:
    """A JSON scalar for a row cell (non-scalars become compact JSON text)."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, numbers.Integral):  # int, numpy integers
        return int(value)
    if isinstance(value, numbers.Real):  # float, numpy floats
        return float(value) if math.isfinite(value) else None
    if isinstance(value, torch.dtype):
        return str(value).replace("torch.", "")
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return _flat(value.item())
    cleaned = _clean(value)
    return cleaned if isinstance(cleaned, str) else json.dumps(cleaned, separators=(",", ":"))


def _clean(value: Any) -> Any:
    """JSON-ready copy of ``value``: non-finite floats become None, dtypes / paths / tensors text or lists."""
    if isinstance(value, Mapping):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [_clean(v) for v in value]
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value) if math.isfinite(value) else None
    if isinstance(value, torch.dtype):
        return str(value).replace("torch.", "")
    if isinstance(value, torch.Tensor) and value.numel() <= 64:
        return _clean(value.tolist())
    return str(value)


def write_results(name: str, payload: Mapping[str, Any], *, path: Path | str | None = None) -> Path:
    """Write one benchmark run as JSON and return its path.

    The schema every benchmark writes (``benchmarks/report.py`` renders any file of this shape):

    | key | type | meaning |
    | --- | --- | --- |
    | ``benchmark`` | str | the benchmark's name (``name``) |
    | ``env`` | dict | ``env_info()``: device, clocks, library versions, date, git commit |
    | ``rows`` | list of flat dicts | one measurement per row; values are str / int / float / bool / None; the table's columns are the union of the rows' keys |
    | ``summary`` | dict, optional | run-level facts (roofline ceilings, skipped configurations, ...) |
    | ``plots`` | list of str, optional | PNG file names, relative to the JSON's folder |

    Args:
        name: the benchmark name, e.g. ``"kernels"``; also the file-name prefix.
        payload: ``{"rows": [...], "summary": {...}, "plots": [...], ...}``; ``env`` is filled in
            with ``env_info()`` when absent. Non-scalar row values are stored as JSON text (with
            a warning) so that a long GPU run is never lost to a formatting mistake.
        path: explicit destination (default: ``result_path(name, env)``).
    """
    data = dict(payload)
    rows = data.get("rows", [])
    if not isinstance(rows, list) or not all(isinstance(r, Mapping) for r in rows):
        raise TypeError(f"write_results({name!r}): payload['rows'] must be a list of dicts, got {type(rows).__name__}.")
    flat_rows = []
    for i, row in enumerate(rows):
        flat = {str(k): _flat(v) for k, v in row.items()}
        nested = [k for k, v in row.items() if isinstance(v, (dict, list, tuple))]
        if nested:
            logger.warning("write_results(%r): row %d has non-scalar values in %s; stored as JSON text", name, i, nested)
        flat_rows.append(flat)
    data = {k: _clean(v) for k, v in data.items() if k != "rows"}
    data["benchmark"] = name
    data["env"] = data.get("env") or env_info()
    data["rows"] = flat_rows
    data.setdefault("summary", {})
    dest = Path(path) if path is not None else result_path(name, data["env"])
    dest.parent.mkdir(parents=True, exist_ok=True)
    ordered = {k: data[k] for k in ("benchmark", "env", "summary", "plots", "rows") if k in data}
    ordered.update({k: v for k, v in data.items() if k not in ordered})
    dest.write_text(json.dumps(ordered, indent=1, default=str, allow_nan=False) + "\n")
    return dest


# ---- progress and tables ------------------------------------------------------------------


def progress(iterable: Iterable[T], desc: str, total: int | None = None, **kwargs: Any) -> Iterator[T]:
    """A tqdm progress bar on stderr over ``iterable`` (a plain iteration if tqdm is missing)."""
    try:
        from tqdm.auto import tqdm
    except ImportError:
        yield from iterable
        return
    kwargs.setdefault("file", sys.stderr)
    kwargs.setdefault("dynamic_ncols", True)
    kwargs.setdefault("leave", True)
    yield from tqdm(iterable, desc=desc, total=total, **kwargs)


def fmt(value: Any, digits: int = 4) -> str:
    """A table cell: floats to ``digits`` significant digits, None as empty, pipes escaped."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        if value != 0 and (abs(value) >= 1e7 or abs(value) < 1e-3):
            return f"{value:.{digits - 1}e}"
        if abs(value) >= 10**digits:
            return f"{value:.0f}"
        return f"{value:.{digits}g}"
    text = str(value).replace("\n", " ")
    return text.replace("|", "\\|")


class Table:
    """A tiny markdown table builder.

    >>> t = Table(["backend", "ms"], title="decode")
    >>> t.add({"backend": "TORCH_SDPA", "ms": 0.12345})
    >>> print(t.to_markdown())  # doctest: +NORMALIZE_WHITESPACE
    **decode**
    <BLANKLINE>
    | backend | ms |
    | --- | --- |
    | TORCH_SDPA | 0.1235 |

    Args:
        columns: column keys, in order; ``None`` = the union of the added rows' keys in first-seen order.
        title: optional bold line above the table.
    """

    def __init__(self, columns: Sequence[str] | None = None, title: str | None = None) -> None:
        self.columns = list(columns) if columns is not None else None
        self.title = title
        self.rows: list[Mapping[str, Any]] = []

    def add(self, row: Mapping[str, Any]) -> None:
        self.rows.append(row)

    def extend(self, rows: Iterable[Mapping[str, Any]]) -> None:
        self.rows.extend(rows)

    def _columns(self) -> list[str]:
        if self.columns is not None:
            return self.columns
        cols: dict[str, None] = {}
        for row in self.rows:
            cols.update(dict.fromkeys(row))
        return list(cols)

    def to_markdown(self) -> str:
        cols = self._columns()
        lines = [f"**{self.title}**", ""] if self.title else []
        if not cols:
            return "\n".join(lines + ["(no rows)"])
        lines.append("| " + " | ".join(fmt(c) for c in cols) + " |")
        lines.append("| " + " | ".join("---" for _ in cols) + " |")
        for row in self.rows:
            lines.append("| " + " | ".join(fmt(row.get(c)) for c in cols) + " |")
        return "\n".join(lines)

    def print(self, file: Any = None) -> None:
        print(self.to_markdown(), file=file or sys.stdout, flush=True)
        print(file=file or sys.stdout)


# ---- plots --------------------------------------------------------------------------------


def plot_panels(
    path: Path | str,
    panels: Sequence[Mapping[str, Any]],
    *,
    title: str | None = None,
    ncols: int = 3,
) -> Path | None:
    """Draw line plots (one subplot per panel) into a PNG with matplotlib's Agg backend.

    Each panel: ``{"title": str, "xlabel": str, "ylabel": str, "logx": bool,
    "series": {label: (xs, ys)}, "ceilings": {label: value}}``; ceilings are drawn as
    horizontal dashed lines (e.g. the measured copy bandwidth). Returns the path, or None
    when matplotlib is not installed or nothing is plottable.
    """
    panels = [p for p in panels if any(len(xs) for xs, _ in p.get("series", {}).values())]
    if not panels:
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is not installed; no plot written to %s", path)
        return None
    ncols = max(1, min(ncols, len(panels)))
    nrows = -(-len(panels) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.2 * ncols, 3.8 * nrows), squeeze=False)
    # Fixed margins: tight_layout costs seconds per figure and these grids are regular.
    width, height = 5.2 * ncols, 3.8 * nrows
    fig.subplots_adjust(left=0.95 / width, right=1 - 0.15 / width, bottom=0.5 / height,
                        top=1 - (0.6 if title else 0.35) / height, wspace=0.3, hspace=0.45)
    for ax, panel in zip(axes.flat, panels):
        for label, (xs, ys) in sorted(panel["series"].items()):
            pts = sorted((x, y) for x, y in zip(xs, ys) if y is not None)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=label)
        for i, (label, value) in enumerate(panel.get("ceilings", {}).items()):
            if value:
                ax.axhline(value, color="k", ls=("--", ":", "-.")[i % 3], lw=1, label=f"{label} ({value:.3g})")
        if panel.get("logx"):
            ax.set_xscale("log", base=2)
        ax.set_title(panel.get("title", ""), fontsize=9)
        ax.set_xlabel(panel.get("xlabel", ""))
        ax.set_ylabel(panel.get("ylabel", ""))
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    if title:
        fig.suptitle(title, fontsize=10)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

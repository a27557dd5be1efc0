"""Explicit configuration: frozen dataclasses, and the current config as a context.

``VattnConfig`` bundles a ``CacheConfig`` and a ``CompilationConfig``. Attention layers
register themselves in ``CompilationConfig.static_forward_context`` at construction, so a
model must be built inside ``set_current_vattn_config(cfg)``.
"""

from __future__ import annotations

import contextlib
import enum
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

__all__ = [
    "CacheConfig",
    "CompilationConfig",
    "CUDAGraphMode",
    "VattnConfig",
    "get_current_vattn_config",
    "set_current_vattn_config",
    "CACHE_DTYPES",
]

#: Valid ``cache_dtype`` strings and the torch dtype name they store ("auto" = model dtype).
CACHE_DTYPES = ("auto", "bfloat16", "float16", "float32", "fp8", "fp8_e4m3", "fp8_e5m2")


class CUDAGraphMode(enum.Enum):
    """How decode steps are captured in CUDA graphs (see ``vattn.cudagraph``)."""

    NONE = "none"
    PIECEWISE = "piecewise"
    FULL = "full"
    FULL_DECODE_ONLY = "full_decode_only"
    FULL_AND_PIECEWISE = "full_and_piecewise"


#: ``CacheConfig.mamba_cache_dtype`` / ``mamba_ssm_cache_dtype`` values ("auto": the model dtype).
MAMBA_STATE_DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache settings.

    Args:
        block_size: tokens per KV-cache block (page).
        cache_dtype: one of ``CACHE_DTYPES``; ``"auto"`` stores the model dtype,
            ``"fp8"``/``"fp8_e4m3"``/``"fp8_e5m2"`` store fp8 with per-layer scales.
        sliding_window: model-wide sliding window (tokens), ``None`` for full attention.
        calculate_kv_scales: compute fp8 k/v scales from the first batch that runs.
        mamba_cache_dtype: mixer layers' conv states: ``"auto"`` (the model dtype), ``"float32"``,
            ``"bfloat16"`` or ``"float16"`` (vLLM's name).
        mamba_ssm_cache_dtype: mixer layers' recurrent (SSM, delta-rule, linear) states: ``"float32"``
            (default: they accumulate over the whole sequence), ``"auto"`` (the model dtype, as
            vLLM's default: half the state traffic of a bf16 model's decodes), ``"bfloat16"``, ``"float16"``.
    """

    block_size: int = 16
    cache_dtype: str = "auto"
    sliding_window: int | None = None
    calculate_kv_scales: bool = False
    mamba_cache_dtype: str = "auto"
    mamba_ssm_cache_dtype: str = "float32"

    def __post_init__(self) -> None:
        if not isinstance(self.block_size, int) or isinstance(self.block_size, bool) or self.block_size <= 0:
            raise ValueError(
                f"CacheConfig.block_size must be a positive int, got {self.block_size!r}; "
                "use e.g. 16 or 32."
            )
        if self.cache_dtype not in CACHE_DTYPES:
            raise ValueError(
                f"CacheConfig.cache_dtype must be one of {CACHE_DTYPES}, got {self.cache_dtype!r}."
            )
        window = self.sliding_window
        if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window <= 0):
            raise ValueError(
                f"CacheConfig.sliding_window must be None or a positive int (tokens), got {window!r}; "
                "pass None for full attention."
            )
        for name in ("mamba_cache_dtype", "mamba_ssm_cache_dtype"):
            if getattr(self, name) not in MAMBA_STATE_DTYPES:
                raise ValueError(f"CacheConfig.{name} must be one of {MAMBA_STATE_DTYPES}, got "
                                 f"{getattr(self, name)!r}.")
        if not isinstance(self.calculate_kv_scales, bool):
            raise TypeError(
                f"CacheConfig.calculate_kv_scales must be a bool, got {self.calculate_kv_scales!r}."
            )


def _default_capture_sizes(max_size: int = 256) -> tuple[int, ...]:
    sizes = [s for s in (1, 2, 4) if s <= max_size]
    sizes += list(range(8, max_size + 1, 8))
    return tuple(sizes)


@dataclass(frozen=True)
class CompilationConfig:
    """Compile and CUDA-graph settings.

    ``static_forward_context`` maps a layer name (the ``prefix`` given to
    ``vattn.Attention``) to the layer; it is filled while the model is built. It is the
    one mutable field (a dict owned by this config).

    Args:
        cudagraph_mode: see ``CUDAGraphMode``.
        cudagraph_capture_sizes: batch sizes (tokens) to capture; ``None`` = 1, 2, 4, 8, 16, ...
        max_capture_size: the largest capture size when ``cudagraph_capture_sizes`` is None.
        splitting_ops: ops at which ``vattn.compile`` splits the FX graph.
        passes: names of the post-grad passes to run, in order (see ``vattn.compile_passes``);
            the fp8 query-quant fusion must stay on for fp8 caches to compile without a
            standalone quant kernel per layer; ``unfuse_addmm`` keeps residual adds out of
            cuBLAS ``addmm`` on GPUs (it saves a memcpy per projection).
        use_inductor: compile the pieces with Inductor (else run them as FX graphs).
        compile_sizes: token counts for which every piece is also compiled for that exact
            size (vLLM's ``compile_sizes``), on the first step of that size: a step of
            exactly that many tokens then runs the static code. At 1 token Inductor turns
            each matrix multiply into a matrix-vector reduction it fuses with the norms and
            activations around it. These compiles use coordinate-descent tuning unless
            ``inductor_compile_config`` says otherwise.
        piece_passes: graph rewrites run on every piece before it is compiled, in order: each
            is called as ``pass_(graph, example_inputs, num_tokens)`` with the piece's
            ``fx.GraphModule`` (Dynamo's graph: torch functions, before AOT tracing), its
            (fake) inputs, and the exact token count of a ``compile_sizes`` compile (None for
            the general code); it edits ``graph`` in place and returns how many rewrites it
            made. This is how a model routes its own kernels into compiled code, e.g.
            ``examples.gemv.OneTokenGemv()`` for batch-1 linear layers.
        merge_packed_linears: after the piece passes, run the bias-free linear layers of one
            input whose weights are consecutive rows of one buffer (q / k / v, gate / up of a
            transformers model after ``vattn.integrations.transformers.wrap``, which packs them)
            as one GEMM (``vattn.compile_passes.packed_linears``).
        fuse_rope: hand the model's rotary embedding of q and k (transformers'
            ``apply_rotary_pos_emb``: rotate-half form over the whole head) to the attention op
            as (T, D) cos / sin rows (``vattn.compile_passes.rope_fusion``), so it costs no kernel
            of its own. None (default): for the layers whose backend rotates q and the new keys
            in its own kernels (TRITON_ATTN); True: every layer (the others rotate in the op,
            in torch); False: never.
        inductor_compile_config: extra Inductor config (``torch._inductor.config`` names) for
            every piece compile, e.g. ``{"max_autotune": True}``. On sm_90+ GPUs the pieces
            compile with Inductor's programmatic dependent launch on (``triton.enable_pdl``:
            each kernel's launch overlaps the one before it), and on CUDA GPUs with its combo
            kernels (``combo_kernels``: independent kernels of a piece, such as RoPE of q and of
            k, as one launch), unless this sets them; a model run
            without CUDA graphs, whose steps the host bounds, may pass
            ``{"triton.enable_pdl": False}`` (PDL launches cost the host more).
        debug_dump_path: where passes dump graphs before/after, if set.
        cache_dir: a directory where ``vattn.compile`` saves Dynamo's trace of the model
            (one file per model, config and input signature) and from which a later start
            loads it instead of tracing again (``vattn.compile_passes.aot_cache``; torch
            2.10+). Inductor's own cache (``TORCHINDUCTOR_CACHE_DIR``) still serves the
            kernels. None (default): ``$VATTN_CACHE_ROOT/compile`` (``~/.cache/vattn/compile``),
            or no trace kept when ``VATTN_DISABLE_COMPILE_CACHE=1``, as vLLM's compile cache
            (``VLLM_CACHE_ROOT``, ``VLLM_DISABLE_COMPILE_CACHE``).
    """

    cudagraph_mode: CUDAGraphMode = CUDAGraphMode.NONE
    cudagraph_capture_sizes: tuple[int, ...] | None = None
    max_capture_size: int = 256
    splitting_ops: tuple[str, ...] = (
        "vattn::unified_attention",
        "vattn::unified_attention_with_output",
        "vattn::unified_mla_attention_with_output",
        "vattn::mixer_with_output",
    )
    passes: tuple[str, ...] = ("noop_elimination", "query_quant_fusion", "attn_quant_fusion", "defunctionalize",
                               "unfuse_addmm")
    use_inductor: bool = True
    compile_sizes: tuple[int, ...] = ()
    piece_passes: tuple[Callable[..., int], ...] = field(default=(), compare=False)
    merge_packed_linears: bool = True
    fuse_rope: bool | None = None
    inductor_compile_config: dict[str, Any] = field(default_factory=dict, compare=False)
    debug_dump_path: str | None = None
    cache_dir: str | None = None
    static_forward_context: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        sizes = self.compile_sizes
        if not isinstance(sizes, (tuple, list)) or not all(isinstance(n, int) and n > 0 for n in sizes):
            raise ValueError(
                f"CompilationConfig.compile_sizes must be a tuple of positive token counts, got {sizes!r}; "
                "e.g. (1,) to compile batch-1 decode steps for their exact size."
            )
        object.__setattr__(self, "compile_sizes", tuple(sorted(set(sizes))))  # frozen: hashable, canonical
        passes = self.piece_passes
        if not isinstance(passes, (tuple, list)) or not all(callable(p) for p in passes):
            raise TypeError(
                f"CompilationConfig.piece_passes must be a tuple of callables "
                f"(graph, example_inputs, num_tokens) -> int, got {passes!r}."
            )
        object.__setattr__(self, "piece_passes", tuple(passes))
        if self.fuse_rope not in (None, True, False):
            raise TypeError(f"CompilationConfig.fuse_rope must be None (backends that rotate in their kernels), "
                            f"True or False, got {self.fuse_rope!r}.")
        if not isinstance(self.inductor_compile_config, dict):
            raise TypeError(
                f"CompilationConfig.inductor_compile_config must be a dict of torch._inductor.config "
                f"names to values, got {type(self.inductor_compile_config).__name__}."
            )

    def capture_sizes(self) -> tuple[int, ...]:
        """The batch sizes to capture, ascending."""
        if self.cudagraph_capture_sizes is not None:
            return tuple(sorted(set(self.cudagraph_capture_sizes)))
        return _default_capture_sizes(self.max_capture_size)


@dataclass(frozen=True)
class VattnConfig:
    """Everything vattn needs to know about a model's attention."""

    cache: CacheConfig = field(default_factory=CacheConfig)
    compilation: CompilationConfig = field(default_factory=CompilationConfig)

    # vLLM spells these cache_config / compilation_config; keep both readable.
    @property
    def cache_config(self) -> CacheConfig:
        return self.cache

    @property
    def compilation_config(self) -> CompilationConfig:
        return self.compilation

    def attention_layers(self) -> dict[str, Any]:
        """The registered attention layers (``vattn.Attention``, ``vattn.MLAAttention``) by name, in
        construction order (mixer layers, which register beside them, are left out)."""
        # Mixers (vattn.MambaBase) declare a mamba_type; read as an attribute, config imports no layer module.
        return {n: x for n, x in self.compilation.static_forward_context.items() if not getattr(x, "mamba_type", "")}


_current_config: list[VattnConfig] = []


def get_current_vattn_config() -> VattnConfig:
    """The config set by the innermost ``set_current_vattn_config``.

    Outside any, returns a process-wide default config (so a layer built without one
    still works; its name goes into that default's static forward context).
    """
    if _current_config:
        return _current_config[-1]
    return _DEFAULT_CONFIG


@contextlib.contextmanager
def set_current_vattn_config(config: VattnConfig) -> Iterator[VattnConfig]:
    """Make ``config`` current inside the block; restores the previous one on exit (also on error)."""
    if not isinstance(config, VattnConfig):
        raise TypeError(
            f"set_current_vattn_config expects a vattn.VattnConfig, got {type(config).__name__}."
        )
    _current_config.append(config)
    try:
        yield config
    finally:
        _current_config.pop()


_DEFAULT_CONFIG = VattnConfig()

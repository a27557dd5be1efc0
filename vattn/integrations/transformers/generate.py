"""transformers' ``generate()`` on a wrapped model, with vattn's paged cache as its KV cache.

transformers' own loop runs every step: logits processors, sampling, stopping criteria, EOS
and padding, so the tokens are its tokens (the same logits, up to the attention kernel's
rounding). vattn serves the cache and the attention through transformers' contracts:

- ``VattnCache`` is a ``transformers.Cache`` whose layers keep no tensors: ``update`` passes the
  step's new K/V through (and counts them), so the attention function gets the *new* keys and
  values, which ``vattn.Attention`` writes into its paged cache before it attends.
- ``GENERATE_IMPLEMENTATION`` ("vattn_generate") is registered as an attention function and a
  mask function. The mask function hands over transformers' 2D padding mask. From it (or the
  mask a mixer module gets), the first layer of each forward builds the step's metadata, for
  every layer of that forward. Each row is one request, with state slot = its row (hybrids'
  mixers); its padding tokens are left out; its positions count its real tokens, as
  transformers' ``position_ids`` do.
- ``generate`` (what ``wrap`` installs as the model's ``generate``) allocates a paged cache (and
  a state slot per row) for the call, switches the model's attention implementation to
  ``GENERATE_IMPLEMENTATION`` for the call, runs transformers' ``generate`` with a
  ``VattnCache`` (over the model's own cache class where its forward insists on one: MiniMax),
  and puts everything back.

Beam search and other generate modes that reorder or copy cache rows are refused.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from typing import Any, Iterator

import torch
from torch import nn

import vattn
from vattn.layer import Attention
from vattn.mixers.base import MambaBase

__all__ = ["GENERATE_IMPLEMENTATION", "VattnCache", "generate"]

#: The attention implementation a wrapped model runs under during ``generate``.
GENERATE_IMPLEMENTATION = "vattn_generate"

_ACTIVE: contextvars.ContextVar["VattnCache | None"] = contextvars.ContextVar("vattn_generate_cache", default=None)


@functools.lru_cache(maxsize=None)
def _layer_class() -> type:
    from transformers.cache_utils import CacheLayerMixin

    class VattnCacheLayer(CacheLayerMixin):
        """One layer of a ``VattnCache``: K/V live in vattn's paged cache, the token count in the cache."""

        def __init__(self, owner: Any) -> None:
            super().__init__()
            self.owner = owner  # the VattnCache: one count of tokens for every layer, mixers included

        def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
            self.is_initialized = True

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
                   **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
            self.is_initialized = True
            return key_states, value_states  # the new ones: vattn.Attention caches them itself

        def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
            return self.owner.seen + query_length, 0

        def get_seq_length(self) -> int:
            return self.owner.seen

        def get_max_length(self) -> int:
            return -1

        def reset(self) -> None:
            pass

        def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
            raise NotImplementedError(_NO_REORDER)

    return VattnCacheLayer


_NO_REORDER = ("generate() on vattn keeps one request per batch row and cannot reorder or copy rows (beam search, "
               "num_return_sequences > 1 with a shared prompt, assisted decoding); use num_beams=1.")


class _VattnCacheMixin:
    """transformers' cache interface over a ``vattn.PagedKVCache``: row ``r`` of the batch owns
    blocks ``[r * blocks_per_row, (r + 1) * blocks_per_row)`` and state slot ``r``."""

    def __init__(self, kv: "vattn.PagedKVCache", config: "vattn.VattnConfig", num_layers: int, batch: int,
                 blocks_per_row: int) -> None:
        from transformers.cache_utils import Cache

        Cache.__init__(self, layers=[_layer_class()(self) for _ in range(num_layers)])  # type: ignore[arg-type]
        self.kv, self.vattn_config = kv, config
        self.tables = [list(range(r * blocks_per_row, (r + 1) * blocks_per_row)) for r in range(batch)]
        self.seen = 0  # tokens of each row, padding included (transformers' cache length)
        self.counts = [0] * batch  # real tokens of each row so far
        self._step: tuple[Any, Any] | None = None  # (metadata, flat indices of the real new tokens)
        self._ran: set[int] = set()  # the modules of this forward that took the step

    def __len__(self) -> int:
        return len(self.layers)  # type: ignore[attr-defined]

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError(_NO_REORDER)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError(_NO_REORDER)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError(_NO_REORDER)

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError(_NO_REORDER)

    def step(self, module: nn.Module, batch: int, q_len: int, mask: torch.Tensor | None,
             device: torch.device) -> tuple[Any, ...]:
        """(metadata by layer name, the flat indices of the real new tokens in request order, or
        None where that is every token in batch order): built once per forward, by its first
        layer (a module that already took this step starts the next forward). ``mask``: the 2D
        padding mask (B, >= q_len), whose last q_len columns mark the real new tokens, or None."""
        if self._step is not None and id(module) not in self._ran:
            self._ran.add(id(module))
            return self._step
        if mask is None:
            real = torch.ones(batch, q_len, dtype=torch.bool)
        else:
            real = mask.to("cpu", torch.bool)[:, -q_len:]  # one sync a forward
        qlens = real.sum(1).tolist()
        # Requests in the batch: rows with new tokens, one-token ones first (vattn's order).
        order = sorted((r for r in range(batch) if qlens[r]), key=lambda r: qlens[r] > 1)
        flat = torch.arange(batch * q_len).view(batch, q_len)
        rows = torch.cat([flat[r][real[r]] for r in order]) if order else torch.zeros(0, dtype=torch.long)
        extra = {"state_indices": order} if self.kv.states else {}
        common = self.kv.common_metadata([qlens[r] for r in order], [self.counts[r] for r in order],
                                         [self.tables[r] for r in order], **extra)
        every = order == list(range(batch)) and bool(real.all())  # no padding, batch order: no gather
        self._step = (self.kv.build_metadata(common), None if every else rows.to(device))
        self._ran = {id(module)}
        self.counts = [c + n for c, n in zip(self.counts, qlens)]
        self.seen += q_len
        return self._step


@functools.lru_cache(maxsize=None)
def _cache_class(base: type | None = None) -> type:
    """``VattnCache`` over transformers' ``Cache``, or over ``base``: a model's own cache class
    that its forward insists on (MiniMax's), whose methods the mixin's replace."""
    from transformers.cache_utils import Cache

    return type("VattnCache", (_VattnCacheMixin, base or Cache), {"__doc__": _VattnCacheMixin.__doc__})


def _own_cache_class(model: nn.Module) -> type | None:
    """The cache class the model's modeling module defines, if exactly one (MiniMax's ``MiniMaxCache``)."""
    import sys

    from transformers.cache_utils import Cache

    module = sys.modules.get(type(model).__module__)
    found = [c for c in vars(module).values() if isinstance(c, type) and issubclass(c, Cache)
             and c.__module__ == module.__name__] if module is not None else []
    return found[0] if len(found) == 1 else None


def generation_step(cache: Any, module: nn.Module, batch: int, q_len: int, mask: torch.Tensor | None,
                    device: torch.device) -> tuple[Any, Any, "vattn.VattnConfig"]:
    """A mixer module's step during ``generate``: (metadata, real-token rows or None, config).
    Raises where ``cache`` is transformers' own (not a wrapped model's generate())."""
    if not isinstance(cache, _VattnCacheMixin):
        raise NotImplementedError(
            f"{module._get_name()}: transformers' own cache ({type(cache).__name__}) is in use, and vattn keeps "
            "the mixer state of a wrapped model itself. Generate with the model's generate() (wrap installs one "
            "that runs on vattn's cache), or run steps through the VattnCausalLM wrap returns.")
    md, rows = cache.step(module, batch, q_len, mask, device)
    return md, rows, cache.vattn_config


def __getattr__(name: str) -> Any:
    if name == "VattnCache":  # built on first use: transformers is imported lazily
        return _cache_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def generate_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                       **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract during ``generate``.

    | tensor | shape |
    | --- | --- |
    | query | (B, H, q, D) |
    | key, value | (B, Hk, q, D): the step's new tokens (``VattnCache.update`` passes them through) |
    | attention_mask | (B, seen) bool padding mask, or None (no padding) |
    | returns | ((B, q, H, D), None); padding rows are zeros |
    """
    cache = _ACTIVE.get()
    layer = module._modules.get("attn")
    if cache is None or not isinstance(layer, Attention):
        raise RuntimeError(f"{type(module).__name__}: attn_implementation={GENERATE_IMPLEMENTATION!r} runs only "
                           "inside generate() of a model wrapped by vattn.integrations.transformers.wrap.")
    b, h, q, d = query.shape
    md, rows = cache.step(module, b, q, attention_mask, query.device)
    flat = lambda x: x.transpose(1, 2).reshape(b * q, x.shape[1], d)  # noqa: E731  (T, heads, D)
    with vattn.set_forward_context(md, cache.vattn_config):
        if rows is None:  # every token real, rows in batch order
            return layer(flat(query), flat(key), flat(value)).view(b, q, h, d), None
        out = query.new_zeros(b * q, h * d)
        out[rows] = layer(flat(query)[rows], flat(key)[rows], flat(value)[rows])
    return out.view(b, q, h, d), None


def generate_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
                  mask_function: Any = None, attention_mask: torch.Tensor | None = None,
                  **kwargs: Any) -> torch.Tensor | None:
    """transformers' 2D padding mask as it is (None: no padding): vattn's metadata does the rest."""
    return attention_mask


def register() -> None:
    """Register ``GENERATE_IMPLEMENTATION`` with transformers (attention and mask functions; idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(GENERATE_IMPLEMENTATION, generate_attention)
    AttentionMaskInterface.register(GENERATE_IMPLEMENTATION, generate_mask)


@contextlib.contextmanager
def _implementation(model: nn.Module, name: str) -> Iterator[None]:
    """Every config of ``model`` that names its attention implementation names ``name`` inside."""
    configs = {id(m.config): m.config for m in model.modules() if hasattr(getattr(m, "config", None), "_attn_implementation")}
    saved = {k: c._attn_implementation for k, c in configs.items()}
    try:
        for c in configs.values():
            c._attn_implementation = name
        yield
    finally:
        for k, c in configs.items():
            c._attn_implementation = saved[k]


def _max_new_tokens(model: nn.Module, prompt_len: int, kwargs: dict[str, Any]) -> int:
    config = kwargs.get("generation_config") or getattr(model, "generation_config", None)
    new = kwargs.get("max_new_tokens", getattr(config, "max_new_tokens", None))
    if new is None:
        new = kwargs.get("max_length", getattr(config, "max_length", None) or 20) - prompt_len
    return max(int(new), 1)


@functools.lru_cache(maxsize=None)
def _cache_argument(cls: type) -> str:
    """The name ``cls.generate`` takes a cache by: ``cache`` (transformers 5.x), else ``past_key_values``."""
    import inspect

    try:
        source = inspect.getsource(cls.generate)
    except (OSError, TypeError):
        return "past_key_values"
    return "cache" if 'new_name="cache"' in source or "cache: Cache" in source else "past_key_values"


def generate(model: nn.Module, vattn_config: "vattn.VattnConfig", *args: Any, **kwargs: Any) -> Any:
    """``model.generate(...)`` of a wrapped transformers model (``wrap`` installs it): transformers'
    own ``generate`` with a ``VattnCache`` over a paged cache allocated for the call (each row of
    the batch gets the blocks its prompt and ``max_new_tokens`` need). The layers' own caches
    (an engine's) are bound again afterwards."""
    if kwargs.get("num_beams", getattr(getattr(model, "generation_config", None), "num_beams", 1) or 1) > 1:
        raise NotImplementedError(f"{type(model).__name__}.generate(num_beams > 1): {_NO_REORDER}")
    if kwargs.get("use_cache") is False or kwargs.get("cache_implementation") is not None:
        raise ValueError(f"{type(model).__name__}.generate: vattn serves the cache of a wrapped model; leave use_cache "
                         "and cache_implementation unset.")
    for name in ("past_key_values", "cache"):
        if kwargs.get(name) is not None:
            raise ValueError(f"{type(model).__name__}.generate({name}=...): vattn keeps the cache of a wrapped model; "
                             f"leave {name} unset.")
    input_ids = kwargs.get("input_ids", kwargs.get("inputs", args[0] if args else None))
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise ValueError(f"{type(model).__name__}.generate: expected input_ids, a (batch, prompt_len) tensor of token "
                         f"ids, got {type(input_ids).__name__}; pass tokenizer(..., return_tensors='pt').input_ids.")
    register()
    layers = [m for m in model.modules() if isinstance(m, (Attention, MambaBase))]
    batch, prompt_len = input_ids.shape
    block_size = vattn_config.cache.block_size
    per_row = -(-(prompt_len + _max_new_tokens(model, prompt_len, kwargs)) // block_size)
    saved = [(layer, layer.kv_cache) for layer in layers]
    weight = next(model.parameters())
    slots = {"num_state_slots": batch} if any(isinstance(m, MambaBase) for m in layers) else {}
    try:
        kv = vattn.allocate_kv_cache(vattn_config, num_blocks=batch * per_row, device=weight.device,
                                     dtype=weight.dtype if weight.is_floating_point() else None, **slots)
        text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        cache = _cache_class(_own_cache_class(model))(kv, vattn_config, text.num_hidden_layers, batch, per_row)
        token = _ACTIVE.set(cache)
        try:
            with _implementation(model, GENERATE_IMPLEMENTATION):
                return type(model).generate(model, *args, **{_cache_argument(type(model)): cache}, **kwargs)
        finally:
            _ACTIVE.reset(token)
    finally:
        for layer, caches in saved:
            layer.kv_cache = caches

"""The ``vattn::`` custom ops, each registered with its fake (see ``library.register_op``).

| module | ops |
| --- | --- |
| ``attention`` | ``unified_attention_with_output``, ``unified_attention``, ``maybe_calc_kv_scales`` |
| ``kv_store`` | ``reshape_and_cache_flash`` (and ``store_kv``, which every backend calls) |
| ``mla`` | ``unified_mla_attention_with_output``, ``concat_and_cache_mla`` (and ``store_latent``) |
| ``mixer`` | ``mixer_with_output`` (every Mamba-family layer) |
| ``quant_fp8`` | ``static_scaled_fp8_quant`` (and the ``QuantFP8`` module) |

Importing this package registers them all. Triton kernels shared by ops and backends live in
``vattn.kernels``; each backend's own kernels live beside it.
"""

from vattn.ops import attention, kv_store, mixer, mla, quant_fp8  # noqa: F401  (registers the ops)

"""CUDA graphs for decode steps: ``CUDAGraphRunner``.

Usage::

    compiled = vattn.compile(model, cfg)               # needed for PIECEWISE
    graphs = vattn.CUDAGraphRunner(compiled, cfg, kv, max_batch_size=64,
                                   mode=vattn.CUDAGraphMode.FULL_AND_PIECEWISE)
    graphs.capture()                                   # optional: the first call captures
    hidden = graphs(input_ids, positions, common)      # common: CommonAttentionMetadata (unpadded)
    hidden = hidden.clone()                            # the next call overwrites graph outputs

The runner graphs any step function whose tensor inputs it is told: ``inputs=`` is one
``GraphInput`` (dtype, non-token shape, token dimension) per tensor argument, by default
``input_ids`` (T,) and ``positions`` (T,), both int64. ``__call__(*tensors, common_attn_metadata)``
checks the tensors against that description, copies them into persistent buffers sized for the
largest capture (padded tokens read zeros), builds the backend metadata itself
(``kv.build_metadata``) and sets the forward context; callers do not. It returns the step's
output for the T real tokens (``[:T]`` of every token-major tensor).

Modes (``CUDAGraphMode``): NONE runs eagerly. PIECEWISE replays each compiled piece of a
``vattn.compile``d model from a graph captured per size, with attention eager in between.
FULL captures the whole forward, attention included, for every batch the backends' builders
allow (``kv.can_run_in_cudagraph``). FULL_DECODE_ONLY uses full graphs for uniform
single-token decode batches and runs everything else eagerly; FULL_AND_PIECEWISE uses full
graphs for those and piecewise graphs for the rest. Per step the dispatcher picks FULL, then
PIECEWISE, then eager. A batch of T tokens is padded to the smallest capture size >= T
(padded tokens: slot -1; padded decode requests: query length 1, sequence length 1 on block
0; see ``pad_common_attn_metadata``); a batch above the largest size runs eagerly.
Modes the backends or the model cannot serve are downgraded with a logged reason
(``CUDAGraphRunner.downgrade_reasons``).

Capture: sizes largest first, one shared memory pool (``torch.cuda.graph_pool_handle()``),
one eager warm-up per size, a progress bar. ``stats`` reports capture seconds and graph
memory. ``VATTN_CUDAGRAPH_DEBUG=1`` checks on every replay (otherwise on the first replay of
each graph) that inputs and metadata sit at the addresses the capture read.

Contract for metadata builders that declare ``cudagraph_support`` above NEVER
-----------------------------------------------------------------------------
A full graph freezes kernel launches, their scalar arguments and every tensor address at
capture; only tensor *contents* change between replays. So a builder must:

1. Own persistent device buffers sized for the largest capture (``max_num_reqs`` = the
   largest capture size, ``max_num_tokens`` likewise, block-table width =
   ``ceil(max_model_len / block_size)``), allocated once (e.g. in ``__init__`` or on the first
   build) and never reallocated.
2. In ``build(common_prefix_len, common)``, when ``common`` is a padded batch
   (``common.num_reqs`` = padded request count, ``slot_mapping.shape[0]`` = padded token
   count), write every graph-visible tensor into those buffers in place (``copy_`` /
   ``fill_``, device ops only, no reallocation) and return metadata whose tensor fields are
   views of the buffers starting at the same addresses for every batch of that padded size
   (e.g. ``buf[:num_reqs]``; never ``buf[offset:]`` with a batch-dependent offset). Stale
   rows past the batch must be overwritten with padding values the kernels accept
   (seq_len 0/1, slot -1, block 0).
3. In ``build_for_cudagraph_capture(common)``, return metadata for a uniform decode batch of
   ``common.num_reqs`` requests through the same buffers, with every host scalar the kernels
   take as a launch argument (max_seq_len, number of KV splits, workspace sizes, ...) set to
   a value valid for every later batch of that size (e.g. the cache's maximum), since these
   are frozen into the graph.
4. Make ``can_run_in_cudagraph(common)`` (declared by ``cudagraph_support``) return False for
   every batch its captured kernels cannot serve.

The runner checks rule 2: after ``build`` at replay, every CUDA tensor field of every
group's metadata must have the data pointer it had at capture, else ``RuntimeError``.

Modules: ``policy`` (sizes, mode downgrades, the dispatcher, padding: pure, CPU-testable),
``inputs`` (``GraphInput``, argument checks, persistent input buffers), ``runner``
(``CUDAGraphRunner``: capture and replay).
"""

from __future__ import annotations

from vattn.cudagraph.inputs import GraphInput
from vattn.cudagraph.policy import (BatchDescriptor, bucket_size, choose_runtime_mode, is_uniform_decode,
                                    pad_common_attn_metadata, resolve_capture_sizes, resolve_cudagraph_mode)
from vattn.cudagraph.runner import CUDAGraphRunner

__all__ = ["BatchDescriptor", "CUDAGraphRunner", "GraphInput", "bucket_size", "choose_runtime_mode",
           "is_uniform_decode", "pad_common_attn_metadata", "resolve_capture_sizes", "resolve_cudagraph_mode"]

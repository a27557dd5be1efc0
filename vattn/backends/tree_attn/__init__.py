"""TREE_ATTN: tree-shaped speculative decoding over the paged cache.

A step's requests may carry draft trees: ``CommonAttentionMetadata.tree_parents`` gives each
new token its parent's index among its request's new tokens, -1 for a token that continues
the cached context (``vattn.build_common_attn_metadata(..., tree_parents=...)`` checks them).
Each new token attends to the whole cached context plus its ancestors and itself, as vLLM's
TreeAttention defines it; requests without a tree (``tree_parents`` None, or each token's
parent the token before it) get causal attention. The new tokens are written to the cache in
query order (token ``i`` at position ``num_computed_tokens + i``), and that is the ``q_idx`` /
``kv_idx`` a user mod sees, not the token's depth in its tree.

Two kernels serve it. A layer without a mask_mod or score_mod runs TRITON_ATTN's unified
kernel with its tree mask (``vattn.backends.draft_tree.token_tree_rows``: one row of ancestors
per query token; the new keys of a request sit in masked tiles), the faster on the GPU
(``benchmarks/bench_flex.py``'s tree step); TRITON_ATTN itself honors ``tree_parents`` the same
way. A layer with mods runs FLEX_ATTENTION: the builder turns the parents into each launch's
ancestor matrix (``ancestors``) and the block masks are evaluated from it, narrowed by the mods.
Steps with trees never replay full CUDA graphs (decode-only steps do).

| module | what |
| --- | --- |
| ``backend`` | ``TreeAttentionBackend`` (FLEX_ATTENTION's declarations) and ``TreeAttentionImpl`` |
| ``metadata`` | ``TreeAttentionMetadata`` (both kernels' halves), ``TreeAttentionMetadataBuilder``, ``ancestors`` |
"""

from vattn.backends.tree_attn.backend import TreeAttentionBackend, TreeAttentionImpl
from vattn.backends.tree_attn.metadata import TreeAttentionMetadata, TreeAttentionMetadataBuilder, ancestors

__all__ = ["TreeAttentionBackend", "TreeAttentionImpl", "TreeAttentionMetadata", "TreeAttentionMetadataBuilder",
           "ancestors"]

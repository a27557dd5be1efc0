"""TREE_ATTN: tree-shaped speculative decoding over the paged cache, on FLEX_ATTENTION.

A step's requests may carry draft trees: ``CommonAttentionMetadata.tree_parents`` gives each
new token its parent's index among its request's new tokens, -1 for a token that continues
the cached context (``vattn.build_common_attn_metadata(..., tree_parents=...)`` checks them).
Each new token attends to the whole cached context plus its ancestors and itself, as vLLM's
TreeAttention defines it; requests without a tree (``tree_parents`` None, or each token's
parent the token before it) get causal attention. The new tokens are written to the cache in
query order (token ``i`` at position ``num_computed_tokens + i``), and that is the ``q_idx`` /
``kv_idx`` a user mod sees, not the token's depth in its tree.

Built on FLEX_ATTENTION: the builder turns the parents into each launch's ancestor matrix
(``ancestors``) and the block masks are evaluated from it; the kernels are FlexAttention's. A
dedicated Triton kernel is not part of this version: which one is faster is for the GPU
benchmark (``benchmarks/bench_flex.py``'s tree step) to say.

| module | what |
| --- | --- |
| ``backend`` | ``TreeAttentionBackend`` (FLEX_ATTENTION's declarations) and ``TreeAttentionImpl`` |
| ``metadata`` | ``TreeAttentionMetadataBuilder`` and ``ancestors`` |
"""

from vattn.backends.tree_attn.backend import TreeAttentionBackend, TreeAttentionImpl
from vattn.backends.tree_attn.metadata import TreeAttentionMetadataBuilder, ancestors

__all__ = ["TreeAttentionBackend", "TreeAttentionImpl", "TreeAttentionMetadataBuilder", "ancestors"]

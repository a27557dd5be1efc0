"""``TreeAttentionBackend``: TREE_ATTN, FLEX_ATTENTION with each step's draft trees as the base mask."""

from __future__ import annotations

from vattn.backends.flex_attention.backend import FlexAttentionBackend
from vattn.backends.flex_attention.impl import FlexAttentionImpl
from vattn.backends.flex_attention.paging import TREE
from vattn.backends.tree_attn.metadata import TreeAttentionMetadataBuilder

__all__ = ["TreeAttentionBackend", "TreeAttentionImpl"]


class TreeAttentionImpl(FlexAttentionImpl):
    """``FlexAttentionImpl`` whose base mask is the draft tree: every new token sees the cached
    context, itself and its ancestors (a user mask_mod, window and score mods still apply)."""

    base_mask = TREE
    backend_name = "TREE_ATTN"


class TreeAttentionBackend(FlexAttentionBackend):
    """Tree-shaped speculative decoding: draft tokens attend to the context and their ancestors."""

    @staticmethod
    def get_name() -> str:
        return "TREE_ATTN"

    @staticmethod
    def get_impl_cls() -> type[TreeAttentionImpl]:
        return TreeAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[TreeAttentionMetadataBuilder]:
        return TreeAttentionMetadataBuilder

"""TREE_ATTN: a step whose requests carry draft trees, against a float32 reference with explicit
ancestor masks; the ancestor closure, the parents' checks, selection, and (``cuda``) the GPU."""

from __future__ import annotations

import pytest
import torch

import vattn
from attn_harness import BatchSpec, RandomBatch, assert_close, check_cache_untouched, make_random_batch, tree_allowed
from flex_harness import check_block_masks, explicit_reference, positions, run_impl
from vattn.backends.flex_attention import mods
from vattn.core.registry import AttentionBackendEnum
from vattn.backends.tree_attn import TreeAttentionBackend, TreeAttentionImpl, TreeAttentionMetadataBuilder, ancestors
from vattn.metadata import build_common_attn_metadata

GEOMETRY = dict(num_heads=8, num_kv_heads=2, head_size=64, block_size=4)
#: A decode, a plain prefill (a chain), two trees over cached context, one tree from scratch.
PARENTS = [[-1], [-1, 0, 1, 2, 3, 4], [-1, 0, 0, 1, 1, 2, -1], [-1, 0, 1, 0, 3], [-1, -1, 0, 1, 1, 2, 3, 0, 7]]
CONTEXT = (9, 0, 20, 3, 0)


def tree_batch(parents: list[list[int]] = PARENTS, context: tuple[int, ...] = CONTEXT, seed: int = 1,
               **kw: object) -> tuple[RandomBatch, vattn.CommonAttentionMetadata]:
    spec = BatchSpec(context_lens=context, query_lens=tuple(len(p) for p in parents), **{**GEOMETRY, **kw})  # type: ignore[arg-type]
    batch = make_random_batch(spec, seed=seed)
    common = build_common_attn_metadata(list(spec.query_lens), list(context), batch.block_tables, spec.block_size,
                                        device=spec.device, tree_parents=[p for ps in parents for p in ps])
    return batch, common


def test_ancestors_close_the_parent_relation() -> None:
    got = ancestors(torch.tensor([[-1, 0, 0, 1, 3, -1, 5]]))[0]
    want = torch.zeros(7, 7, dtype=torch.bool)
    for i, chain in enumerate([[0], [1, 0], [2, 0], [3, 1, 0], [4, 3, 1, 0], [5], [6, 5]]):
        want[i, chain] = True
    assert torch.equal(got, want)
    assert torch.equal(ancestors(torch.tensor([[-1]])), torch.ones(1, 1, 1, dtype=torch.bool))


def test_tree_step_matches_explicit_masks() -> None:
    batch, common = tree_batch()
    out, before, impl, md = run_impl(batch, TreeAttentionImpl, TreeAttentionMetadataBuilder, common=common)
    want = explicit_reference(batch, impl.scale, tree_allowed(batch.spec.context_lens, PARENTS))
    assert_close(out[: batch.num_actual_tokens], want, torch.float32)
    check_cache_untouched(before, batch.kv_cache, common.slot_mapping)
    check_block_masks(md, impl.mask_spec)
    assert md.calls[0].tree is None and md.calls[1].tree is not None  # the decode launch needs none


def test_tree_step_compiled() -> None:
    batch, common = tree_batch(seed=2)
    out, _, impl, _ = run_impl(batch, TreeAttentionImpl, TreeAttentionMetadataBuilder, common=common, compiled=True)
    want = explicit_reference(batch, impl.scale, tree_allowed(batch.spec.context_lens, PARENTS))
    assert_close(out[: batch.num_actual_tokens], want, torch.float32)


def test_without_trees_it_is_causal_and_a_user_mask_narrows_the_tree() -> None:
    batch, common = tree_batch(seed=3)
    common.tree_parents = None
    out, _, impl, _ = run_impl(batch, TreeAttentionImpl, TreeAttentionMetadataBuilder, common=common)
    assert_close(out[: batch.num_actual_tokens], batch.reference(scale=impl.scale), torch.float32)

    batch, common = tree_batch(seed=4)
    out, _, impl, md = run_impl(batch, TreeAttentionImpl, TreeAttentionMetadataBuilder, common=common,
                                mask_mod=mods.sliding_window(4))
    allowed = [a & (k > q - 4) for a, (q, k) in zip(tree_allowed(batch.spec.context_lens, PARENTS),
                                                      (positions(batch, r) for r in range(len(PARENTS))))]
    assert_close(out[: batch.num_actual_tokens], explicit_reference(batch, impl.scale, allowed), torch.float32)
    check_block_masks(md, impl.mask_spec)


def test_wide_tree_of_64_drafts_with_gqa_and_bf16() -> None:
    """One tree of 64 draft tokens (a root and binary branching) over a long context, beside decodes."""
    parents = [[-1]] * 3 + [[-1] + [(i - 1) // 2 for i in range(1, 64)]]
    batch, common = tree_batch(parents, context=(30, 5, 17, 70), seed=5, dtype=torch.bfloat16, block_size=16)
    out, _, impl, md = run_impl(batch, TreeAttentionImpl, TreeAttentionMetadataBuilder, common=common)
    want = explicit_reference(batch, impl.scale, tree_allowed(batch.spec.context_lens, parents))
    assert_close(out[: batch.num_actual_tokens], want, torch.bfloat16)
    check_block_masks(md, impl.mask_spec)


@pytest.mark.parametrize("parents, match", [
    ([[-1], [-1, 1, 0, 0, 0, 0], [-1] * 7, [-1] * 5, [-1] * 9], r"tree_parents\[2\]: expected -1 or an earlier"),
    ([[-2], [-1] * 6, [-1] * 7, [-1] * 5, [-1] * 9], r"tree_parents\[0\]"),
])
def test_bad_parents_are_refused(parents: list[list[int]], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        tree_batch(parents)
    with pytest.raises(ValueError, match="one entry per new token"):
        build_common_attn_metadata([2, 1], [0, 0], [[0], [1]], 4, tree_parents=[-1, 0])


def test_tree_attn_is_a_backend_of_its_own() -> None:
    cls = AttentionBackendEnum.TREE_ATTN.get_class()
    assert cls is TreeAttentionBackend and cls.get_name() == "TREE_ATTN"
    assert cls.get_impl_cls() is TreeAttentionImpl and cls.get_builder_cls() is TreeAttentionMetadataBuilder
    with vattn.set_current_vattn_config(vattn.VattnConfig()):
        layer = vattn.Attention(8, 64, 0.125, num_kv_heads=2, prefix="l0.attn", attn_backend="TREE_ATTN")
    assert isinstance(layer.impl, TreeAttentionImpl) and layer.impl.mask_spec.base == "tree"
    with pytest.raises(NotImplementedError, match="^TREE_ATTN kv_cache_dtype: expected"):
        TreeAttentionImpl(4, 64, 0.1, kv_cache_dtype="fp8")


@pytest.mark.cuda
def test_cuda_tree_step_compiled() -> None:
    parents = [[-1]] * 3 + [[-1] + [(i - 1) // 2 for i in range(1, 64)]]
    batch, common = tree_batch(parents, context=(30, 5, 17, 700), seed=6, dtype=torch.bfloat16, block_size=16,
                               device="cuda")
    out, _, impl, md = run_impl(batch, TreeAttentionImpl, TreeAttentionMetadataBuilder, common=common, compiled=True)
    want = explicit_reference(batch, impl.scale, tree_allowed(batch.spec.context_lens, parents))
    assert_close(out[: batch.num_actual_tokens], want, torch.bfloat16, factor=2.0)
    check_block_masks(md, impl.mask_spec)


def test_graph_metadata_of_triton_only_groups_is_persistent() -> None:
    """A group whose layers TRITON_ATTN serves skips FlexAttention's half; every tensor its
    metadata carries must still be the buffer a CUDA graph captured (the runner checks the
    addresses at the first replay), the slot mapping included. Builder level, no kernel runs."""
    import dataclasses

    from test_flex_attention import flex_model

    _, _, kv = flex_model(2, attn_backend=TreeAttentionBackend)
    builder = kv.groups[0].builder
    builder.use_triton = builder._triton().use_persistent_buffers = True  # as on CUDA

    def tensors(md: object) -> dict[str, int]:
        return {f.name: getattr(md, f.name).data_ptr() for f in dataclasses.fields(md)
                if isinstance(getattr(md, f.name), torch.Tensor)}

    captured = kv.build_metadata_for_cudagraph_capture(kv.common_metadata([1, 1], [7, 20], [[0, 1], [2, 3]]))
    md = captured["layers.0.attn"]
    assert md.flex_skipped and md.triton is not None
    step = kv.build_metadata(kv.common_metadata([1, 1], [9, 3], [[4, 5], [6, 7]]))["layers.0.attn"]
    assert step.flex_skipped and tensors(step) == tensors(md) and "slot_mapping" in tensors(md)
    assert step.slot_mapping.tolist() == [4 * 16 + 9, 6 * 16 + 3]

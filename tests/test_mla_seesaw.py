"""TRITON_MLA's warp-specialized Hopper decode (``vattn.backends.mla.triton_mla.seesaw``).

On any machine: the tiles that take the warpgroup-MMA kernel also ask for this one, it says
which caches it cannot read, and it compiles for sm_90 with the installed Triton (a renamed
Gluon API, or a lowering the installed Triton cannot do, fails here rather than on a GPU). On
sm_90 (``cuda``): it matches a float32 reference on random batches whose latent rows past each
request's end hold NaN (odd lengths, shuffled blocks, pages of 64 and 128, splits, a head group
past the last head, a padding request), and ``mla_decode`` takes it for launches without splits
only. The backend and CUDA-graph tests with 128 heads in ``test_mla_wgmma`` run through it.
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton")

from test_mla_wgmma import HOPPER_SMEM, SM90, _reference, compiled_smem_in_child  # noqa: E402

from vattn.backends.mla.triton_mla import config as cfg  # noqa: E402

needs_sm90 = pytest.mark.skipif(not SM90, reason="the warp-specialized decode runs on Hopper (sm_90) GPUs only")


def _seesaw():  # noqa: ANN202
    pytest.importorskip("triton.experimental.gluon", reason="this Triton has no Gluon")
    from vattn.backends.mla.triton_mla import seesaw

    return seesaw


def test_tiles_ask_for_it_with_the_warpgroup_mma_kernel() -> None:
    assert cfg.decode_tiles(128, 512, HOPPER_SMEM, capability=(9, 0)).seesaw
    assert not cfg.decode_tiles(128, 512, HOPPER_SMEM).seesaw  # capability unknown
    assert not cfg.decode_tiles(16, 512, HOPPER_SMEM, capability=(9, 0)).seesaw


def test_unsupported_caches_are_named() -> None:
    seesaw = _seesaw()
    assert seesaw.seesaw_unsupported(torch.zeros(4, 64, 576, dtype=torch.bfloat16)) is None
    assert seesaw.seesaw_unsupported(torch.zeros(4, 128, 576, dtype=torch.bfloat16)) is None
    assert "multiple of 64" in seesaw.seesaw_unsupported(torch.zeros(4, 16, 576, dtype=torch.bfloat16))
    gapped = torch.zeros(4, 65, 576, dtype=torch.bfloat16)[:, :64]  # a block stride of 65 rows
    assert "evenly spaced" in seesaw.seesaw_unsupported(gapped)


def test_launch_choice() -> None:
    """``launch._hopper_decode`` (the device is the caller's check, so CPU tensors stand in):
    this kernel for a launch without splits over pages of 64-row multiples, the warpgroup-MMA
    kernel for other supported tensors, neither where the tiles or the tensors rule both out."""
    from vattn.backends.mla.triton_mla import launch, wgmma

    seesaw = _seesaw()
    tiles = cfg.decode_tiles(128, 512, HOPPER_SMEM, capability=(9, 0))
    q_nope, q_pe = torch.zeros(2, 128, 512, dtype=torch.bfloat16), torch.zeros(2, 128, 64, dtype=torch.bfloat16)
    out = torch.empty_like(q_nope)

    def choice(page: int, splits: int, dtype: torch.dtype = torch.bfloat16, t: cfg.DecodeTiles = tiles):  # noqa: ANN202
        cache = torch.zeros(4, page, 576, dtype=dtype)
        return launch._hopper_decode(q_nope.to(dtype), q_pe.to(dtype), cache, out.to(dtype), t, splits)

    assert choice(64, 1) is seesaw.mla_decode_seesaw
    assert choice(128, 1) is seesaw.mla_decode_seesaw
    assert choice(64, 2) is wgmma.mla_decode_wgmma
    assert choice(16, 1) is wgmma.mla_decode_wgmma
    assert choice(64, 1, t=cfg.DecodeTiles(64, 64, 8, 2, wgmma=True)) is wgmma.mla_decode_wgmma
    assert choice(64, 1, dtype=torch.float32) is None
    assert choice(64, 1, t=cfg.decode_tiles(128, 512, HOPPER_SMEM)) is None


_COMPILE = """
import json, sys
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from vattn.backends.mla.triton_mla import seesaw as s
page, splits, dtype = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
kernel = s._mla_decode_seesaw_kernel
names = [p.name for p in kernel.params]
consts = dict(PAGE=page, NUM_SPLITS=splits, num_warps=4)
cache = torch.empty(8, page, 576, dtype=torch.bfloat16 if dtype == "bf16" else torch.float16)

def mangle(d):  # the descriptor's signature type, as Triton's JIT would specialize it
    if hasattr(d, "__mangle__"):
        return d.__mangle__()
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend
    return native_specialize_impl(BaseBackend, d, False, True, True)[0]

descs = {n: mangle(TensorDescriptor(cache, [8 * page, 576], [576, 1], [64, w], s._smem_layout()))
         for n, w in (("desc_c", s.HALF), ("desc_e", s.ROPE))}
ptrs = {"q_nope_ptr": dtype, "q_pe_ptr": dtype, "out_ptr": dtype, "part_o_ptr": "fp32",
        "part_lse_ptr": "fp32", "qsl_ptr": "i32", "seq_lens_ptr": "i32", "bt_ptr": "i32"}
sig = {n: "constexpr" if n in consts else descs.get(n) or (f"*{ptrs[n]}" if n in ptrs else
       "fp32" if n == "sm_scale_log2" else "i32") for n in names}
# what Triton's JIT specializes: 16-byte aligned pointers, strides divisible by 16
attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n in ptrs or n.startswith("stride")}
src = GluonASTSource(kernel, sig, {(names.index(n),): v for n, v in consts.items()}, attrs)
compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
print(json.dumps({"shared": compiled.metadata.shared}))
"""


@pytest.mark.parametrize("page,splits,dtype", [(64, 1, "bf16"), (128, 4, "fp16")])
def test_kernel_compiles_for_sm90(page: int, splits: int, dtype: str) -> None:
    """Compiled for sm_90 by the installed Triton (no GPU needed): it fits Hopper's shared memory."""
    _seesaw()
    assert compiled_smem_in_child(_COMPILE, page, splits, dtype) <= HOPPER_SMEM


# ---- sm_90 ----------------------------------------------------------------------------------------


def _inputs(heads: int, page: int, dtype: torch.dtype, seed: int):  # noqa: ANN202
    """A batch whose cache rows past each request's end (in its last page) hold NaN."""
    g = torch.Generator().manual_seed(seed)
    lens = [1, 63, 64, 65, 127, 128, 129, 777, 0]  # the last request is padding (no query row)
    nb = [-(-max(n, 1) // page) for n in lens]
    num_blocks = sum(nb) + 3
    perm = torch.randperm(num_blocks, generator=g)
    table = torch.zeros(len(lens), max(nb), dtype=torch.int32)
    i = 0
    for r, k in enumerate(nb):
        table[r, :k] = perm[i:i + k]
        i += k
    cache = torch.randn(num_blocks, page, 576, generator=g)
    for r, n in enumerate(lens):
        if n:
            cache.view(-1, 576)[table[r, (n - 1) // page].item() * page + (n - 1) % page + 1:
                                (table[r, (n - 1) // page].item() + 1) * page] = float("nan")
    rows = len(lens) - 1
    dev = "cuda"
    q_nope = torch.randn(rows, heads, 512, generator=g).to(dev, dtype)
    q_pe = torch.randn(rows, heads, 64, generator=g).to(dev, dtype)
    qsl = torch.tensor(list(range(rows + 1)) + [rows], dtype=torch.int32, device=dev)
    return (q_nope, q_pe, cache.to(dev, dtype), qsl, torch.tensor(lens, dtype=torch.int32, device=dev),
            table.to(dev), lens)


@pytest.mark.cuda
@needs_sm90
@pytest.mark.parametrize("heads,page,splits,dtype", [(128, 64, 1, torch.bfloat16), (128, 128, 1, torch.float16),
                                                      (96, 64, 4, torch.bfloat16), (64, 128, 2, torch.float16)])
def test_gpu_matches_reference(heads: int, page: int, splits: int, dtype: torch.dtype) -> None:
    from vattn.backends.mla.triton_mla import launch

    seesaw = _seesaw()
    q_nope, q_pe, cache, qsl, seq, table, lens = _inputs(heads, page, dtype, seed=heads + page + splits)
    scale = 1.0 / math.sqrt(192)
    out = torch.full_like(q_nope, 7.0)
    assert seesaw.seesaw_unsupported(cache) is None
    rows = q_nope.shape[0]
    n_o, n_lse = cfg.split_scratch_numel(rows, heads, 512, splits)
    part_o = torch.empty(n_o, dtype=torch.float32, device="cuda")
    part_lse = torch.empty(n_lse, dtype=torch.float32, device="cuda")
    seesaw.mla_decode_seesaw(q_nope, q_pe, cache, out, query_start_loc=qsl, seq_lens=seq, block_table=table,
                             softmax_scale=scale, num_splits=splits, partial_out=part_o, partial_lse=part_lse)
    if splits > 1:  # merged as launch.mla_decode merges them
        launch._COMBINE[(rows, heads)](out, part_o, part_lse, heads, rows, *out.stride(), LORA=512, LORA_PAD=512,
                                       NUM_SPLITS=splits, num_warps=8)
    tol = 2e-2 if dtype == torch.bfloat16 else 4e-3
    torch.testing.assert_close(out.float(), _reference(q_nope, q_pe, cache, table, lens, scale), atol=tol, rtol=tol)


@pytest.mark.cuda
@needs_sm90
def test_gpu_launch_takes_it_without_splits_only(monkeypatch: pytest.MonkeyPatch) -> None:
    from vattn.backends.mla.triton_mla import launch

    seesaw = _seesaw()
    calls = []
    real = seesaw.mla_decode_seesaw
    monkeypatch.setattr(seesaw, "mla_decode_seesaw", lambda *a, **k: calls.append(k["num_splits"]) or real(*a, **k))
    tiles = cfg.decode_tiles(128, 512, HOPPER_SMEM, capability=(9, 0))
    for page, splits, taken in ((64, 1, True), (64, 2, False), (16, 1, False)):
        q_nope, q_pe, cache, qsl, seq, table, lens = _inputs(128, page, torch.bfloat16, seed=page + splits)
        out = torch.empty_like(q_nope)
        calls.clear()
        launch.mla_decode(q_nope, q_pe, cache, out, query_start_loc=qsl, seq_lens=seq, block_table=table,
                          softmax_scale=0.1, kv_lora_rank=512, num_splits=splits, tiles=tiles)
        assert bool(calls) == taken, (page, splits)
        torch.testing.assert_close(out.float(), _reference(q_nope, q_pe, cache, table, lens, 0.1), atol=2e-2, rtol=2e-2)

"""TRITON_MLA's Hopper decode on warpgroup MMAs (``vattn.backends.mla.triton_mla.wgmma``).

On any machine: the tiles pick it on sm_90 only (many heads, DeepSeek's 512-wide latent), its
split count fills one wave, and the kernel compiles for sm_90 with the installed Triton (so a
Triton upgrade that renames a Gluon API fails here, not on a GPU). On sm_90 (``cuda``): it
matches a float32 reference and the Triton kernel on random batches (odd lengths, shuffled
blocks, one-id and per-row block lookups, splits, a head group past the last head, a padding
request), and through the backend and CUDA-graph replay with 128 heads.
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton")

from vattn.backends.mla.triton_mla import config as cfg  # noqa: E402

SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
HOPPER_SMEM = 227 << 10


def test_tiles_take_wgmma_on_hopper_with_many_heads_only() -> None:
    t = cfg.decode_tiles(128, 512, HOPPER_SMEM, capability=(9, 0))
    assert t.wgmma and (t.block_h, t.block_n, t.num_warps, t.num_stages) == (64, 64, 8, 2)
    assert cfg.decode_tiles(64, 512, HOPPER_SMEM, capability=(9, 0)).wgmma
    assert not cfg.decode_tiles(128, 512, HOPPER_SMEM).wgmma  # capability unknown
    assert not cfg.decode_tiles(128, 512, HOPPER_SMEM, capability=(10, 0)).wgmma  # Blackwell: no wgmma
    assert not cfg.decode_tiles(16, 512, HOPPER_SMEM, capability=(9, 0)).wgmma  # 16-head tiles stay
    assert not cfg.decode_tiles(128, 256, HOPPER_SMEM, capability=(9, 0)).wgmma  # another latent width
    assert not cfg.decode_tiles(128, 512, 163 << 10, capability=(9, 0)).wgmma  # too little shared memory


def test_one_wave_splits() -> None:
    """At most one program per SM (two waves cost a whole second pass for a few programs)."""
    assert cfg.decode_num_splits(64, 128, 512, 132, block_h=64, one_wave=True) == 1  # 128 programs
    assert cfg.decode_num_splits(32, 128, 512, 132, block_h=64, one_wave=True) == 2  # 128 programs
    assert cfg.decode_num_splits(8, 128, 512, 132, block_h=64, one_wave=True) == 8
    assert cfg.decode_num_splits(1, 128, 512, 132, block_h=64, one_wave=True) == cfg.ONE_WAVE_MAX_SPLITS == 64
    assert cfg.decode_num_splits(200, 128, 512, 132, block_h=64, one_wave=True) == 1
    budget = cfg.split_scratch_numel(1, 128, 512, 4)[0]  # the scratch caps it too
    assert cfg.decode_num_splits(1, 128, 512, 132, scratch_numel=budget, block_h=64, one_wave=True) == 4


_COMPILE = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from vattn.backends.mla.triton_mla import wgmma as w
page, splits, dtype = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
kernel = w._mla_decode_wgmma_kernel
names = [p.name for p in kernel.params]
consts = dict(LORA=w.LORA, ROPE=w.ROPE, PAGE=page, BLOCK_H=w.BLOCK_H, BLOCK_N=w.BLOCK_N, NUM_SPLITS=splits,
              num_warps=w.NUM_WARPS)
ptrs = {"q_nope_ptr": dtype, "q_pe_ptr": dtype, "cache_ptr": dtype, "out_ptr": dtype, "part_o_ptr": "fp32",
        "part_lse_ptr": "fp32", "qsl_ptr": "i32", "seq_lens_ptr": "i32", "bt_ptr": "i32"}
sig = {n: "constexpr" if n in consts else f"*{ptrs[n]}" if n in ptrs else "fp32" if n == "sm_scale_log2" else "i32"
       for n in names}
# what Triton's JIT specializes: 16-byte aligned pointers, strides divisible by 16
attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n in ptrs or n.startswith("stride")}
src = GluonASTSource(kernel, sig, {(names.index(n),): v for n, v in consts.items()}, attrs)
compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": w.NUM_WARPS})
print(json.dumps({"shared": compiled.metadata.shared}))
"""


def compiled_smem_in_child(script: str, *args: object) -> int:
    """Run a script that compiles a Gluon kernel for sm_90 and prints ``{"shared": bytes}`` last,
    in a child process (which keeps Triton's exit-time binding messages out of this one); skip
    where this Triton compiles Gluon through another interface. Returns the shared memory."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("triton.experimental.gluon", reason="this Triton has no Gluon")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # Gluon compiles; it never interprets
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, "-c", script, *map(str, args)], capture_output=True, text=True, env=env,
                         timeout=300)
    if run.returncode != 0 and "GluonASTSource" in run.stderr and "ImportError" in run.stderr:
        pytest.skip("this Triton compiles Gluon through another interface")
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])["shared"]


@pytest.mark.parametrize("page,splits,dtype", [(64, 1, "bf16"), (16, 4, "fp16")])
def test_kernel_compiles_for_sm90(page: int, splits: int, dtype: str) -> None:
    """Compiled for sm_90 by the installed Triton (no GPU needed): it fits Hopper's shared memory."""
    assert compiled_smem_in_child(_COMPILE, page, splits, dtype) <= HOPPER_SMEM


# ---- sm_90 ----------------------------------------------------------------------------------------

needs_sm90 = pytest.mark.skipif(not SM90, reason="the warpgroup-MMA decode runs on Hopper (sm_90) GPUs only")


def _decode_inputs(heads: int, page: int, dtype: torch.dtype, seed: int):  # noqa: ANN202
    g = torch.Generator().manual_seed(seed)
    lens = [1, 63, 64, 65, 777, 0]  # the last request is padding (no query row)
    nb = [-(-max(n, 1) // page) for n in lens]
    num_blocks = sum(nb) + 3
    perm = torch.randperm(num_blocks, generator=g)
    width = max(nb)
    table = torch.zeros(len(lens), width, dtype=torch.int32)
    i = 0
    for r, k in enumerate(nb):
        table[r, :k] = perm[i:i + k]
        i += k
    rows = len(lens) - 1
    qsl = torch.tensor(list(range(rows + 1)) + [rows], dtype=torch.int32)
    dev = "cuda"
    cache = torch.randn(num_blocks, page, 576, generator=g).to(dev, dtype)
    q_nope = torch.randn(rows, heads, 512, generator=g).to(dev, dtype)
    q_pe = torch.randn(rows, heads, 64, generator=g).to(dev, dtype)
    return (q_nope, q_pe, cache, qsl.to(dev), torch.tensor(lens, dtype=torch.int32, device=dev), table.to(dev), lens)


def _reference(q_nope, q_pe, cache, table, lens, scale):  # noqa: ANN001, ANN202
    out = []
    for r in range(q_nope.shape[0]):
        lat = cache[table[r].long()].reshape(-1, 576)[: lens[r]].float()
        s = (q_nope[r].float() @ lat[:, :512].T + q_pe[r].float() @ lat[:, 512:].T) * scale
        out.append(s.softmax(-1) @ lat[:, :512])
    return torch.stack(out)


@pytest.mark.cuda
@needs_sm90
@pytest.mark.parametrize("heads,page,splits,dtype", [(128, 64, 1, torch.bfloat16), (128, 64, 4, torch.bfloat16),
                                                      (96, 16, 2, torch.float16), (64, 128, 8, torch.bfloat16)])
def test_gpu_matches_reference_and_triton_kernel(heads: int, page: int, splits: int, dtype: torch.dtype) -> None:
    from vattn.backends.mla.triton_mla import launch, wgmma

    q_nope, q_pe, cache, qsl, seq, table, lens = _decode_inputs(heads, page, dtype, seed=heads + page + splits)
    scale = 1.0 / math.sqrt(192)
    want = _reference(q_nope, q_pe, cache, table, lens, scale)
    outs = {}
    for use in (True, False):
        out = torch.full_like(q_nope, 7.0)
        assert wgmma.wgmma_unsupported(q_nope, q_pe, cache, out) is None and launch._wgmma() is wgmma
        launch.mla_decode(q_nope, q_pe, cache, out, query_start_loc=qsl, seq_lens=seq, block_table=table,
                          softmax_scale=scale, kv_lora_rank=512, num_splits=splits,
                          tiles=cfg.DecodeTiles(64, 64, 8, 2, wgmma=use))
        outs[use] = out.float()
    tol = 2e-2 if dtype == torch.bfloat16 else 4e-3
    torch.testing.assert_close(outs[True], want, atol=tol, rtol=tol)
    torch.testing.assert_close(outs[True], outs[False], atol=tol, rtol=tol)


@pytest.mark.cuda
@needs_sm90
def test_gpu_unsupported_tensors_take_the_triton_kernel() -> None:
    """Tensors the kernel cannot take are named, and run the Triton kernel with the same tiles."""
    from vattn.backends.mla.triton_mla import launch, wgmma

    q_nope, q_pe, cache, qsl, seq, table, lens = _decode_inputs(128, 64, torch.bfloat16, seed=3)
    out = torch.empty_like(q_nope)
    assert "dtype" in wgmma.wgmma_unsupported(q_nope.float(), q_pe.float(), cache.float(), out.float())
    assert "unit strides" in wgmma.wgmma_unsupported(q_nope.transpose(1, 2).contiguous().transpose(1, 2), q_pe,
                                                     cache, out)
    shifted = torch.empty(cache.numel() + 4, dtype=cache.dtype, device=cache.device)
    misaligned = shifted[4:].view(cache.shape)  # 8 bytes past a 16-byte boundary
    misaligned.copy_(cache)
    assert "16" in wgmma.wgmma_unsupported(q_nope, q_pe, misaligned, out)
    scale = 0.1
    launch.mla_decode(q_nope, q_pe, misaligned, out, query_start_loc=qsl, seq_lens=seq, block_table=table,
                      softmax_scale=scale, kv_lora_rank=512, num_splits=2, tiles=cfg.DecodeTiles(64, 64, 8, 2, wgmma=True))
    torch.testing.assert_close(out.float(), _reference(q_nope, q_pe, cache, table, lens, scale), atol=2e-2, rtol=2e-2)


@pytest.mark.cuda
@needs_sm90
def test_gpu_backend_with_128_heads() -> None:
    """Through the TRITON_MLA backend (its builder picks the kernel and a one-wave split count)."""
    from test_mla import _gpu_check

    assert cfg.decode_tiles(128, 512, cfg.device_smem_bytes("cuda"), capability=cfg.device_capability("cuda")).wgmma

    _gpu_check("TRITON_MLA", dict(context_lens=(0, 37, 100, 5, 700), query_lens=(1, 1, 30, 9, 1), block_size=64,
                                  num_heads=128))
    _gpu_check("TRITON_MLA", dict(context_lens=(15, 16, 17, 3000, 1), query_lens=(1, 1, 1, 1, 1), num_heads=128,
                                  num_pad_tokens=3))


@pytest.mark.cuda
@needs_sm90
def test_gpu_cuda_graph_replay_with_128_heads() -> None:
    from test_mla import DEEPSEEK, _graph_replays

    _graph_replays("TRITON_MLA", "cuda", (1, 4, 16, 64), {**DEEPSEEK, "num_heads": 128}, max_ctx=900,
                   num_blocks=64 * 57 + 8)

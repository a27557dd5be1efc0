"""Triton kernels of vattn's unified paged attention (the launcher is ``vattn.backends.triton.paged_attention``).

One kernel serves a whole mixed batch (decodes and chunked prefills with cached context):

* grid ``(q_blocks, num_kv_heads, num_splits)``; a q block is ``BLOCK_Q`` consecutive query
  tokens of one request. Request ``i`` owns the q blocks
  ``[cu_q[i] // BLOCK_Q + i, cu_q[i] // BLOCK_Q + i + cdiv(q_len_i, BLOCK_Q))``, so
  ``T // BLOCK_Q + num_seqs`` programs cover any batch of ``T`` tokens; a program finds its
  request (the request a decode batch would give it, checked against ``cu_q``; a binary search
  over ``cu_q`` when that is wrong) and exits if it has no tokens (CUDA-graph friendly: the
  grid depends only on static sizes).
* GQA packing: the ``QPK = H // Hk`` query heads of one KV head are packed into the tile's M
  dimension, row ``r`` = (token ``r // QPK``, head ``kv_head * QPK + r % QPK``), so every K/V
  tile is read once per KV head and fed to ``tl.dot``.
* online softmax in the log2 domain (scores pre-multiplied by ``log2(e)``, ``exp2``), fp32
  accumulators; key tiles of ``TILE_N`` tokens gathered through the block table (one
  block-table entry per token, so any page size works), loads contiguous along head_dim;
  the entries of the next tile are prefetched a tile ahead so the K/V loads pipeline.
* the KV range of a q block is split into masked edge tiles (causal diagonal, window edges,
  the partial last tile) and unmasked interior tiles that skip all mask arithmetic; decode
  configs (``ONE_LOOP``) instead run every tile masked in one loop, so the software pipeline
  never drains before the last tile.
* fp8 KV: tiles are cast to fp16 (exact for e4m3 / e5m2), the scales folded into the
  softmax scale and the output; on sm_89+ the value tile is converted with PTX
  ``cvt.rn.f16x2.e4m3x2`` before Triton's dot-layout load (``_fp8_to_f16``).
* fused KV store (``FUSE_STORE``, decode configs): the kernel writes the step's new K/V
  rows into the cache itself (split 0 of each q block, its KV head), and no program reads a
  slot this launch writes: the cache loop stops at the context, and split 0 attends to the
  step's keys from the ``key``/``value`` rows (a one-token query's own key from registers,
  one online-softmax update; a longer one's in masked tiles). No store kernel runs first.
* programmatic dependent launch (``PDL_WAIT``): launched with it, the kernel reads the step's
  metadata (its request, the new tokens' slots, the first key tile's block-table entries) while
  the kernel before it finishes, then waits for it (``gdc_wait``) before reading q or the new K/V.
* draft trees (``TREE``): a byte row per query token says which of its request's new tokens
  it sees (its ancestors and itself); the step's keys then lie in masked tiles only.
* rotary embedding (``ROPE``): q and the step's new keys arrive unrotated and are rotated by
  each token's cos / sin rows as they are loaded (``vattn.kernels.rotary``): the model runs no
  RoPE kernel of its own (``vattn.compile_passes.rope_fusion``).
* split-KV (``SPLIT_KV``): each of the grid's ``num_programs(2)`` splits handles a slice of
  the block's KV tiles and writes a normalized partial output plus its log2-sum-exp;
  ``_combine_splits_kernel`` merges them. The split count is a run-time value, so one
  compiled kernel serves every count (a CUDA-graph capture of 11 batch sizes compiles two
  variants, not one per power of two).
"""

from __future__ import annotations

import triton
import triton.language as tl

from vattn.kernels.fp8 import round_to_fp8_grid, to_cache_dtype
from vattn.kernels.reduce import MAX as _MAX
from vattn.kernels.reduce import SUM as _SUM
from vattn.kernels.rotary import rotate_half_load

LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)


@triton.jit
def _fp8_to_f16(x, E5M2: tl.constexpr):
    """fp8 bytes (uint8, e4m3fn or e5m2) -> fp16, two values per ``cvt`` (sm_89+ PTX).

    Not pure on purpose: Triton hoists pure element-wise casts of a dot operand below the
    shared-memory -> dot-layout load, which for the value tile (whose reduction axis, the
    key axis, is not the contiguous one) means one byte-wide shared load per element. Kept
    here, the cast runs on the 16-byte-vector load layout and the tile reaches the dot as
    fp16 (``ldmatrix.trans``).
    """
    if E5M2:
        return tl.inline_asm_elementwise(
            asm="{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.rn.f16x2.e5m2x2 $0, lo; "
                "cvt.rn.f16x2.e5m2x2 $1, hi; }",
            constraints="=r,=r,r", args=[x], dtype=tl.float16, is_pure=False, pack=4)
    return tl.inline_asm_elementwise(
        asm="{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.rn.f16x2.e4m3x2 $0, lo; "
            "cvt.rn.f16x2.e4m3x2 $1, hi; }",
        constraints="=r,=r,r", args=[x], dtype=tl.float16, is_pure=False, pack=4)


@triton.jit
def _attend_tiles(
    acc, m_i, l_i, q, q_pos, alibi2,
    k_head_ptr, v_head_ptr, bt_row_ptr,
    j_lo, j_hi, seq_len,
    qk_scale2, softcap_in, softcap_out, window_left, window_right,
    stride_kb, stride_ks, stride_kd, stride_vb, stride_vs, stride_vd,
    n_first, row_shift, k_scale_ptr, v_scale_ptr,
    BLOCK_M: tl.constexpr, HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr,
    TILE_N: tl.constexpr, PAGE_SIZE: tl.constexpr, COMPUTE_DTYPE: tl.constexpr,
    DOT_FP32: tl.constexpr, MASK: tl.constexpr, CAUSAL: tl.constexpr,
    USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr, USE_ALIBI: tl.constexpr,
    V_CVT: tl.constexpr, KV_SAME: tl.constexpr,
    FROM_INPUT: tl.constexpr = False, CACHE_TY: tl.constexpr = None, KV_FP8: tl.constexpr = False,
    KV_FP8_MAX: tl.constexpr = 0.0, KV_ROUND_FIX: tl.constexpr = 0,
    TREE: tl.constexpr = False, tree_ptr=None, tree_rows=None, tree_ctx=0, blk_first=None,
    ROPE: tl.constexpr = False, cos_ptr=None, sin_ptr=None, stride_rope=0, num_blocks=1, tree_w=0,
):
    """Online-softmax update over key tiles ``[j_lo, j_hi)``; ``MASK`` adds all masking.

    ``V_CVT``: 0 casts the value tile with ``.to(COMPUTE_DTYPE)``; 1 / 2 convert an e4m3 /
    e5m2 tile to fp16 with ``_fp8_to_f16`` (GPU only). ``KV_SAME``: the key and value caches
    share their strides (views of one tensor), so one offset tensor addresses both.

    ``FROM_INPUT`` (needs ``MASK``): the keys are the step's new ones, read from the (T, Hk, D)
    key / value rows (``k_head_ptr``/``v_head_ptr`` at the KV head, ``stride_ks``/``stride_vs``
    the token strides): position ``n >= n_first`` is row ``n + row_shift``, converted as the
    cache stores it (``CACHE_TY``, fp8 with ``k_scale_ptr``/``v_scale_ptr``).

    ``TREE`` (needs ``MASK``): a key at position ``n >= tree_ctx`` (the step's new token
    ``n - tree_ctx``) is visible to row ``r`` only where ``tree_ptr[tree_rows[r] + n - tree_ctx]``
    is nonzero (``tree_rows``: (BLOCK_M,) int64 offsets of the rows' ancestor bytes, < 0 for
    padding rows; ``tree_w``: the bytes of a row, never read past).

    Block ids are clamped into ``[0, num_blocks)`` as they are used: a hand-built block table
    never checked on the host (device metadata) reads a wrong block, never outside the cache.

    ``blk_first``: the (TILE_N,) block-table entries of tile ``j_lo``, loaded by the caller
    (before it waits for the kernel before it); None: loaded here.

    ``ROPE`` (needs ``FROM_INPUT``): the key rows are unrotated; row ``r`` is rotated by the
    ``cos_ptr`` / ``sin_ptr`` rows ``r`` (token stride ``stride_rope``) as it is loaded."""
    offs_d = tl.arange(0, HEAD_PAD)
    d_ok = offs_d < HEAD_SIZE
    offs_t = tl.arange(0, TILE_N)
    if not FROM_INPUT:
        # Block-table entries are prefetched one tile ahead into registers (a loop-carried
        # value, plain loads): the K/V addresses of tile j then depend on no load of iteration
        # j, so Triton's pipeliner can keep num_stages - 1 K/V tiles in flight. (Loaded in the
        # same iteration, the entries go through cp.async too, and reading them back forces a
        # wait_group 0 every iteration: no load then overlaps any compute.)
        n_lim = tl.minimum(seq_len, j_hi * TILE_N)  # tokens this loop reads
        if blk_first is None:
            nxt = j_lo * TILE_N + offs_t
            # Unsigned: token -> (page, slot) is a shift and a mask for power-of-two page sizes.
            blk_next = tl.load(bt_row_ptr + nxt.to(tl.uint32) // PAGE_SIZE, mask=nxt < n_lim, other=0)
        else:
            blk_next = blk_first
    for j in range(j_lo, j_hi):
        offs_n = j * TILE_N + offs_t
        if FROM_INPUT:
            n_ok = (offs_n < seq_len) & (offs_n >= n_first)
            kv_mask = n_ok[:, None] & d_ok[None, :]
            rows = (offs_n + row_shift).to(tl.int64)
            k_off = (rows * stride_ks)[:, None] + offs_d[None, :] * stride_kd
            v_off = (rows * stride_vs)[:, None] + offs_d[None, :] * stride_vd
        else:
            blk = tl.minimum(tl.maximum(blk_next.to(tl.int64), 0), num_blocks - 1)
            nxt = offs_n + TILE_N
            blk_next = tl.load(bt_row_ptr + nxt.to(tl.uint32) // PAGE_SIZE, mask=nxt < n_lim, other=0)
            if MASK:
                n_ok = offs_n < seq_len
                kv_mask = n_ok[:, None] & d_ok[None, :]
            else:
                kv_mask = d_ok[None, :]
            in_page = (offs_n.to(tl.uint32) % PAGE_SIZE).to(tl.int32)
            # K and V tiles (TILE_N, HEAD_PAD), contiguous along head_dim, in one layout: the
            # block-table entries and (same strides, the usual case) the offsets serve both.
            k_off = (blk * stride_kb + in_page * stride_ks)[:, None] + offs_d[None, :] * stride_kd
            if KV_SAME:
                v_off = k_off
            else:
                v_off = (blk * stride_vb + in_page * stride_vs)[:, None] + offs_d[None, :] * stride_vd
        if FROM_INPUT and ROPE:
            cs = (rows * stride_rope)[:, None]
            k = rotate_half_load(k_head_ptr + (rows * stride_ks)[:, None], stride_kd, offs_d[None, :], cos_ptr + cs,
                                 sin_ptr + cs, kv_mask, HEAD_SIZE, k_head_ptr.dtype.element_ty)
        elif HEAD_PAD != HEAD_SIZE or MASK:
            k = tl.load(k_head_ptr + k_off, mask=kv_mask, other=0.0)
        else:
            k = tl.load(k_head_ptr + k_off)
        if FROM_INPUT:
            k = to_cache_dtype(k, k_scale_ptr, CACHE_TY, KV_FP8, KV_FP8_MAX, KV_ROUND_FIX)
        # fp8 dequant (scale folded elsewhere; no-op otherwise). Unlike the value tile, the
        # key tile's reduction axis (head_dim) is the contiguous one, so Triton's cast after
        # its shared -> dot-layout load reads 8 bytes at a time: no _fp8_to_f16 needed.
        k = tl.trans(k.to(COMPUTE_DTYPE))
        if DOT_FP32:  # exact fp32 (fp32 models, and the CPU interpreter whose bf16 dot is wrong)
            s = tl.dot(q, k.to(tl.float32), input_precision="ieee")
        else:
            s = tl.dot(q, k)
        # Scores in log2 units. Plain attention keeps s unscaled and folds the scale into the
        # exponent below (one FMA per score instead of a multiply and a subtract).
        if USE_SOFTCAP:  # softcap * tanh(x / softcap), tanh(y) = 1 - 2 / (exp(2y) + 1)
            s = softcap_out * (1.0 - 2.0 / (tl.exp2(s * softcap_in) + 1.0))
        elif USE_ALIBI:
            s = s * qk_scale2
        if USE_ALIBI:
            s += alibi2[:, None] * (offs_n[None, :] - q_pos[:, None]).to(tl.float32)
        if MASK:
            ok = n_ok[None, :]
            if CAUSAL:
                ok = ok & (offs_n[None, :] <= q_pos[:, None])
            if USE_WINDOW:
                ok = ok & ((window_left < 0) | (offs_n[None, :] >= q_pos[:, None] - window_left))
                if not CAUSAL:
                    ok = ok & ((window_right < 0)
                               | (offs_n[None, :] <= q_pos[:, None] + window_right))
            if TREE:  # a new key: visible to its descendants (and itself) only
                rel = offs_n - tree_ctx
                new_key = (rel >= 0) & n_ok
                anc = tl.load(tree_ptr + tree_rows[:, None] + rel[None, :],
                              mask=(tree_rows >= 0)[:, None] & (new_key & (rel < tree_w))[None, :], other=0)
                ok = ok & ((rel < 0)[None, :] | (anc != 0))
            s = tl.where(ok, s, float("-inf"))
        if USE_SOFTCAP or USE_ALIBI:
            m_new = tl.maximum(m_i, tl.reduce(s, 1, _MAX))
        else:
            m_new = tl.maximum(m_i, tl.reduce(s, 1, _MAX) * qk_scale2)
        # Rows with nothing visible yet keep m = -inf; subtract 0 there to avoid inf - inf.
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        if USE_SOFTCAP or USE_ALIBI:
            p = tl.exp2(s - m_sub[:, None])
        else:
            p = tl.exp2(s * qk_scale2 - m_sub[:, None])
        alpha = tl.exp2(m_i - m_sub)
        l_i = l_i * alpha + tl.reduce(p, 1, _SUM)
        acc = acc * alpha[:, None]
        if HEAD_PAD != HEAD_SIZE or MASK:
            v = tl.load(v_head_ptr + v_off, mask=kv_mask, other=0.0)
        else:
            v = tl.load(v_head_ptr + v_off)
        if FROM_INPUT:
            v = to_cache_dtype(v, v_scale_ptr, CACHE_TY, KV_FP8, KV_FP8_MAX, KV_ROUND_FIX)
        if V_CVT != 0:
            v = _fp8_to_f16(v.to(tl.uint8, bitcast=True), V_CVT == 2)
        else:
            v = v.to(COMPUTE_DTYPE)  # fp8 dequant (scale folded elsewhere); no-op otherwise
        if DOT_FP32:
            acc = tl.dot(p, v.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(p.to(COMPUTE_DTYPE), v, acc)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit(do_not_specialize=["num_seqs", "num_tokens", "num_blocks", "bt_cols", "window_left", "window_right"])
def _unified_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, part_o_ptr, part_lse_ptr,
    cu_q_ptr, seqused_k_ptr, block_table_ptr,
    sinks_ptr, alibi_ptr, q_scale_ptr, k_scale_ptr, v_scale_ptr, out_scale_ptr,
    key_ptr, value_ptr, slot_ptr, tree_ptr, cos_ptr, sin_ptr,
    num_seqs, num_tokens, num_blocks, bt_cols, softmax_scale, softcap, window_left, window_right, stride_tree,
    stride_rope,
    stride_qt, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_ot, stride_oh, stride_od,
    stride_bt,
    stride_nkt, stride_nkh, stride_nkd, stride_nvt, stride_nvh, stride_nvd,
    NUM_Q_HEADS: tl.constexpr, QPK: tl.constexpr,
    HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, TILE_N: tl.constexpr,
    SPLIT_KV: tl.constexpr, COMPUTE_DTYPE: tl.constexpr, DOT_FP32: tl.constexpr,
    CAUSAL: tl.constexpr, USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr,
    USE_ALIBI: tl.constexpr, USE_SINKS: tl.constexpr,
    Q_FP8: tl.constexpr, KV_FP8: tl.constexpr, OUT_FP8: tl.constexpr, FP8_OUT_MAX: tl.constexpr,
    FP8_ROUND_FIX: tl.constexpr, V_CVT: tl.constexpr, KV_SAME: tl.constexpr,
    ONE_LOOP: tl.constexpr, LAUNCH_DEPENDENTS: tl.constexpr,
    FUSE_STORE: tl.constexpr = False, KV_FP8_MAX: tl.constexpr = 0.0, KV_ROUND_FIX: tl.constexpr = 0,
    PDL_WAIT: tl.constexpr = False, TREE: tl.constexpr = False, ROPE: tl.constexpr = False,
):
    """``FUSE_STORE``: also write ``key``/``value`` (T, Hk, D) rows into the cache at
    ``slot_ptr`` (< 0 skipped); queries then read their context from the cache and the
    step's keys from ``key``/``value``. ``PDL_WAIT``: launched with programmatic dependent
    launch; wait for the kernel before reading q or the new K/V. ``TREE``: draft trees;
    ``tree_ptr`` is a (T, stride_tree) byte matrix whose row ``t`` marks the new tokens of its
    request that token ``t`` sees (its ancestors and itself); cached keys stay visible to all,
    and the step's keys lie in masked tiles. ``ROPE``: q (and with ``FUSE_STORE`` the new keys)
    arrive unrotated; token ``t``'s rows are rotated by rows ``t`` of ``cos_ptr`` / ``sin_ptr``
    ((T, D), token stride ``stride_rope``) as they are loaded (``vattn.kernels.rotary``).

    Device metadata may be hand-built and unchecked (no host sync reads it), so nothing it says
    moves a read or write outside the tensors: ``cu_q`` entries are clamped into
    ``[0, num_tokens]`` as they are read (so the grid's blocks still cover every row where the
    clamped offsets rise), a request's query rows end no earlier than they start, its keys to the ``bt_cols`` columns of its block-table row, block ids
    into ``[0, num_blocks)``, stored slots to ``[0, num_blocks * PAGE_SIZE)``. On valid metadata
    every clamp is a no-op."""
    if LAUNCH_DEPENDENTS:  # a PDL-launched next kernel may start (it waits for our output itself)
        tl.extra.cuda.gdc_launch_dependents()
    # Heaviest q blocks (the last ones of each request under causal masking) start first.
    q_block = tl.num_programs(0) - 1 - tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    # The request of this q block: the largest i with cu_q[i] // BLOCK_Q + i <= q_block. In a
    # decode batch (cu_q[i] = i) request i's block is i + i // BLOCK_Q: guess that request and
    # check it with the two cu_q entries read anyway (one round trip to memory); search cu_q
    # only when the guess is wrong (a batch with longer queries).
    seq = BLOCK_Q * (q_block // (BLOCK_Q + 1)) + tl.minimum(q_block % (BLOCK_Q + 1), BLOCK_Q - 1)
    seq = tl.maximum(tl.minimum(seq, num_seqs - 1), 0)
    q_start = tl.minimum(tl.maximum(tl.load(cu_q_ptr + seq), 0), num_tokens)
    q_next = tl.minimum(tl.maximum(tl.load(cu_q_ptr + seq + 1), q_start), num_tokens)
    seq_len = tl.load(seqused_k_ptr + seq)
    guessed = (q_start // BLOCK_Q + seq <= q_block) & ((seq == num_seqs - 1) | (q_next // BLOCK_Q + seq + 1 > q_block))
    if not guessed:
        seq = q_block * 0
        hi = num_seqs - 1
        while seq < hi:
            mid = (seq + hi + 1) // 2
            if tl.minimum(tl.maximum(tl.load(cu_q_ptr + mid), 0), num_tokens) // BLOCK_Q + mid <= q_block:
                seq = mid
            else:
                hi = mid - 1
        q_start = tl.minimum(tl.maximum(tl.load(cu_q_ptr + seq), 0), num_tokens)
        q_next = tl.minimum(tl.maximum(tl.load(cu_q_ptr + seq + 1), q_start), num_tokens)
        seq_len = tl.load(seqused_k_ptr + seq)
    q_off = (q_block - (q_start // BLOCK_Q + seq)) * BLOCK_Q  # this program's block, as the grid counts them
    seq_len = tl.minimum(seq_len, bt_cols * PAGE_SIZE)
    q_len = q_next - q_start
    if (q_off < 0) | (q_off >= q_len):
        return
    ctx_len = seq_len - q_len
    bt_row_ptr = block_table_ptr + seq * stride_bt

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_PAD)
    tok = q_off + offs_m // QPK
    head = kv_head * QPK + offs_m % QPK
    row_ok = (offs_m < BLOCK_Q * QPK) & (tok < q_len)
    d_ok = offs_d < HEAD_SIZE
    q_pos = ctx_len + tok
    tok_g = q_start + tok  # token row in q / out

    # Keys [0, kv_end) come from the cache. The fused store writes the step's K/V in this
    # launch, so no program may read them back: its cache holds the context (kv_end =
    # ctx_len), and the step's own keys come from key / value (a one-token query's from
    # registers).
    kv_end = seq_len
    if FUSE_STORE:
        kv_end = ctx_len
        offs_q = tl.arange(0, BLOCK_M)  # this q block's tokens: the first BLOCK_Q (<= BLOCK_M)
        rows = (q_start + q_off + offs_q).to(tl.int64)
        slots = tl.load(slot_ptr + rows, mask=(offs_q < BLOCK_Q) & (q_off + offs_q < q_len), other=-1).to(tl.int64)
        slots = tl.where(split == 0, slots, -1)  # split 0 stores
        own = q_len == 1
        own_row = q_start.to(tl.int64)

    # Key range of this q block, and its interior [full_lo, full_hi) that every row sees.
    q_first = ctx_len + q_off
    q_last = q_first + tl.minimum(BLOCK_Q, q_len - q_off) - 1
    kv_lo = 0
    full_lo = 0
    kv_hi = seq_len
    full_hi = seq_len
    if CAUSAL:
        kv_hi = tl.minimum(kv_hi, q_last + 1)
        full_hi = tl.minimum(full_hi, q_first + 1)
    if TREE:  # the step's keys need the tree mask: masked tiles only
        full_hi = tl.minimum(full_hi, ctx_len)
    tree_rows = tl.where(row_ok, tok_g.to(tl.int64) * stride_tree, -1)
    if USE_WINDOW:
        kv_lo = tl.where(window_left >= 0, tl.maximum(q_first - window_left, 0), 0)
        full_lo = tl.where(window_left >= 0, tl.maximum(q_last - window_left, 0), 0)
        if not CAUSAL:
            kv_hi = tl.where(window_right >= 0, tl.minimum(kv_hi, q_last + window_right + 1), kv_hi)
            full_hi = tl.where(window_right >= 0,
                               tl.minimum(full_hi, q_first + window_right + 1), full_hi)
    new_lo = tl.maximum(kv_lo, kv_end)  # the step's keys from key / value (FUSE_STORE)
    new_hi = kv_hi
    kv_hi = tl.minimum(kv_hi, kv_end)
    full_hi = tl.minimum(full_hi, kv_end)
    t_lo = kv_lo // TILE_N
    t_hi = (kv_hi + TILE_N - 1) // TILE_N
    u_lo = (full_lo + TILE_N - 1) // TILE_N
    u_hi = tl.maximum(full_hi // TILE_N, u_lo)
    if SPLIT_KV:
        num_splits = tl.num_programs(2)
        per_split = (t_hi - t_lo + num_splits - 1) // num_splits
        s_lo = t_lo + split * per_split
        s_hi = tl.minimum(s_lo + per_split, t_hi)
    else:
        s_lo = t_lo
        s_hi = t_hi
    if ONE_LOOP:  # the first key tile's block-table entries (what its K/V addresses wait for)
        nxt = s_lo * TILE_N + tl.arange(0, TILE_N)
        blk_first = tl.load(bt_row_ptr + nxt.to(tl.uint32) // PAGE_SIZE,
                            mask=nxt < tl.minimum(kv_end, s_hi * TILE_N), other=0)

    if PDL_WAIT:  # everything above is metadata; q and the new K/V come from the kernel before
        tl.extra.cuda.gdc_wait()

    if FUSE_STORE:
        st_ok = ((slots >= 0) & (slots < num_blocks.to(tl.int64) * PAGE_SIZE))[:, None] & d_ok[None, :]
        k_row_ptrs = key_ptr + rows[:, None] * stride_nkt + kv_head * stride_nkh
        if ROPE:
            cs = rows[:, None] * stride_rope
            k_rows = rotate_half_load(k_row_ptrs, stride_nkd, offs_d[None, :], cos_ptr + cs, sin_ptr + cs, st_ok,
                                      HEAD_SIZE, key_ptr.dtype.element_ty)
        else:
            k_rows = tl.load(k_row_ptrs + offs_d[None, :] * stride_nkd, mask=st_ok, other=0.0)
        v_rows = tl.load(value_ptr + rows[:, None] * stride_nvt + kv_head * stride_nvh
                         + offs_d[None, :] * stride_nvd, mask=st_ok, other=0.0)
        blk_s = slots // PAGE_SIZE
        in_s = slots % PAGE_SIZE
        tl.store(k_ptr + (blk_s * stride_kb + in_s * stride_ks + kv_head * stride_kh)[:, None]
                 + offs_d[None, :] * stride_kd,
                 to_cache_dtype(k_rows, k_scale_ptr, k_ptr.dtype.element_ty, KV_FP8, KV_FP8_MAX, KV_ROUND_FIX),
                 mask=st_ok)
        tl.store(v_ptr + (blk_s * stride_vb + in_s * stride_vs + kv_head * stride_vh)[:, None]
                 + offs_d[None, :] * stride_vd,
                 to_cache_dtype(v_rows, v_scale_ptr, v_ptr.dtype.element_ty, KV_FP8, KV_FP8_MAX, KV_ROUND_FIX),
                 mask=st_ok)
        own_ok = tl.where(own, d_ok, False)
        k_own_ptr = key_ptr + own_row * stride_nkt + kv_head * stride_nkh
        if ROPE:
            cs_own = own_row * stride_rope
            k_own = rotate_half_load(k_own_ptr, stride_nkd, offs_d, cos_ptr + cs_own, sin_ptr + cs_own, own_ok,
                                     HEAD_SIZE, key_ptr.dtype.element_ty)
        else:
            k_own = tl.load(k_own_ptr + offs_d * stride_nkd, mask=own_ok, other=0.0)
        v_own = tl.load(value_ptr + own_row * stride_nvt + kv_head * stride_nvh + offs_d * stride_nvd,
                        mask=own_ok, other=0.0)
        k_own = to_cache_dtype(k_own, k_scale_ptr, k_ptr.dtype.element_ty, KV_FP8, KV_FP8_MAX, KV_ROUND_FIX)
        v_own = to_cache_dtype(v_own, v_scale_ptr, v_ptr.dtype.element_ty, KV_FP8, KV_FP8_MAX, KV_ROUND_FIX)

    tok_q = tok_g.to(tl.int64)[:, None]
    q_rows = q_ptr + tok_q * stride_qt + head[:, None] * stride_qh
    q_ok = row_ok[:, None] & d_ok[None, :]
    if ROPE:
        cs_q = tok_q * stride_rope
        q = rotate_half_load(q_rows, stride_qd, offs_d[None, :], cos_ptr + cs_q, sin_ptr + cs_q, q_ok, HEAD_SIZE,
                             q_ptr.dtype.element_ty)
    else:
        q = tl.load(q_rows + offs_d[None, :] * stride_qd, mask=q_ok, other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    else:
        if COMPUTE_DTYPE == tl.float16 and not Q_FP8:
            # fp16 compute under a bf16 query (fp8 KV): keep huge values finite.
            q = tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0)
        q = q.to(COMPUTE_DTYPE)

    scale = softmax_scale
    if Q_FP8:
        scale = scale * tl.load(q_scale_ptr)
    if KV_FP8:
        scale = scale * tl.load(k_scale_ptr)
    qk_scale2 = scale * LOG2E
    softcap_in = scale / softcap * (2.0 * LOG2E)
    softcap_out = softcap * LOG2E
    alibi2 = tl.full([BLOCK_M], 0.0, dtype=tl.float32)
    if USE_ALIBI:
        alibi2 = tl.load(alibi_ptr + head, mask=row_ok, other=0.0).to(tl.float32) * LOG2E

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, dtype=tl.float32)
    if USE_SINKS:
        # The sink joins the softmax denominator once: in split 0 only.
        sink = tl.load(sinks_ptr + head, mask=row_ok, other=float("-inf")).to(tl.float32)
        m_i = tl.where(split == 0, sink * LOG2E, float("-inf"))
        l_i = tl.where(m_i > float("-inf"), 1.0, 0.0)
    acc = tl.full([BLOCK_M, HEAD_PAD], 0.0, dtype=tl.float32)

    k_head_ptr = k_ptr + kv_head * stride_kh
    v_head_ptr = v_ptr + kv_head * stride_vh
    if ONE_LOOP:
        # Decode configs: every tile through the masked path in one software pipeline. The
        # unmasked interior saves little when loads dominate, and a second loop for the
        # partial last tile would drain the pipeline and pay a full load latency again.
        acc, m_i, l_i = _attend_tiles(
            acc, m_i, l_i, q, q_pos, alibi2, k_head_ptr, v_head_ptr, bt_row_ptr,
            s_lo, s_hi, kv_end,
            qk_scale2, softcap_in, softcap_out, window_left, window_right,
            stride_kb, stride_ks, stride_kd, stride_vb, stride_vs, stride_vd, 0, 0, k_scale_ptr, v_scale_ptr,
            BLOCK_M, HEAD_SIZE, HEAD_PAD, TILE_N, PAGE_SIZE, COMPUTE_DTYPE, DOT_FP32,
            True, CAUSAL, USE_WINDOW, USE_SOFTCAP, USE_ALIBI, V_CVT, KV_SAME,
            TREE=TREE, tree_ptr=tree_ptr, tree_rows=tree_rows, tree_ctx=ctx_len, blk_first=blk_first,
            num_blocks=num_blocks, tree_w=stride_tree)
    else:
        if USE_WINDOW:  # leading edge tiles (left window boundary)
            acc, m_i, l_i = _attend_tiles(
                acc, m_i, l_i, q, q_pos, alibi2, k_head_ptr, v_head_ptr, bt_row_ptr,
                s_lo, tl.minimum(s_hi, u_lo), kv_end,
                qk_scale2, softcap_in, softcap_out, window_left, window_right,
                stride_kb, stride_ks, stride_kd, stride_vb, stride_vs, stride_vd, 0, 0, k_scale_ptr, v_scale_ptr,
                BLOCK_M, HEAD_SIZE, HEAD_PAD, TILE_N, PAGE_SIZE, COMPUTE_DTYPE, DOT_FP32,
                True, CAUSAL, USE_WINDOW, USE_SOFTCAP, USE_ALIBI, V_CVT, KV_SAME,
                TREE=TREE, tree_ptr=tree_ptr, tree_rows=tree_rows, tree_ctx=ctx_len, num_blocks=num_blocks,
                tree_w=stride_tree)
        acc, m_i, l_i = _attend_tiles(  # interior tiles: no masking at all
            acc, m_i, l_i, q, q_pos, alibi2, k_head_ptr, v_head_ptr, bt_row_ptr,
            tl.maximum(s_lo, u_lo), tl.minimum(s_hi, u_hi), kv_end,
            qk_scale2, softcap_in, softcap_out, window_left, window_right,
            stride_kb, stride_ks, stride_kd, stride_vb, stride_vs, stride_vd, 0, 0, k_scale_ptr, v_scale_ptr,
            BLOCK_M, HEAD_SIZE, HEAD_PAD, TILE_N, PAGE_SIZE, COMPUTE_DTYPE, DOT_FP32,
            False, CAUSAL, USE_WINDOW, USE_SOFTCAP, USE_ALIBI, V_CVT, KV_SAME, num_blocks=num_blocks)
        acc, m_i, l_i = _attend_tiles(  # trailing edge tiles: causal diagonal, last partial tile
            acc, m_i, l_i, q, q_pos, alibi2, k_head_ptr, v_head_ptr, bt_row_ptr,
            tl.maximum(s_lo, u_hi), s_hi, kv_end,
            qk_scale2, softcap_in, softcap_out, window_left, window_right,
            stride_kb, stride_ks, stride_kd, stride_vb, stride_vs, stride_vd, 0, 0, k_scale_ptr, v_scale_ptr,
            BLOCK_M, HEAD_SIZE, HEAD_PAD, TILE_N, PAGE_SIZE, COMPUTE_DTYPE, DOT_FP32,
            True, CAUSAL, USE_WINDOW, USE_SOFTCAP, USE_ALIBI, V_CVT, KV_SAME,
            TREE=TREE, tree_ptr=tree_ptr, tree_rows=tree_rows, tree_ctx=ctx_len, num_blocks=num_blocks,
            tree_w=stride_tree)

    if FUSE_STORE:
        # Split 0 (the one that stored them) attends to the step's keys: a longer query's in
        # tiles of key / value rows, a one-token query's own key and value from registers.
        j_new = new_lo // TILE_N
        acc, m_i, l_i = _attend_tiles(
            acc, m_i, l_i, q, q_pos, alibi2, key_ptr + kv_head * stride_nkh, value_ptr + kv_head * stride_nvh,
            bt_row_ptr, j_new, tl.where(split == 0, tl.where(own, j_new, (new_hi + TILE_N - 1) // TILE_N), j_new),
            seq_len, qk_scale2, softcap_in, softcap_out, window_left, window_right,
            0, stride_nkt, stride_nkd, 0, stride_nvt, stride_nvd, kv_end, q_start - kv_end, k_scale_ptr, v_scale_ptr,
            BLOCK_M, HEAD_SIZE, HEAD_PAD, TILE_N, PAGE_SIZE, COMPUTE_DTYPE, DOT_FP32,
            True, CAUSAL, USE_WINDOW, USE_SOFTCAP, USE_ALIBI, V_CVT, False,
            True, k_ptr.dtype.element_ty, KV_FP8, KV_FP8_MAX, KV_ROUND_FIX,
            ROPE=ROPE, cos_ptr=cos_ptr, sin_ptr=sin_ptr, stride_rope=stride_rope)
        s_own = tl.reduce(q.to(tl.float32) * k_own.to(tl.float32)[None, :], 1, _SUM)
        if USE_SOFTCAP:
            s_own = softcap_out * (1.0 - 2.0 / (tl.exp2(s_own * softcap_in) + 1.0))
        else:  # log2 units; ALiBi adds slope * 0 at the query's own position
            s_own = s_own * qk_scale2
        s_own = tl.where(split == 0, tl.where(own, s_own, float("-inf")), float("-inf"))
        m_new = tl.maximum(m_i, s_own)
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        p_own = tl.exp2(s_own - m_sub)
        alpha = tl.exp2(m_i - m_sub)
        l_i = l_i * alpha + p_own
        acc = acc * alpha[:, None] + p_own[:, None] * v_own.to(tl.float32)[None, :]
        m_i = m_new

    has = l_i != 0.0  # no key: 0; NaN (a NaN query or key) stays NaN through the split merge
    l_safe = tl.where(has, l_i, 1.0)
    o = acc / l_safe[:, None]
    if KV_FP8:
        o = o * tl.load(v_scale_ptr)
    if SPLIT_KV:
        row = (split * num_tokens + tok_g) * NUM_Q_HEADS + head
        tl.store(part_o_ptr + row[:, None] * HEAD_PAD + offs_d[None, :], o,
                 mask=row_ok[:, None])
        lse = tl.where(has, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(part_lse_ptr + row, lse, mask=row_ok)
    else:
        if OUT_FP8:
            o = o / tl.load(out_scale_ptr)
            o = tl.minimum(tl.maximum(o, -FP8_OUT_MAX), FP8_OUT_MAX)
            if FP8_ROUND_FIX:
                o = round_to_fp8_grid(o, FP8_ROUND_FIX)
        o_ptrs = (out_ptr + tok_g.to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh
                  + offs_d[None, :] * stride_od)
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit(do_not_specialize=["num_seqs", "num_tokens"])
def _combine_splits_kernel(
    out_ptr, part_o_ptr, part_lse_ptr, cu_q_ptr, out_scale_ptr,
    num_seqs, num_tokens, stride_ot, stride_oh, stride_od,
    NUM_Q_HEADS: tl.constexpr, HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr, OUT_FP8: tl.constexpr, FP8_OUT_MAX: tl.constexpr,
    FP8_ROUND_FIX: tl.constexpr, LAUNCH_DEPENDENTS: tl.constexpr, WAIT: tl.constexpr = False,
    EARLY_DEPENDENTS: tl.constexpr = False,
):
    """Merge split partials of one (token, head): ``sum_s 2^lse_s o_s / sum_s 2^lse_s``.

    ``WAIT``: launched with programmatic dependent launch, wait for the attention kernel's
    partials first. ``EARLY_DEPENDENTS`` (with ``WAIT``): let the next kernel start before that
    wait, while attention runs; it waits for this kernel's output itself. Splits that saw no
    key (``lse = -inf``) are not read."""
    if LAUNCH_DEPENDENTS and EARLY_DEPENDENTS:
        tl.extra.cuda.gdc_launch_dependents()
    if WAIT:
        tl.extra.cuda.gdc_wait()
    if LAUNCH_DEPENDENTS and not EARLY_DEPENDENTS:
        tl.extra.cuda.gdc_launch_dependents()
    t = tl.program_id(0)
    h = tl.program_id(1)
    if t >= tl.load(cu_q_ptr + num_seqs):
        return  # padding token: no request owns it, no partials were written
    offs_s = tl.arange(0, NUM_SPLITS)
    offs_d = tl.arange(0, HEAD_PAD)
    row = (offs_s * num_tokens + t) * NUM_Q_HEADS + h
    lse = tl.load(part_lse_ptr + row)
    m = tl.reduce(lse, 0, _MAX)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)
    o = tl.load(part_o_ptr + row[:, None] * HEAD_PAD + offs_d[None, :], mask=(w > 0.0)[:, None], other=0.0)
    denom = tl.reduce(w, 0, _SUM)
    o = tl.reduce(o * w[:, None], 0, _SUM) / tl.where(denom > 0.0, denom, 1.0)
    if OUT_FP8:
        o = o / tl.load(out_scale_ptr)
        o = tl.minimum(tl.maximum(o, -FP8_OUT_MAX), FP8_OUT_MAX)
        if FP8_ROUND_FIX:
            o = round_to_fp8_grid(o, FP8_ROUND_FIX)
    tl.store(out_ptr + t.to(tl.int64) * stride_ot + h * stride_oh + offs_d * stride_od,
             o.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_SIZE)

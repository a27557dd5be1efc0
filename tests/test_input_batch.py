"""vattn.InputBatch: rows kept across steps give the same metadata as build_common_attn_metadata,
bad input is refused where it enters (nothing changed), and a step's metadata outlives the next
step's preparation (the ring of two buffers)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import vattn

BS, NB = 4, 64


def _batch(**kw: int) -> vattn.InputBatch:
    args = dict(max_num_reqs=8, max_blocks_per_req=16, block_size=BS, num_blocks=NB, device="cpu", max_num_tokens=64)
    args.update(kw)
    return vattn.InputBatch(**args)


def _same(got: vattn.CommonAttentionMetadata, want: vattn.CommonAttentionMetadata, need: np.ndarray) -> None:
    for f in ("query_start_loc", "seq_lens", "slot_mapping", "query_start_loc_cpu", "seq_lens_cpu",
              "num_computed_tokens_cpu"):
        assert torch.equal(getattr(got, f).long(), getattr(want, f).long()), f
    for r, n in enumerate(need.tolist()):  # columns past a row's need are never read
        assert torch.equal(got.block_table_tensor[r, :n].long(), want.block_table_tensor[r, :n].long())
    assert (got.num_reqs, got.num_actual_tokens, got.max_query_len, got.max_seq_len) == \
        (want.num_reqs, want.num_actual_tokens, want.max_query_len, want.max_seq_len)


@pytest.mark.parametrize("seed", range(4))
def test_random_steps_match_build_common_attn_metadata(seed: int) -> None:
    """Requests arrive, prefill in chunks, decode, finish; every step's metadata equals the
    stateless helper's on the same facts (mixed batches, odd lengths, padding)."""
    rng = np.random.default_rng(seed)
    batch = _batch()
    free = list(rng.permutation(NB))
    live: dict[int, list[int]] = {}  # row -> block ids
    for _ in range(40):
        if len(live) < 8 and rng.random() < 0.4:
            n0 = int(rng.integers(0, 3))
            blocks = [free.pop() for _ in range(n0)]
            live[batch.add_row(blocks, 0)] = blocks
        if not live:
            continue
        rows = np.array(sorted(live, key=lambda r: rng.random()), dtype=np.int64)
        qlens = rng.integers(0, 6, size=rows.size)
        qlens[: rows.size // 2] = 1  # decodes first
        for r, q in zip(rows.tolist(), qlens.tolist()):
            need = -(-(int(batch.num_computed_tokens[r]) + q) // BS) - len(live[r])
            if need > 0:
                more = [free.pop() for _ in range(need)]
                batch.append_blocks(r, more)
                live[r] += more
        pad = int(qlens.sum()) + int(rng.integers(0, 3))
        got = batch.prepare(rows, qlens, num_tokens_padded=pad)
        computed = batch.num_computed_tokens[rows].tolist()
        want = vattn.build_common_attn_metadata(qlens.tolist(), computed, [live[r] for r in rows.tolist()], BS,
                                                num_tokens_padded=pad, num_blocks=NB)
        _same(got, want, -(-(np.array(computed) + qlens) // BS))
        batch.num_computed_tokens[rows] += qlens
        for r in rows.tolist():
            if rng.random() < 0.15:
                batch.free_row(r)
                free += live.pop(r)


def test_metadata_runs_a_layer_like_the_helpers() -> None:
    """A step from InputBatch through kv.build_metadata and a TORCH_SDPA layer: the same output and
    cache as the same step from kv.common_metadata, untouched slots bit-identical."""
    cfg = vattn.VattnConfig(cache=vattn.CacheConfig(block_size=BS))
    with vattn.set_current_vattn_config(cfg):
        layer = vattn.Attention(4, 16, 16**-0.5, num_kv_heads=2, prefix="l0", attn_backend="TORCH_SDPA")
    kv = vattn.allocate_kv_cache(cfg, num_blocks=NB, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    kv.tensors["l0"].copy_(torch.randn(kv.tensors["l0"].shape, generator=g))
    batch = _batch()
    tables = [[5, 9, 2], [7], [11, 12, 13, 14]]
    rows = np.array([batch.add_row(t, c) for t, c in zip(tables, (9, 0, 3))])
    qlens = np.array([1, 3, 11])
    q, k, v = (torch.randn(15, n, 16, generator=g) for n in (4, 2, 2))
    outs, caches = [], []
    start = kv.tensors["l0"].clone()
    for common in (batch.prepare(rows, qlens), kv.common_metadata([1, 3, 11], [9, 0, 3], tables)):
        kv.tensors["l0"].copy_(start)
        with vattn.set_forward_context(kv.build_metadata(common), cfg), torch.no_grad():
            outs.append(layer(q, k, v))
        caches.append(kv.tensors["l0"].clone())
    assert torch.equal(outs[0], outs[1]) and torch.equal(caches[0], caches[1])
    written = {b for t in tables for b in t}
    untouched = [b for b in range(NB) if b not in written]
    assert torch.equal(caches[0][:, untouched] if caches[0].shape[0] == 2 else caches[0][untouched],
                       start[:, untouched] if start.shape[0] == 2 else start[untouched])


def test_metadata_outlives_the_next_prepare() -> None:
    """The ring of two buffers: step N's metadata is intact after step N+1 is prepared."""
    batch = _batch()
    rows = np.array([batch.add_row([1, 2], 5), batch.add_row([3], 0)])
    first = batch.prepare(rows, np.array([1, 2]))
    snap = {f: getattr(first, f).clone() for f in ("query_start_loc", "seq_lens", "slot_mapping", "block_table_tensor")}
    batch.num_computed_tokens[rows] += [1, 2]
    batch.prepare(rows[::-1].copy(), np.array([1, 1]))
    for f, t in snap.items():
        assert torch.equal(getattr(first, f), t), f


def test_shared_prefix_blocks_read_but_not_written() -> None:
    """Two rows may hold the same full prefix block and read it; a token written into a block
    another row holds is refused before anything runs."""
    batch = _batch()
    a = batch.add_row([3, 4], 4)  # block 3: a full shared prefix
    b = batch.add_row([3, 5], 4)
    batch.prepare(np.array([a, b]), np.array([1, 1]))  # writes go to blocks 4 and 5
    c = batch.add_row([6], 0)
    batch.append_blocks(c, [4])  # block 4 now held by a and c
    with pytest.raises(ValueError, match="block 4 written by row"):
        batch.prepare(np.array([a]), np.array([1]))


def _refused(batch: vattn.InputBatch, fn, match: str) -> None:  # type: ignore[no-untyped-def]
    state = (batch.block_table.copy(), batch.num_blocks_per_row.copy(), batch.num_computed_tokens.copy())
    with pytest.raises((ValueError, TypeError), match=match):
        fn()
    assert all(np.array_equal(x, y) for x, y in zip(state, (batch.block_table, batch.num_blocks_per_row,
                                                             batch.num_computed_tokens)))


def test_bad_input_is_refused_where_it_enters() -> None:
    batch = _batch(max_num_reqs=3, max_blocks_per_req=4)
    r = batch.add_row([1], 2)
    _refused(batch, lambda: batch.append_blocks(r, [NB]), r"block_ids: expected block ids in \[0, num_blocks = 64\)")
    _refused(batch, lambda: batch.append_blocks(r, [-1]), "block_ids")
    _refused(batch, lambda: batch.append_blocks(r, [1]), "ids not yet in the row")
    _refused(batch, lambda: batch.append_blocks(r, [7, 7]), "ids not yet in the row")
    _refused(batch, lambda: batch.append_blocks(r, [2.0]), "expected integers")
    _refused(batch, lambda: batch.append_blocks(r, [2, 3, 4, 5]), "max_blocks_per_req = 4")
    _refused(batch, lambda: batch.append_blocks(2, [2]), "a row in use")
    _refused(batch, lambda: batch.add_row([NB + 1]), "block_ids")  # the row taken is given back
    assert len(batch._free_rows) == 2
    _refused(batch, lambda: batch.prepare(np.array([r, r]), np.array([1, 1])), "distinct rows in use")
    _refused(batch, lambda: batch.prepare(np.array([-1]), np.array([1])), "distinct rows in use")
    _refused(batch, lambda: batch.prepare(np.array([1]), np.array([1])), "distinct rows in use")
    _refused(batch, lambda: batch.prepare(np.array([r]), np.array([3])), r"row 0: expected ceil\(5 / 4\) = 2 blocks")
    _refused(batch, lambda: batch.prepare(np.array([r]), np.array([-1])), "counts >= 0")
    _refused(batch, lambda: batch.prepare(np.array([r]), np.array([1.0])), "integer arrays")
    _refused(batch, lambda: batch.prepare(np.array([r]), np.array([1]), num_tokens_padded=65), "max_num_tokens")
    r2 = batch.add_row([9], 0)
    each = batch.append_block_each
    _refused(batch, lambda: each(np.array([r, r2]), np.array([10, NB])), "distinct block ids in")
    _refused(batch, lambda: each(np.array([r, r2]), np.array([10, 10])), "distinct block ids in")
    _refused(batch, lambda: each(np.array([r2, r]), np.array([10, 1])), "block 1 for row 0, which holds it already")
    _refused(batch, lambda: each(np.array([r, r]), np.array([10, 11])), "distinct rows in use")
    each(np.array([r, r2]), np.array([10, 1]))  # 10 fresh; block 1 shared into row r2 (read-only prefix sharing)
    assert batch.block_table[r2, :2].tolist() == [9, 1] and batch.block_table[r, :2].tolist() == [1, 10]
    batch.add_row()
    _refused(batch, lambda: batch.add_row(), "max_num_reqs = 3")
    with pytest.raises(ValueError, match="max_num_reqs"):
        _batch(max_num_reqs=0)


def test_engine_steady_decoding_gives_the_same_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """The example engine's steady path (same schedule again, blocks topped up for the whole batch
    at once, input ids from the step in flight) gives the tokens of the general path, with
    requests arriving, crossing blocks and finishing at different steps (allocator invariants
    checked every step)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from examples.engine import Engine, SamplingParams, Scheduler
    from examples.model import DecoderForCausalLM, ModelConfig, init_random_weights

    cfg = vattn.VattnConfig(cache=vattn.CacheConfig(block_size=BS))
    mc = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                     num_key_value_heads=1, head_dim=32, max_position_embeddings=128)
    with vattn.set_current_vattn_config(cfg):
        model = DecoderForCausalLM(mc, attn_backend="TORCH_SDPA")
    init_random_weights(model)
    kv = vattn.allocate_kv_cache(cfg, num_blocks=NB, dtype=torch.float32)

    def run(steady: bool) -> tuple[list[list[int]], int]:
        engine = Engine(model, cfg, kv, device="cpu", max_num_batched_tokens=16, max_num_seqs=6, check_invariants=True)
        reqs = [engine.add_request([(7 * i + j) % 60 + 1 for j in range(3 + i)], SamplingParams(max_tokens=6 + 3 * i),
                                   arrival_step=i % 3) for i in range(6)]
        hits = 0
        schedule = engine.scheduler.schedule

        def counted(step: int) -> list:  # type: ignore[type-arg]
            nonlocal hits
            if not steady:
                engine.scheduler._steady = None
            before = engine.scheduler._steady
            out = schedule(step)
            hits += out is before
            return out

        monkeypatch.setattr(engine.scheduler, "schedule", counted)
        top_up = engine.scheduler._top_up

        def counted_top_up(room: np.ndarray) -> bool:
            nonlocal top_ups
            top_ups += 1
            return top_up(room)

        monkeypatch.setattr(engine.scheduler, "_top_up", counted_top_up)
        engine.run()
        return [r.output_token_ids for r in reqs], hits

    top_ups = 0
    (fast, hits), fast_top_ups = run(True), top_ups
    top_ups = 0
    slow, none = run(False)
    assert fast == slow and hits > 5 and fast_top_ups > 0 and none == 0 == top_ups


def test_bench_host_step_cpu_smoke(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """benchmarks/bench_host_step.py runs on the CPU, writes its JSON and takes its timers off."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks import bench_host_step
    from examples import engine as engine_mod

    sample = engine_mod.sample
    monkeypatch.setenv("OUT", str(tmp_path))
    out = bench_host_step.main(["--batches", "1,4", "--steps", "8", "--layers", "2", "--context", "8",
                                "--backend", "TORCH_SDPA", "--device", "cpu"])
    assert [r["batch"] for r in out["rows"]] == [1, 4]
    assert all(r["step_us"] > 0 and r["input_batch_us"] > 0 and r["schedule_us"] > 0 for r in out["rows"])
    assert list(tmp_path.glob("host-step-*.json")) and engine_mod.sample is sample


@pytest.mark.cuda
def test_cuda_steps_stage_through_pinned_memory_without_a_sync() -> None:
    """On CUDA: each step's metadata is one non-blocking copy from a pinned staging buffer, equal
    to the CPU batch's; step N's tensors survive the preparation of step N+1 while a long kernel
    still occupies the stream (the event guards the staging buffer that is reused)."""
    gpu = vattn.InputBatch(max_num_reqs=64, max_blocks_per_req=32, block_size=BS, num_blocks=4096, device="cuda",
                           max_num_tokens=256)
    cpu = vattn.InputBatch(max_num_reqs=64, max_blocks_per_req=32, block_size=BS, num_blocks=4096, device="cpu",
                           max_num_tokens=256)
    rows = np.array([b.add_row(list(range(30 * i, 30 * i + 30)), 2 * i) for b in (gpu, cpu) for i in range(48)][:48])
    rows.setflags(write=False)
    assert all(t.is_pinned() for t in gpu._staging)
    x = torch.randn(4096, 4096, device="cuda")
    steps = []
    for step in range(4):
        (x @ x).sum()  # keep the stream busy: the copies queue behind it
        got, want = gpu.prepare(rows), cpu.prepare(rows)
        steps.append((got, want))
        for b in (gpu, cpu):
            b.num_computed_tokens[rows] += 1
    torch.cuda.synchronize()
    for got, want in steps[-2:]:  # the ring keeps the last two steps intact
        for f in ("query_start_loc", "seq_lens", "slot_mapping", "block_table_tensor", "state_indices"):
            assert getattr(got, f).is_cuda and torch.equal(getattr(got, f).cpu(), getattr(want, f)), f

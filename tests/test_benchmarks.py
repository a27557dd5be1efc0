"""The shared benchmark infrastructure on the CPU: timing, result files, report, kernel sweep smoke run."""

from __future__ import annotations

import datetime as dt
import json
import re
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import bench_kernels, bench_layer_overhead, common, report, roofline  # noqa: E402

ENV_KEYS = {
    "device_type", "device_name", "compute_capability", "sm_count", "gpu_memory_gib", "gpu_clocks",
    "torch", "triton", "flashinfer", "flash_attn", "transformers", "vattn", "cuda", "python", "date",
    "git_commit", "git_dirty",
}


def test_bench_cpu_fallback_times_every_call() -> None:
    calls = []
    res = common.bench(lambda: calls.append(sum(range(200))), warmup=1, rep=5, device="cpu")
    assert set(res) >= {"median_ms", "p20", "p80", "n"}
    assert res["method"] == "perf_counter"
    assert res["n"] >= 3 and len(calls) >= res["n"] + 1  # one untimed warm-up call at least
    assert 0 < res["p20"] <= res["median_ms"] <= res["p80"]


def test_bench_wall_counts_host_work() -> None:
    res = common.bench_wall(lambda: time.sleep(0.002), warmup=0, rep=10)
    assert res["method"] == "wall+sync" and res["n"] >= 3 and res["median_ms"] >= 2.0


def test_bench_rejects_bad_budgets() -> None:
    with pytest.raises(ValueError, match="rep"):
        common.bench(lambda: None, warmup=1, rep=0, device="cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_bench_cuda_graph_needs_cuda() -> None:
    with pytest.raises(RuntimeError, match="CUDA"):
        common.bench_cuda_graph(lambda: None)


def test_env_info_keys_and_date() -> None:
    env = common.env_info("cpu")
    assert ENV_KEYS <= set(env)
    assert env["device_type"] == "cpu" and env["torch"]
    date = dt.datetime.fromisoformat(env["date"])
    assert date.utcoffset() == dt.timedelta(0)
    json.dumps(env)  # serialisable as is


def test_write_results_to_out(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("OUT", str(tmp_path))
    rows = [{"a": 1, "b": [1, float("inf")], "c": float("nan"), "d": torch.bfloat16, "e": torch.tensor(2.5)}]
    summary = {"nested": {"x": float("nan"), "dt": torch.float8_e4m3fn, "p": Path("/x")}}
    path = common.write_results("unit", {"rows": rows, "summary": summary})
    assert path.parent == tmp_path
    slug = common.device_slug(str(common.env_info()["device_name"]))
    assert path.name.startswith(f"unit-{slug}-") and path.suffix == ".json"
    data = json.loads(path.read_text())
    assert data["benchmark"] == "unit" and ENV_KEYS <= set(data["env"])
    assert data["rows"] == [{"a": 1, "b": "[1,null]", "c": None, "d": "bfloat16", "e": 2.5}]
    assert data["summary"] == {"nested": {"x": None, "dt": "float8_e4m3fn", "p": "/x"}}


def test_write_results_default_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("OUT", raising=False)
    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path / "results")
    path = common.write_results("unit", {"rows": [], "summary": {"x": 1}})
    assert path.parent == tmp_path / "results"
    with pytest.raises(TypeError, match="rows"):
        common.write_results("unit", {"rows": {"a": 1}})
    with pytest.raises(ValueError, match="result name"):
        common.result_path("bad name/x")


def test_table_union_of_columns_and_escaping() -> None:
    t = common.Table(title="t")
    t.add({"a": 1, "b": 0.123456})
    t.add({"c": "x|y", "a": None})
    md = t.to_markdown().splitlines()
    assert md[0] == "**t**" and md[2] == "| a | b | c |"
    assert md[4] == "| 1 | 0.1235 |  |" and md[5] == "|  |  | x\\|y |"


def test_roofline_fractions() -> None:
    roof = roofline.Roofline(copy_tbps=2.0, read_tbps=4.0, bf16_tflops=100.0)
    assert roof.fractions(tbps=1.0, tflops=50.0) == {"frac_copy_bw": 0.5, "frac_read_bw": 0.25, "frac_matmul": 0.5}
    assert roofline.fraction(None, 1.0) is None and roofline.fraction(1.0, 0.0) is None


def test_roofline_measures_on_cpu() -> None:
    roof = roofline.measure("cpu", tiny=True, copy_bytes=2**20, matmul_n=64)
    assert roof.copy_tbps > 0 and roof.read_tbps > 0 and roof.bf16_tflops > 0
    assert roof.copy_bytes == 2**20 and roof.matmul_n == 64


def test_fill_kv_is_layout_independent() -> None:
    kv_first = torch.empty(2, 5, 4, 2, 8)
    blocks_first = torch.empty(5, 2, 4, 2, 8, dtype=torch.bfloat16)
    k1, v1 = bench_kernels.split_kv(kv_first, 5)
    k2, v2 = bench_kernels.split_kv(blocks_first, 5)
    bench_kernels.fill_kv_(k1, v1, seed=3)
    bench_kernels.fill_kv_(k2, v2, seed=3)
    assert torch.equal(k1.bfloat16(), k2) and torch.equal(v1.bfloat16(), v2)
    assert not torch.equal(k1, v1) and k1.std() > 0.5
    with pytest.raises(bench_kernels.Skip):
        bench_kernels.split_kv(torch.empty(3, 5, 4, 2, 8), 5)


def _synthetic(folder: Path, stem: str, date: str, value: float, *, device: str = "NVIDIA H100 80GB HBM3",
               benchmark: str = "e2e", summary: dict | None = None, extra: dict | None = None) -> Path:
    env = {"device_name": device, "device_type": "cpu" if device.startswith("cpu") else "cuda", "sm_count": 132,
           "date": date, "torch": "2.11.0", "git_commit": "abcdef1234567890", "gpu_clocks": {"sm_mhz": 1980.0}}
    payload = {"benchmark": benchmark, "env": env, "summary": summary or {"note": "hi", "quick": True},
               "rows": [{"model": "tiny", "tok_per_s": value}, {"model": "big", "latency_ms": 3.5, **(extra or {})}],
               "plots": [f"{stem}.png"]}
    path = folder / f"{stem}.json"
    path.write_text(json.dumps(payload))
    return path


def test_report_splits_result_names() -> None:
    n = report.split_name("e2e-run-z-nvidia-h200-2026-11-26", "NVIDIA H200")
    assert (n.kind, n.run, n.device, n.date, n.day()) == ("e2e", "z", "nvidia-h200", "2026-11-26",
                                                          "nvidia-h200-2026-11-26")
    assert report.split_name("tp-nvidia-h200-2026-11-22-eager", "NVIDIA H200").kind == "tp-eager"
    assert report.split_name("profile-full-run-b-nvidia-h100-80gb-hbm3-2026-11-25", "").kind == "profile-full"
    assert report.split_name("e2e-cpu-x86-64-2026-11-26", "cpu (x86_64)").kind == "e2e"
    assert report.split_name("triton_attn_sweep-e2e-nvidia-h100-80gb-hbm3-2026-11-25").kind == "triton_attn_sweep"
    assert report.split_name("legacy_name").kind == "legacy_name"


def test_report_renders_newest_result_per_kind(tmp_path: Path) -> None:
    results = tmp_path / "results"
    results.mkdir()
    _synthetic(results, "e2e-nvidia-h100-80gb-hbm3-2026-11-20", "2026-11-20T10:00:00+00:00", 111.0)
    _synthetic(results, "e2e-run-a-nvidia-h200-2026-11-21", "2026-11-21T09:00:00+00:00", 222.0,
               device="NVIDIA H200")
    newest = _synthetic(results, "e2e-run-b-nvidia-h100-80gb-hbm3-2026-11-21", "2026-11-21T10:00:00+00:00", 333.0,
                        extra={"note": "a|b"})
    _synthetic(results, "e2e-cpu-x86-64-2026-11-22", "2026-11-22T10:00:00+00:00", 444.0, device="cpu (x86_64)")
    _synthetic(results, "profile-try-nvidia-h200-2026-11-21", "2026-11-21T11:00:00+00:00", 1.0, device="NVIDIA H200",
               benchmark="profile", summary={"note": "Tried X: slower, not kept."})
    (results / f"{newest.stem}.png").write_bytes(b"\x89PNG\r\n")
    (results / "broken.json").write_text("{not json")
    readme = tmp_path / "README.md"
    assert report.main(["--results-dir", str(results), "--output", str(readme)]) == 0
    text = readme.read_text()
    assert text.splitlines()[0] == report.MARKER
    assert "### e2e\n\n[e2e-run-b-nvidia-h100-80gb-hbm3-2026-11-21.json](results/" in text
    assert "333" in text and "111" not in text and "222" not in text and "444" not in text  # newest GPU run only
    assert "| [e2e](#e2e) | `bench_e2e.py` | `e2e-run-b-nvidia-h100-80gb-hbm3-2026-11-21` | H100 | 2026-11-21 | 4 |" in text
    assert "| model | tok_per_s | latency_ms | note |" in text  # rows unlike e2e's: every column
    assert "| big |  | 3.5 | a\\|b |" in text
    assert "Script: `benchmarks/bench_e2e.py` `--quick`. 3 older files listed at the end." in text
    assert f"![e2e: {newest.stem}](results/{newest.stem}.png)" in text
    assert "| profile-try | `nvidia-h200-2026-11-21` | Tried X: slower, not kept. |" in text
    assert ("- **e2e** (4): `nvidia-h100-80gb-hbm3-2026-11-21`: b; `nvidia-h200-2026-11-21`: a; "
            "`nvidia-h100-80gb-hbm3-2026-11-20`; `cpu-x86-64-2026-11-22`") in text
    assert "`broken.json`" in text
    assert report.main(["--results-dir", str(results), "--output", str(readme), "--check"]) == 0
    readme.write_text(text + "stale\n")
    assert report.main(["--results-dir", str(results), "--output", str(readme), "--check"]) == 1


def test_report_takes_probe_findings_from_the_notes() -> None:
    notes = ("- Dropped: X is slower: 1.0 -> 1.2 ms (H100, `profile-x-nvidia-h100-80gb-hbm3-2026-11-25`); Y "
             "changes nothing (`profile-y-nvidia-h200-2026-11-26`).\n"
             "- Kept: X again (`profile-x-nvidia-h100-80gb-hbm3-2026-11-25`).\n")
    assert report.note_findings(notes) == {
        "profile-x-nvidia-h100-80gb-hbm3-2026-11-25": "Dropped: X is slower: 1.0 -> 1.2 ms",
        "profile-y-nvidia-h200-2026-11-26": "Dropped: Y changes nothing",
    }


def test_committed_benchmarks_readme_is_generated_from_the_newest_results(tmp_path: Path) -> None:
    """benchmarks/README.md equals what report.py makes of the committed results (rerun it when this fails)."""
    out = tmp_path / "README.md"
    out.write_text(report.generate(common.RESULTS_DIR, report.BENCH_DIR / "README.md"))
    text = out.read_text()
    assert len(text.encode()) <= report.MAX_BYTES
    results, bad = report.load_results(common.RESULTS_DIR)
    assert bad == []
    kinds: dict[str, list[dict]] = {}
    for r in results:
        kinds.setdefault(r["_kind"], []).append(r)
    assert {"e2e", "kernels", "triton_attn", "compile-decode", "compile-coldstart", "tp"} <= set(kinds)
    for kind, runs in kinds.items():
        gpu = [r for r in runs if r["env"].get("device_type") != "cpu"] or runs
        newest = max(gpu, key=lambda r: dt.datetime.fromisoformat(r["env"]["date"]))
        name = newest["_path"].name
        if kind.startswith("profile"):  # the newest probes in the table, the older ones by name
            assert f"| {kind} | `{newest['_name'].day()}`" in text or f"`{kind}`" in text, kind
        else:
            assert f"### {kind}\n\n[{name}](results/{name})" in text, kind
    committed = report.BENCH_DIR / "README.md"
    assert committed.read_text() == text, "benchmarks/README.md is stale: run python3 benchmarks/report.py"


def test_performance_notes_are_short_and_cite_existing_results() -> None:
    notes = report.NOTES.read_text()
    assert len(notes.encode()) <= 15_000
    cited = set(re.findall(r"[a-z0-9_]+(?:-[a-z0-9_]+)*-\d{4}-\d{2}-\d{2}(?:-[a-z0-9_]+)?(?:\.json|\.png)?", notes))
    assert len(cited) >= 20
    missing = [c for c in sorted(cited) if not (common.RESULTS_DIR / (c if c.endswith((".json", ".png"))
                                                                       else f"{c}.json")).exists()]
    assert missing == []
    headline = notes.split("## Headline figures", 1)[1].split("\n## ", 1)[0]
    assert 1 <= sum(line.startswith("| ") for line in headline.splitlines()) - 2 <= 6  # rows minus the header


def test_bench_kernels_tiny_cpu_run(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("OUT", str(tmp_path))
    argv = ["--device", "cpu", "--tiny", "--quick", "--backends", "TORCH_SDPA", "--raw", "sdpa_dense",
            "--rep-ms", "3", "--warmup-ms", "0"]
    assert bench_kernels.main(argv) == 0
    (path,) = tmp_path.glob("kernels-*.json")
    data = json.loads(path.read_text())
    rows = data["rows"]
    assert {r["provider"] for r in rows} == {"vattn:TORCH_SDPA", "sdpa_dense"}
    assert {r["phase"] for r in rows} == {"decode", "prefill"}
    assert {r["kv_dtype"] for r in rows} == {"auto", "fp8"}
    assert len(rows) == 2 * 2 * (2 * 2 + 1)  # providers x kv dtypes x (decode grid + prefill)
    # The vattn path and the dense reference read the same K/V, so they agree.
    assert all(r["ok"] for r in rows), [(r["provider"], r["max_abs_diff"]) for r in rows]
    assert all(r["ms"] > 0 and r["tbps"] > 0 and r["frac_copy_bw"] > 0 for r in rows)
    assert data["summary"]["roofline"]["copy_tbps"] > 0 and data["summary"]["errors"] == {}
    for name in data["plots"]:
        assert (tmp_path / name).stat().st_size > 1000
    text = report.render(report.load_results(tmp_path)[0], tmp_path / "README.md")
    assert "### kernels" in text and "vattn:TORCH_SDPA" in text

    # A second part with --append replaces the rows it measures again and keeps the others.
    part = ["--device", "cpu", "--tiny", "--backends", "TORCH_SDPA", "--raw", "", "--kv-dtypes", "fp8",
            "--batches", "1", "--contexts", "16", "--rep-ms", "1", "--warmup-ms", "0", "--no-plot", "--append"]
    assert bench_kernels.main(part) == 0
    merged = json.loads(path.read_text())
    assert len(merged["rows"]) == len(rows) and merged["summary"]["rows_from_earlier_parts"] == len(rows) - 2
    new = {(r["phase"], r["batch"], r["seq_len"]) for r in merged["rows"][-2:]
           if r["provider"] == "vattn:TORCH_SDPA" and r["kv_dtype"] == "fp8"}
    assert new == {("decode", 1, 16), ("prefill", 2, 24)}
    kept = [r for r in rows if not (r["provider"] == "vattn:TORCH_SDPA" and r["kv_dtype"] == "fp8"
                                    and (r["phase"], r["batch"], r["seq_len"]) in new)]
    assert merged["rows"][:-2] == kept


def test_triton_do_bench_adapter_uses_all_times_or_quantiles() -> None:
    """The CUDA path's adapter over triton.testing.do_bench (both result styles), with fake timers."""
    calls = []

    def all_times(fn, warmup=25, rep=100, grad_to_none=None, quantiles=None, return_mode="mean"):
        calls.append((warmup, rep, return_mode))
        return [3.0, 1.0, 2.0, 4.0, 5.0]

    res = common._bench_triton(all_times, lambda: None, 7, 9)
    assert calls == [(7, 9, "all")]
    assert (res["median_ms"], res["p20"], res["p80"], res["n"]) == (3.0, 1.8, 4.2, 5)

    def old_style(fn, warmup=25, rep=100, grad_to_none=None, quantiles=None, return_mode="mean"):
        assert return_mode in ("min", "max", "mean", "median")
        return [quantiles[0] * 10, quantiles[1] * 10, quantiles[2] * 10]

    res = common._bench_triton(old_style, lambda: None, 1, 2)
    assert (res["median_ms"], res["p20"], res["p80"], res["n"]) == (5.0, 2.0, 8.0, None)


def test_report_accepts_pre_schema_files(tmp_path: Path) -> None:
    """A file with ``results`` instead of ``rows`` and top-level device/date still renders."""
    legacy = {"benchmark": "e2e_decode", "date": "2026-11-22T00:00:00+00:00", "device": "NVIDIA H200",
              "versions": {"torch": "2.11.0"}, "new_tokens": 64, "model": {"layers": 16},
              "floor": [{"batch": 1}], "results": [{"impl": "vattn-eager", "ms_per_step": 5.0}]}
    (tmp_path / "e2e_x.json").write_text(json.dumps(legacy))
    (tmp_path / "empty.json").write_text(json.dumps({"benchmark": "nothing", "value": 1}))
    results, bad = report.load_results(tmp_path)
    assert bad == ["empty.json"] and len(results) == 1
    r = results[0]
    assert r["benchmark"] == "e2e_decode" and r["env"]["device_name"] == "NVIDIA H200" and r["_kind"] == "e2e_x"
    assert r["rows"] == [{"impl": "vattn-eager", "ms_per_step": 5.0}]
    assert r["summary"] == {"new_tokens": 64, "model": {"layers": 16}}
    text = report.render(results, tmp_path / "README.md")
    assert "### e2e_x" in text and "NVIDIA H200" in text and "| vattn-eager | 5 |" in text


def test_layer_overhead_work_and_plot(tmp_path: Path) -> None:
    """bench_layer_overhead's CPU-checkable parts: bytes / flops per case, and its plot panels."""
    lo = bench_layer_overhead
    kv_bytes, flops = lo.work(64, 4095, 1)
    assert kv_bytes == 64 * 4096 * lo.HK * lo.D * 2 * 2 and flops is None  # K and V, bf16
    kv_bytes, flops = lo.work(2, 0, 4)
    assert kv_bytes is None and flops == 4 * lo.H * lo.D * 2 * (4 * 5 / 2)  # causal: n(n+1)/2 pairs
    roof = roofline.Roofline(copy_tbps=4.0, read_tbps=4.5, bf16_tflops=800.0)
    rows = [
        dict(backend="FLASHINFER", mode="cuda_graph", requests=64, context=4095, new_tokens=1, tb_per_s=3.0,
             bare_tb_per_s=3.1),
        dict(backend="FLASH_ATTN", mode="eager", requests=8, context=0, new_tokens=2048, tflop_per_s=400.0,
             bare_tflop_per_s=420.0),
    ]
    decode, prefill = lo.panels_for(rows, roof)
    assert decode["series"] == {"FLASHINFER vattn (cuda_graph)": ([64 * 4096], [3.0]),
                                "FLASHINFER bare (cuda_graph)": ([64 * 4096], [3.1])}
    assert decode["ceilings"] == {"copy": 4.0, "read": 4.5}
    assert prefill["series"]["FLASH_ATTN bare (eager)"] == ([8 * 2048], [420.0])
    assert prefill["ceilings"] == {"bf16 matmul": 800.0}
    png = common.plot_panels(tmp_path / "overhead.png", [decode, prefill], ncols=2)
    assert png is not None and png.stat().st_size > 1000


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only exit")
def test_layer_overhead_needs_cuda(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_layer_overhead.main(["--quick"]) == 2
    assert "CUDA" in capsys.readouterr().err


def test_bench_cpu_decode_writes_its_ratios(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from benchmarks import bench_cpu_decode

    monkeypatch.setenv("OUT", str(tmp_path))
    old = torch.get_num_threads()
    try:
        out = bench_cpu_decode.main(["--reps", "40", "--context", "20"])
    finally:
        torch.set_num_threads(old)
    (path,) = tmp_path.glob("cpu_decode-*.json")
    rows = json.loads(path.read_text())["rows"]
    assert [r["batch"] for r in rows] == [1, 1, 1, 8] * 2 and rows == out["rows"]
    assert all(r["vattn_us"] > 0 and r["x_bare_gqa"] == r["vattn_us"] / r["bare_gqa_us"] for r in rows)


def test_report_trims_tables_until_the_page_fits(monkeypatch: pytest.MonkeyPatch) -> None:
    """A smaller page limit gives fewer key-table and probe rows, not a failing page."""
    full = report.generate()
    monkeypatch.setattr(report, "MAX_BYTES", len(full.encode()) - 2000)
    trimmed = report.generate()
    assert len(trimmed.encode()) <= report.MAX_BYTES < len(full.encode())
    assert trimmed.count("\n| ") < full.count("\n| ")

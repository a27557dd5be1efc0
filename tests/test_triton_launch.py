"""FastLaunch: the launch cache of vattn's Triton kernels (vattn/ops/triton_launch.py).

The key must be at least as fine as Triton's own specialization, or a kernel compiled for
aligned pointers / int32 sizes would be reused where Triton would have compiled another one.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from vattn.kernels.launch import FastLaunch, _direct_launch, _runtime_key, next_power_of_2, set_fast_launch  # noqa: E402

HAS_CUDA = torch.cuda.is_available()


def test_next_power_of_2_matches_triton() -> None:
    for n in [0, 1, 2, 3, 4, 5, 31, 32, 33, 64, 100, 1000, 4096, 4097]:
        assert next_power_of_2(n) == triton.next_power_of_2(max(n, 1)), n


def test_runtime_key_separates_what_triton_specializes() -> None:
    base = torch.zeros(64, dtype=torch.float32)
    aligned, misaligned = base[:8], base[1:9]  # 0 and 4 bytes past a 16-byte boundary
    assert base.data_ptr() % 16 == 0
    k = lambda *a: tuple(_runtime_key(a))  # noqa: E731
    assert k(aligned) != k(misaligned)
    assert k(aligned) == k(base[4:12])  # 16 bytes on: aligned again
    assert k(aligned) != k(aligned.to(torch.float16))
    assert k(1) != k(2) and k(0) != k(1) and k(-1) != k(0)  # 0, 1 and negatives by value
    assert k(16) != k(17) and k(32) == k(48)  # divisibility by 16
    assert k(16) != k(2**32) and k(2**32) != k(2**33 + 1)  # int32 vs int64 range, alignment
    assert k(2.0) == k(3.5) and k(2.0) != k(2)  # floats by type only
    assert k(True) != k(False) and k(True) != k(1)
    assert k(None) != k(0)


def test_direct_launch_only_for_the_known_launcher_shape() -> None:
    """The C launcher is called directly only for Triton 3.6's ``CudaLauncher.__call__`` shape
    (scratch allocation, then ``launch``) and kernels without scratch memory."""

    class CudaLauncher:
        launch, launch_cooperative_grid, launch_pdl = print, False, True
        global_scratch_size = profile_scratch_size = 0

        def __call__(self, gridX, gridY, gridZ, stream, function, *args):  # type: ignore[no-untyped-def]
            raise AssertionError

    run = CudaLauncher()
    assert _direct_launch(run) == (print, False, True)
    run.global_scratch_size = 128  # type: ignore[misc]
    assert _direct_launch(run) is None

    class Newer(CudaLauncher):
        def __call__(self, gridX, gridY, gridZ, stream, function, kernel_metadata, *args):  # type: ignore[no-untyped-def, override]
            raise AssertionError

    Newer.__name__ = "CudaLauncher"
    assert _direct_launch(Newer()) is None  # another version's __call__: through it
    run = CudaLauncher()
    run.gsan_enabled = False  # type: ignore[attr-defined]
    assert _direct_launch(run) is None
    assert _direct_launch(None) is None and _direct_launch(object()) is None


@triton.jit
def _axpy_kernel(x_ptr, y_ptr, out_ptr, n, alpha, BLOCK: tl.constexpr, SQUARE: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    if SQUARE:
        x = x * x
    tl.store(out_ptr + offs, alpha * x + tl.load(y_ptr + offs, mask=mask), mask=mask)


def test_disabled_under_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    fl = FastLaunch(_axpy_kernel)
    assert not fl.enabled and not fl.supported
    set_fast_launch(True)  # cannot switch on what the interpreter cannot use
    assert not fl.enabled


def test_switch_and_environment_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    fl = FastLaunch(_axpy_kernel)
    assert fl.supported and fl.enabled
    try:
        set_fast_launch(False)
        assert not fl.enabled
    finally:
        set_fast_launch(True)
    assert fl.enabled
    monkeypatch.setenv("VATTN_TRITON_FAST_LAUNCH", "0")
    assert FastLaunch(_axpy_kernel).supported and not FastLaunch(_axpy_kernel).enabled


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (none is visible to torch here)")
def test_fast_launch_matches_triton_and_reuses_kernels() -> None:
    fl = FastLaunch(_axpy_kernel)
    assert fl.enabled
    g = torch.Generator(device="cuda").manual_seed(0)
    # small integers: exact in fp32 whether or not the kernel fuses alpha * x + y
    buf = torch.randint(-8, 8, (3, 4096 + 8), device="cuda", generator=g).float()

    def run(n: int, offset: int, alpha: float, square: bool) -> None:
        x, y = buf[0, offset:offset + n], buf[1, offset:offset + n]
        out = torch.full_like(buf[2], float("nan"))[offset:offset + n]
        fl[(triton.cdiv(n, 256),)](x, y, out, n, alpha, BLOCK=256, SQUARE=square, num_warps=4)
        torch.testing.assert_close(out, alpha * (x * x if square else x) + y, rtol=0, atol=0)

    cases = [(4096, 0, 2.0, False), (4096, 1, 2.0, False), (4095, 0, 0.5, False), (4096, 0, 2.0, True),
             (1, 0, 3.0, False), (17, 3, -1.0, True)]  # alignment, n % 16, n == 1, constexprs
    for case in cases * 3:  # first round compiles; later rounds take the cached kernels
        run(*case)
    keys = len(fl.cache)
    assert 4 <= keys <= len(cases)
    if triton.__version__.startswith("3.6."):  # the device's Triton: cached launches call the C launcher
        assert all(entry.direct is not None for entry in fl.cache.values())
    for case in cases:
        run(*case)
    assert len(fl.cache) == keys


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (none is visible to torch here)")
def test_fast_launch_is_captured_on_the_graph_stream() -> None:
    fl = FastLaunch(_axpy_kernel)
    x, y, out = (torch.randint(-8, 8, (1000,), device="cuda").float() for _ in range(3))

    def launch() -> None:
        fl[(4,)](x, y, out, 1000, 2.0, BLOCK=256, SQUARE=False)

    launch()
    launch()  # cached: the fast path
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch()
    x.copy_(torch.randint(-8, 8, (1000,), device="cuda").float())
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, 2.0 * x + y, rtol=0, atol=0)


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (none is visible to torch here)")
def test_cached_launches_still_call_registered_launch_hooks() -> None:
    """Cached launches skip Triton's launch metadata only while no launch hook is set."""
    from triton import knobs

    fl = FastLaunch(_axpy_kernel)
    x, y, out = (torch.randint(-8, 8, (1000,), device="cuda").float() for _ in range(3))

    def launch() -> None:
        fl[(4,)](x, y, out, 1000, 2.0, BLOCK=256, SQUARE=False)

    launch()
    launch()  # cached
    seen: list[object] = []
    hook = seen.append
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        launch()
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    launch()
    torch.cuda.synchronize()
    assert len(seen) == 1
    torch.testing.assert_close(out, 2.0 * x + y, rtol=0, atol=0)


class _FakeParam:
    def __init__(self, name: str, constexpr: bool) -> None:
        self.name, self.is_constexpr = name, constexpr


class _FakeKernel:
    """Stands in for a @triton.jit kernel: (x, y, n, BLOCK: constexpr); records what ran."""

    params = [_FakeParam("x", False), _FakeParam("y", False), _FakeParam("n", False), _FakeParam("BLOCK", True)]

    def __init__(self) -> None:
        self.ran: list[tuple] = []
        kernel = self

        class Compiled:
            function, packed_metadata = "fn", "meta"

            def _run(self, gx, gy, gz, stream, function, packed, launch_md, enter, exit_, *args):  # noqa: ANN001
                kernel.ran.append(("cached", (gx, gy, gz), args))

        self.compiled = Compiled()

    def __getitem__(self, grid):  # noqa: ANN001
        def launch(*args, **kwargs):  # noqa: ANN002, ANN003
            self.ran.append(("triton", grid, args))
            return self.compiled
        return launch


def test_launch_plan_repeats_launches_with_other_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    from vattn.kernels.launch import LaunchPlan, record_launches

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 7, raising=False)
    kernel = _FakeKernel()
    fl = FastLaunch(kernel)
    assert fl.supported and fl.enabled
    a, b, fixed, other = (torch.zeros(8) for _ in range(4))
    with record_launches() as first:
        fl[(2,)](a, fixed, 8, BLOCK=4)  # first launch of the specialization: through Triton
    assert first == [None] and LaunchPlan.build(first, [a], [fixed]) is None
    with record_launches() as launches:
        fl[(2,)](a, fixed, 8, BLOCK=4)
    assert kernel.ran[-1] == ("cached", (2, 1, 1), (a, fixed, 8, 4))
    plan = LaunchPlan.build(launches, [a], [fixed])
    assert plan is not None
    assert LaunchPlan.build(launches, [a], []) is None  # `fixed` unknown: not replayable
    assert LaunchPlan.build(launches, [], [fixed]) is None
    assert plan.run([b])  # tensors as addresses: Triton's launcher takes them without checks
    assert kernel.ran[-1] == ("cached", (2, 1, 1), (b.data_ptr(), fixed.data_ptr(), 8, 4))
    assert plan.run([a]) and kernel.ran[-1][2][0] == a.data_ptr() != b.data_ptr()
    set_fast_launch(False)
    try:
        n = len(kernel.ran)
        assert not plan.run([other]) and len(kernel.ran) == n  # switched to Triton's path: caller launches
        with record_launches() as off:
            fl[(2,)](a, fixed, 8, BLOCK=4)
        assert off == [None]
    finally:
        set_fast_launch(True)

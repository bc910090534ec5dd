"""The small-row matrix kernel (mtpspec/kernels): right to a proven fp32 bound, row-invariant bitwise, and
nn.Linear's drop-in everywhere else (training, many rows, other dtypes, no compiler).

Bound: each output is one FMA chain over k = 0..K-1 plus a bias, K + 1 roundings, so
|y - y_exact| <= gamma_(K+1) * (sum_k |x_k w_k| + |b|) with gamma_n = n u / (1 - n u), u = 2^-24 (Higham,
Accuracy and Stability of Numerical Algorithms, 3.1); the exact value is computed in fp64, whose own error
(~1e-16 relative) is far below the bound.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mtpspec import kernels
from mtpspec.models.common import Linear

pytestmark = pytest.mark.skipif(
    not kernels.available() and os.environ.get("MTPSPEC_REQUIRE_KERNELS") != "1",
    reason=f"the kernel could not be built here: {kernels._EXT.error}",
)

U = 2.0**-24


def _bound(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    k = x.shape[-1] + 1
    mag = x.double().abs() @ w.double().abs().T + (0 if b is None else b.double().abs())
    return k * U / (1 - k * U) * mag


@pytest.mark.parametrize("n,k", [(1, 1), (31, 7), (33, 64), (96, 257), (1000, 256)])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_fp64_within_the_fma_chain_bound(n, k, rows, bias):
    g = torch.Generator().manual_seed(n * 1000 + k + rows)
    x, w = torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    with torch.inference_mode():
        y = kernels.packed_linear(x, kernels.pack(w), n, b)
    exact = x.double() @ w.double().T + (0 if b is None else b.double())
    assert y.shape == (rows, n) and y.dtype == torch.float32
    assert ((y.double() - exact).abs() <= _bound(x, w, b)).all()


def test_each_row_is_bitwise_the_same_whatever_shares_the_call():
    g = torch.Generator().manual_seed(1)
    w, b = torch.randn(200, 96, generator=g), torch.randn(200, generator=g)
    panels = kernels.pack(w)
    x = torch.randn(64, 96, generator=g)
    alone = torch.cat([kernels.packed_linear(x[i : i + 1], panels, 200, b) for i in range(64)])
    for rows in (2, 3, 4, 5, 9, 17, 64):
        assert torch.equal(kernels.packed_linear(x[:rows], panels, 200, b), alone[:rows])
    other = torch.randn(7, 96, generator=g)
    mixed = kernels.packed_linear(torch.cat([other[:3], x[5:6], other[3:]]), panels, 200, b)
    assert torch.equal(mixed[3], alone[5])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_more_threads_give_the_same_bits(dtype):
    """The kernel splits the panels between torch's threads (OpenMP): each output is still computed by one thread."""
    g = torch.Generator().manual_seed(2)
    w, x = torch.randn(1000, 64, generator=g).to(dtype), torch.randn(4, 64, generator=g).to(dtype)
    panels, before = kernels.pack(w), torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernels.packed_linear(x, panels, 1000)
        torch.set_num_threads(2)
        two = kernels.packed_linear(x, panels, 1000)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def test_the_kernel_is_built_with_openmp_so_threads_split_it():
    """at::parallel_for runs on one thread when the extension is compiled without OpenMP: the kernel must be built
    with it (it once was not, and two threads read the weights no faster than one)."""
    assert kernels.available()
    build = kernels.build_dir("small_linear.cpp", "", kernels._EXT.cflags) / "build.ninja"
    assert "-fopenmp" in build.read_text()


def test_linear_is_an_nn_linear_with_the_same_state_dict():
    torch.manual_seed(0)
    ours, ref = Linear(24, 40), nn.Linear(24, 40)
    ref.load_state_dict(ours.state_dict())
    assert isinstance(ours, nn.Linear) and list(ours.state_dict()) == list(ref.state_dict())
    x = torch.randn(3, 5, 24)  # leading dims kept
    with torch.inference_mode():
        y = ours(x)
    assert y.shape == (3, 5, 40)
    # both sides are within the bound of the exact value, whatever their order of summation
    diff = (y - F.linear(x, ref.weight, ref.bias)).reshape(15, 40).double().abs()
    assert (diff <= 2 * _bound(x.reshape(15, 24), ours.weight, ours.bias)).all()


def test_training_takes_autograd_and_inference_follows_the_updated_weights():
    torch.manual_seed(0)
    lin = Linear(16, 8)
    x = torch.randn(2, 16)
    with torch.inference_mode():
        before = lin(x)
    loss = lin(x).pow(2).sum()  # grad enabled, weight requires grad: F.linear, differentiable
    loss.backward()
    assert lin.weight.grad is not None and lin.weight.grad.abs().sum() > 0
    torch.optim.SGD(lin.parameters(), lr=0.5).step()  # an in-place update: the panels must be rebuilt
    with torch.inference_mode():
        after = lin(x)
    assert not torch.allclose(before, after)
    assert ((after.double() - F.linear(x, lin.weight, lin.bias).double()).abs() <= 2 * _bound(x, lin.weight, lin.bias)).all()
    lin.weight = nn.Parameter(torch.zeros(8, 16))  # a replaced weight too
    with torch.inference_mode():
        assert torch.equal(lin(x), lin.bias.detach().expand(2, 8))


def test_what_the_kernel_does_not_take_runs_on_f_linear_bitwise():
    torch.manual_seed(0)
    lin = Linear(32, 48)
    with torch.inference_mode():
        many = torch.randn(kernels.MAX_ROWS + 1, 32)  # a prefill
        assert torch.equal(lin(many), F.linear(many, lin.weight, lin.bias))
        lin64 = lin.to(torch.float64)
        x64 = torch.randn(2, 32, dtype=torch.float64)
        assert torch.equal(lin64(x64), F.linear(x64, lin64.weight, lin64.bias))


@pytest.mark.parametrize("rows", [1, 3, 9, 17])
@pytest.mark.parametrize("k", [200, 63])
def test_bf16_accumulates_in_fp32_and_rounds_once(rows, k):
    """Widened to fp32 FMAs, or (AVX512_BF16, kernels.bf16_pairs()) exact bf16 products added in pairs by vdpbf16ps:
    either way at most K + 1 fp32 roundings per output (products of two bf16 are exact in fp32), then one to bf16.
    An odd K pads the pairs with a zero column."""
    g = torch.Generator().manual_seed(rows * 1000 + k)
    w, x, b = (torch.randn(*s, generator=g).bfloat16() for s in ((70, k), (rows, k), (70,)))
    panels = kernels.pack(w)
    assert panels.shape == ((3, (k + 1) // 2, 64) if kernels.bf16_pairs() else (3, k, 32))
    y = kernels.packed_linear(x, panels, 70, b)
    exact = x.double() @ w.double().T + b.double()  # bf16 values are exact in fp64
    assert y.dtype == torch.bfloat16
    # the fp32 chain's error, then one rounding to bf16 (relative 2^-8 at most)
    chain = _bound(x.float(), w.float(), b.float())
    assert ((y.double() - exact).abs() <= chain + (exact.abs() + chain) * 2.0**-8).all()
    alone = torch.cat([kernels.packed_linear(x[i : i + 1], panels, 70, b) for i in range(rows)])
    assert torch.equal(alone, y)


def test_bad_calls_are_named():
    w = kernels.pack(torch.randn(40, 16))
    with pytest.raises(RuntimeError, match="float32 only"):
        kernels.packed_linear(torch.randn(1, 16, dtype=torch.float64), w, 40)
    with pytest.raises(RuntimeError, match="of one dtype"):
        kernels.packed_linear(torch.randn(1, 16, dtype=torch.bfloat16), w, 40)
    with pytest.raises(RuntimeError, match="shapes do not match"):
        kernels.packed_linear(torch.randn(1, 15), w, 40)
    with pytest.raises(RuntimeError, match="shapes do not match"):
        kernels.packed_linear(torch.randn(1, 16), w, 90)


def test_turned_off_every_product_is_f_linear():
    code = (
        "import torch, torch.nn.functional as F\n"
        "from mtpspec import kernels\nfrom mtpspec.models.common import Linear\n"
        "lin = Linear(8, 4); x = torch.randn(2, 8)\n"
        "with torch.inference_mode(): y = lin(x)\n"
        "assert not kernels.available() and 'MTPSPEC_KERNELS=0' in kernels._EXT.error\n"
        "assert torch.equal(y, F.linear(x, lin.weight, lin.bias)); print('ok')\n"
    )
    env = {**os.environ, "MTPSPEC_KERNELS": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


@pytest.mark.parametrize("t, start, window", [(1, 20, 0), (4, 20, 0), (3, 10, 5), (2, 0, 0)])
def test_bf16_attention_in_fp32_matches_sdpa_within_one_rounding(t, start, window):
    """models.attention.attend computes bf16 windows as three fp32 products (torch's bf16 SDPA on CPU was
    8x slower); against SDPA in fp64 on the same bf16 inputs it differs by the output's bf16 rounding (2^-8
    relative to the largest output, with room for fp32 accumulation over 64 dims)."""
    from mtpspec.models.attention import attend
    from mtpspec.models.batch import ForwardBatch

    g = torch.Generator().manual_seed(t * 100 + start)
    q = torch.randn(2, 8, t, 64, generator=g).bfloat16()
    k, v = (torch.randn(2, 2, start + t, 64, generator=g).bfloat16() for _ in range(2))
    fb = ForwardBatch.one(start, t)
    got = attend(q, k, v, fb, window)
    ref = attend(q.double(), k.double(), v.double(), fb, window)  # fp64: SDPA's own path
    assert got.dtype == torch.bfloat16 and got.shape == (2, 8, t, 64)
    assert ((got.double() - ref).abs() <= ref.abs() * 2.0**-8 + 1e-5).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [3, kernels.MAX_ROWS + 6])
def test_product_few_rows_on_the_kernel_many_on_torch_same_function(dtype, rows):
    """kernels.Product (the folded MTP module, the draft-vocabulary head): the kernel up to MAX_ROWS rows, torch's
    batched matmul over the same panels past it (a prompt's catch-up), both within the bound of the exact product."""
    g = torch.Generator().manual_seed(rows)
    w, x, b = (torch.randn(*s, generator=g).to(dtype) for s in ((75, 40), (rows, 40), (75,)))
    y = kernels.Product(w)(x, b)
    exact = x.double() @ w.double().T + b.double()
    chain = _bound(x.float(), w.float(), b.float())
    # bf16: the output rounds to bf16 once in the kernel; torch's path rounds the product x w^T, then its sum with the bias
    product = (x.double() @ w.double().T).abs()
    slack = 0 if dtype == torch.float32 else (product + exact.abs() + 2 * chain) * 2.0**-8
    assert y.shape == (rows, 75) and ((y.double() - exact).abs() <= 2 * chain + slack).all()


@pytest.mark.parametrize("rows", [1, 5])
def test_widened_bf16_results_are_the_bf16_values_in_fp32(rows):
    """packed_linear(widen=True), the LM head's path (Linear.wide): the fp32 values of the bf16 results, bitwise."""
    g = torch.Generator().manual_seed(rows)
    w, x, b = (torch.randn(*s, generator=g).bfloat16() for s in ((70, 48), (rows, 48), (70,)))
    panels = kernels.pack(w)
    y = kernels.packed_linear(x, panels, 70, b)
    wide = kernels.packed_linear(x, panels, 70, b, widen=True)
    assert wide.dtype == torch.float32 and torch.equal(wide, y.float())
    lin = Linear(48, 70).bfloat16()
    with torch.no_grad():
        lin.weight.copy_(w), lin.bias.copy_(b)
    with torch.inference_mode():
        assert torch.equal(lin.wide(x), lin(x).float())

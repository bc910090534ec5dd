"""GGUF block kernels (mtpspec/kernels/quantized.py, gguf_blocks.cpp): exact dequantization against gguf's numpy
reference, products within the fp32 bound of the kernel's own arithmetic, row-invariance bitwise. The row-invariant
attention kernel (attention.py, attention.cpp) that the quantized models run beside them: bitwise per row, and
within an fp32 bound of fp64 attention.

Bound for linear(): the kernel multiplies the 8-bit activations q * dx by the quants exactly in integers, then per
output adds K/32 tile terms float(isum) * (scale * dx) in fp32 (Q4_K/Q5_K: two terms per tile, the scaled dot and the
scaled min). Each term takes at most 3 roundings (the scale product, int -> float past 2^24, the product) and the
sum K/32 * 2 more, so |y - exact| <= gamma_(2K/32+3) * sum of |terms|, and sum of |terms| <= |x_q| @ |W|^T, with W
split into its scaled quants and its mins for Q4_K/Q5_K (|a - b| can be far below |a| + |b|). The exact value is
fp64 x_q @ dequantize(W)^T.
"""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QT

from mtpspec.kernels import quantized as Q

pytestmark = pytest.mark.skipif(
    not Q.available() and os.environ.get("MTPSPEC_REQUIRE_KERNELS") != "1",
    reason=f"the GGUF block kernel could not be built here: {Q._EXT.error}",
)

U = 2.0**-24
SCALES = {  # byte offsets of each block's fp16 scales (the rest of a block is any bytes)
    QT.Q8_0: (0,), QT.Q4_0: (0,), QT.Q5_0: (0,), QT.Q4_K: (0, 2), QT.Q5_K: (0, 2), QT.Q6_K: (208,),
}
QUANTS = {QT.Q4_K: (16, 144), QT.Q5_K: (16, 176)}  # byte range of the quants (Q5_K: fifth bits too)


def _random_blocks(qtype: QT, n: int, k: int, seed: int) -> np.ndarray:
    """Valid GGUF bytes for an (n, k) weight: random floats for the float types; random bytes with fp16 scales in
    [2^-12, 2^-6) for the block types."""
    rng = np.random.default_rng(seed)
    if qtype == QT.F32:
        return rng.standard_normal((n, k), dtype=np.float32).view(np.uint8)
    if qtype == QT.F16:
        return rng.standard_normal((n, k)).astype(np.float16).view(np.uint8)
    if qtype == QT.BF16:
        return gguf.quants.quantize(rng.standard_normal((n, k), dtype=np.float32), QT.BF16).view(np.uint8)
    bs, ts = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (n * k // bs, ts), dtype=np.uint8)
    for off in SCALES[qtype]:
        blocks[:, off : off + 2] = (2.0 ** rng.uniform(-12, -6, n * k // bs)).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return blocks.reshape(n, -1)


def _reference(raw: np.ndarray, qtype: QT, k: int) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(raw, qtype), dtype=np.float32)).view(-1, k)


CASES = [(t, 40, 512) for t in Q.TYPES] + [(QT.Q8_0, 33, 96), (QT.Q5_0, 16, 640), (QT.Q4_0, 7, 32)]


@pytest.mark.parametrize("qtype,n,k", CASES, ids=[f"{t.name}-{n}x{k}" for t, n, k in CASES])
def test_dequantize_and_embedding_are_gguf_bit_for_bit(qtype, n, k):
    raw = _random_blocks(qtype, n, k, seed=int(qtype) + n)
    ref = _reference(raw, qtype, k)  # (N, K)
    w = Q.from_gguf(raw, qtype, (n, k))
    assert w.layout == ("rows" if qtype in Q.FLOAT_TYPES else "panels16")
    got = Q.dequantize(w)
    assert got.dtype == torch.float32 and got.shape == (n, k)
    assert torch.equal(got.view(torch.int32), ref.view(torch.int32))  # bit for bit, signed zeros included
    ids = torch.tensor([n - 1, 0, 3 % n, n - 1])
    assert torch.equal(Q.embedding(w, ids).view(torch.int32), ref[ids].view(torch.int32))
    rows = Q.QuantizedWeight(qtype, (n, k), torch.from_numpy(raw.copy()).view(n, -1), "rows")  # the no-compiler layout
    assert torch.equal(Q.dequantize(rows).view(torch.int32), ref.view(torch.int32))
    assert torch.equal(Q.embedding(rows, ids), ref[ids])


def _magnitude(raw: np.ndarray, qtype: QT, k: int, xq: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """|x_q| @ |W|^T, W split into scaled quants and mins for Q4_K/Q5_K (the mins: the blocks with all quants 0)."""
    absw = ref.double().abs()
    if qtype in QUANTS:
        lo, hi = QUANTS[qtype]
        blocks = raw.reshape(-1, GGML_QUANT_SIZES[qtype][1]).copy()
        blocks[:, lo:hi] = 0
        mins = _reference(blocks.reshape(raw.shape), qtype, k).double()  # -dmin * m
        absw = (ref.double() - mins).abs() + mins.abs()
    return xq.double().abs() @ absw.T


@pytest.mark.parametrize("qtype,n,k", CASES, ids=[f"{t.name}-{n}x{k}" for t, n, k in CASES])
def test_linear_is_within_the_fp32_bound_of_its_8_bit_product(qtype, n, k):
    raw = _random_blocks(qtype, n, k, seed=7 * int(qtype) + n)
    ref = _reference(raw, qtype, k)
    w = Q.from_gguf(raw, qtype, (n, k))
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(n + k)) * 3
    y = Q.linear(x, w)
    assert y.shape == (5, n) and y.dtype == torch.float32
    if qtype in Q.FLOAT_TYPES:  # the fp32 panel kernel: one FMA chain over K
        xq, terms = x, k + 1
    else:
        q, d = Q.quantize_activations(x)
        xq = q.float() * d.repeat_interleave(32, dim=1)  # (M, K): what the kernel multiplies
        assert ((xq - x).abs() <= d.repeat_interleave(32, dim=1) / 2 * (1 + 1e-6)).all()
        terms = 2 * k // 32 + 3
    exact = xq.double() @ ref.double().T
    bound = terms * U / (1 - terms * U) * _magnitude(raw, qtype, k, xq, ref)
    assert ((y.double() - exact).abs() <= bound).all()
    rows = Q.QuantizedWeight(qtype, (n, k), torch.from_numpy(raw.copy()).view(n, -1), "rows")  # the no-compiler path
    torch.testing.assert_close(Q.linear(x, rows), x @ ref.T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("qtype", Q.TYPES, ids=[t.name for t in Q.TYPES])
def test_linear_rows_are_bitwise_the_same_whatever_shares_the_call(qtype):
    n, k = 72, 512
    w = Q.from_gguf(_random_blocks(qtype, n, k, seed=3), qtype, (n, k))
    x = torch.randn(20, k, generator=torch.Generator().manual_seed(int(qtype)))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([Q.linear(x[i : i + 1], w) for i in range(20)])  # (20, N)
        for t in (1, 2):
            torch.set_num_threads(t)
            for m in range(1, 17):
                assert torch.equal(Q.linear(x[:m], w), alone[:m]), (t, m)
            assert torch.equal(Q.linear(x, w), alone)  # past 10 rows: a second pass over each panel
            assert torch.equal(Q.linear(x[5:14].view(3, 3, k), w), alone[5:14].view(3, 3, n))
    finally:
        torch.set_num_threads(threads)


def test_strict_errors_name_the_problem():
    raw = _random_blocks(QT.Q4_K, 4, 256, seed=0)
    with pytest.raises(ValueError, match="multiple of 256"):
        Q.from_gguf(raw, QT.Q4_K, (8, 128))
    with pytest.raises(ValueError, match="takes 576 bytes"):
        Q.from_gguf(raw[:, :-1], QT.Q4_K, (4, 256))
    with pytest.raises(ValueError, match="not supported"):
        Q.from_gguf(raw, QT.Q2_K, (4, 256))
    w = Q.from_gguf(raw, QT.Q4_K, (4, 256))
    with pytest.raises(ValueError, match="takes 256"):
        Q.linear(torch.zeros(1, 128), w)
    with pytest.raises(IndexError, match="0..3"):
        Q.embedding(w, torch.tensor([4]))


MANY = {  # weights that read one input, mixed block types; n past a whole panel where the types allow
    "qkv-q5_0-q5_0-q8_0": [(QT.Q5_0, 64), (QT.Q5_0, 16), (QT.Q8_0, 33)],
    "q4_k-q6_k-q5_0": [(QT.Q4_K, 48), (QT.Q6_K, 7), (QT.Q5_0, 40)],
}


def _many(spec, k, layout="panels16"):
    ws = []
    for i, (qtype, n) in enumerate(spec):
        raw = _random_blocks(qtype, n, k, seed=11 * i + n)
        ws.append(Q.from_gguf(raw, qtype, (n, k)) if layout == "panels16"
                  else Q.QuantizedWeight(qtype, (n, k), torch.from_numpy(raw.copy()).view(n, -1), "rows"))
    return ws


@pytest.mark.parametrize("name", list(MANY))
def test_linear_many_is_bitwise_the_separate_linears_side_by_side(name):
    k = 512
    ws = _many(MANY[name], k)
    x = torch.randn(20, k, generator=torch.Generator().manual_seed(5)) * 2
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            for m in list(range(1, 17)) + [20]:  # past 10 rows: a second pass over each panel
                want = torch.cat([Q.linear(x[:m], w) for w in ws], dim=-1)  # (M, sum N)
                got = Q.linear_many(x[:m], ws)
                assert got.shape == (m, sum(n for _, n in MANY[name])) and torch.equal(got, want), (t, m)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(Q.linear_many(x[:4], ws[1:2]), Q.linear(x[:4], ws[1]))  # one weight
    assert Q.linear_many(x[:0], ws).shape == (0, sum(n for _, n in MANY[name]))


def test_linear_many_falls_back_to_separate_linears():
    k = 512
    x = torch.randn(3, 2, k, generator=torch.Generator().manual_seed(6))
    ws = _many(MANY["q4_k-q6_k-q5_0"], k)
    rows = _many(MANY["q4_k-q6_k-q5_0"], k, layout="rows")  # the no-compiler layout
    assert torch.equal(Q.linear_many(x, ws), torch.cat([Q.linear(x, w) for w in ws], dim=-1))  # leading dimensions
    assert torch.equal(Q.linear_many(x[0], ws), Q.linear_many(x[0].contiguous(), ws))  # a strided x
    mixed = [ws[0], rows[1], ws[2]]
    assert torch.equal(Q.linear_many(x[0], mixed), torch.cat([Q.linear(x[0], w) for w in mixed], dim=-1))
    dense = torch.cat([Q.dequantize(w) for w in rows])  # (sum N, K)
    torch.testing.assert_close(Q.linear_many(x, rows), x @ dense.T, rtol=1e-5, atol=1e-5)


def test_linear_many_strict_errors_name_the_problem():
    k = 512
    ws = _many(MANY["q4_k-q6_k-q5_0"], k)
    x = torch.randn(2, k)
    op = torch.ops.mtpspec_gguf.linear_many
    data, qtypes, ns = [w.data for w in ws], [w.qtype.value for w in ws], [w.shape[0] for w in ws]
    with pytest.raises(RuntimeError, match=r"weight 1 data does not hold \(7, 512\)"):
        op(x, [data[0], data[1][:-1], data[2]], qtypes, ns)
    with pytest.raises(RuntimeError, match=r"weight 2 data does not hold \(49, 512\)"):
        op(x, data, qtypes, ns[:2] + [49])  # a fourth panel
    with pytest.raises(RuntimeError, match="weight 1 data does not hold"):
        op(x, data, [qtypes[0], int(QT.Q8_0), qtypes[2]], ns)  # the wrong type for the bytes
    with pytest.raises(RuntimeError, match="block type 3 is not one of"):
        op(x, data, [qtypes[0], 3, qtypes[2]], ns)
    with pytest.raises(RuntimeError, match="multiple of the block size 256 of weight 0"):
        op(torch.randn(2, 128), data, qtypes, ns)
    with pytest.raises(RuntimeError, match="x must be contiguous float32"):
        op(x.t().contiguous().t(), data, qtypes, ns)
    with pytest.raises(RuntimeError, match="3 weights, 2 qtypes, 3 ns"):
        op(x, data, qtypes[:2], ns)
    with pytest.raises(ValueError, match="no weights"):
        Q.linear_many(x, [])
    with pytest.raises(ValueError, match="takes 512"):
        Q.linear_many(torch.zeros(1, 256), ws)


def test_linear_many_traces_with_fake_tensors():
    from torch._subclasses.fake_tensor import FakeTensorMode

    ws = _many(MANY["qkv-q5_0-q5_0-q8_0"], 512)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        y = torch.ops.mtpspec_gguf.linear_many(mode.from_tensor(torch.zeros(3, 512)), [w.data for w in ws],
                                               [w.qtype.value for w in ws], [w.shape[0] for w in ws])
    assert y.shape == (3, 113) and y.dtype == torch.float32


def _attention_case(r, h, g, d, s, seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(r, h, d, generator=gen)  # (R, H, D)
    k, v = torch.randn(2, 1, g, s, d, generator=gen) * 2  # (B, G, S, D) each
    hi = torch.arange(s - r, s)  # each row's last key: a verify window at the end of the cache
    return q, k, v, torch.zeros(r, dtype=torch.long), torch.zeros(r, dtype=torch.long), hi


def _verify_rows(r, h, g, d, s, seed):
    """r rows of two sequences interleaved (row i reads sequence i % 2), each sequence's rows a verify window at the
    end of its keys (sequence 1's ends 20 keys earlier), every third row a sliding window of 41 keys."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(r, h, d, generator=gen)  # (R, H, D)
    k, v = torch.randn(2, 2, g, s, d, generator=gen) * 2  # (B, G, S, D) each
    i = torch.arange(r)
    seq = i % 2
    hi = s - 1 - 20 * seq - (r - 1 - i) // 2
    lo = torch.where(i % 3 == 0, hi - 40, 0)
    return q, k, v, seq, lo, hi


@pytest.mark.parametrize("h,g,d", [(4, 1, 256), (8, 2, 72), (6, 3, 20)], ids=["gemma3-270m", "gqa-72", "odd-20"])
def test_attend_rows_is_bitwise_per_row_whatever_shares_the_call(h, g, d):
    """Each row alone (one thread) against the rows together: any number of them (one sequence's window of 9 and of
    16, two sequences' rows interleaved), in another order, on one thread or two, with keys past each row's last."""
    from mtpspec.kernels import attention as A

    if not A.available():
        pytest.skip("the attention kernel could not be built here")
    n, s = 16, 140
    mask = torch.rand(n, s, generator=torch.Generator().manual_seed(1)) > 0.3
    threads = torch.get_num_threads()
    try:
        for q, k, v, seq, lo, hi in (_attention_case(n, h, g, d, s, seed=d), _verify_rows(n, h, g, d, s, seed=d)):
            m_tree = mask.clone()
            m_tree[torch.arange(n), hi] = True  # a tree row sees itself
            for m in (None, m_tree):
                def call(rows):
                    return A.attend_rows(q[rows], k, v, seq[rows], lo[rows], hi[rows], None if m is None else m[rows])

                torch.set_num_threads(1)
                alone = torch.cat([call([i]) for i in range(n)])  # (n, H, D)
                for t in (1, 2):
                    torch.set_num_threads(t)
                    for r in (1, 2, 5, 9, 16):
                        assert torch.equal(call(list(range(r))), alone[:r]), (t, r)
                    order = torch.randperm(n, generator=torch.Generator().manual_seed(t)).tolist()
                    assert torch.equal(call(order), alone[order]), t
                pad = torch.randn(*k.shape[:2], 60, d)
                got = A.attend_rows(q, torch.cat([k, pad], 2), torch.cat([v, pad], 2), seq, lo, hi,
                                    None if m is None else torch.cat([m, torch.ones(n, 60, dtype=torch.bool)], 1))
                assert torch.equal(got, alone)  # keys past a row's last one change nothing
    finally:
        torch.set_num_threads(threads)


def test_the_softmax_exp_is_within_one_ulp_of_exp():
    """The kernel's 16-lane exp (attention.cpp, exp16) against fp64 exp on every 256th float of [-110, 0] (the
    softmax's range: scores minus their max), results below FLT_MIN (gradual underflow) included, and a stretch of
    positive x; the tail of a call (not a multiple of 16 long) goes through the same function."""
    from mtpspec.kernels import attention as A

    if not A.available():
        pytest.skip("the attention kernel could not be built here")
    bits = torch.arange(0, torch.tensor(-110.0).view(torch.int32).item() & 0x7FFFFFFF, 256, dtype=torch.int32)
    x = torch.cat([-bits.view(torch.float32), torch.linspace(0, 88.5, 100_003)])  # (n,), n % 16 != 0
    got = torch.ops.mtpspec_attention.exp_lanes(x).double()
    exact = torch.exp(x.double())
    ulp = torch.ldexp(torch.ones_like(exact), (torch.frexp(exact).exponent - 24).clamp(min=-149))  # fp32 spacing at exact
    assert ((got - exact).abs() <= ulp).all(), float(((got - exact).abs() / ulp).max())
    special = torch.tensor([-float("inf"), -1000.0, -104.0, -0.0, 0.0, 89.0, float("inf"), float("nan")])
    assert torch.equal(torch.ops.mtpspec_attention.exp_lanes(special)[:7], torch.tensor([0, 0, 0, 1, 1, float("inf"), float("inf")]))
    assert torch.ops.mtpspec_attention.exp_lanes(special)[7].isnan()


@pytest.mark.parametrize("h,g,d", [(4, 1, 256), (8, 2, 72), (6, 3, 20)], ids=["gemma3-270m", "gqa-72", "odd-20"])
def test_attend_rows_is_within_the_fp32_bound_of_fp64_attention(h, g, d):
    """Bound: each score q.k takes d products and d sums in fp32 (gamma_(d+1) * |q|.|k|, times the scale exactly up to
    one more rounding); exp and the sums of n terms add a few ulps relative, the division one more. A score error e
    moves a softmax weight by at most a factor exp(2e), so |o - exact| <= (exp(2 * max e) - 1 + (n + 8) u) * sum_j p_j |v_j|
    in fp64 terms (the weighted mean of |v|)."""
    from mtpspec.kernels import attention as A

    if not A.available():
        pytest.skip("the attention kernel could not be built here")
    q, k, v, seq, lo, hi = _attention_case(9, h, g, d, 140, seed=2 * d)
    mask = torch.rand(9, 140, generator=torch.Generator().manual_seed(3)) > 0.5
    mask[torch.arange(9), hi] = True
    scale = d**-0.5
    for m in (None, mask):
        got = A.attend_rows(q, k, v, seq, lo, hi, m, scale).double()  # (R, H, D)
        kr = k[0].double().repeat_interleave(h // g, 0)  # (H, S, D)
        vr = v[0].double().repeat_interleave(h // g, 0)
        for r in range(9):
            seen = torch.zeros(140, dtype=torch.bool)
            seen[: int(hi[r]) + 1] = True
            if m is not None:
                seen &= m[r]
            s = (kr[:, seen] @ q[r].double()[:, :, None])[..., 0] * scale  # (H, n)
            p = torch.softmax(s, -1)
            exact = (p[:, None, :] @ vr[:, seen])[:, 0]  # (H, D)
            n = int(seen.sum())
            e = (d + 2) * U / (1 - (d + 2) * U) * (kr[:, seen].abs() @ q[r].double().abs()[:, :, None])[..., 0] * scale  # (H, n)
            bound = (torch.exp(2 * e.max(-1).values) - 1 + (n + 8) * 4 * U)[:, None] * (p[:, None, :] @ vr[:, seen].abs())[:, 0]
            assert ((got[r] - exact).abs() <= bound).all(), (r, float(((got[r] - exact).abs() / bound).max()))
    # the torch fallback (no compiler) computes the same function
    torch.testing.assert_close(A.attend_rows(q, k.transpose(2, 3).contiguous().transpose(2, 3), v, seq, lo, hi, mask, scale),
                               A.attend_rows(q, k, v, seq, lo, hi, mask, scale), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_rows_is_index_copy_in_place(dtype):
    """The compiled step's KV write (attention.cpp write_rows) stores each row where index_copy_ does, in the buffers
    themselves (views of a larger cache, as a graph's span is), for rows in a graph's transposed layout and in one it
    does not take (last dim strided: ATen's write); a position outside the buffer is an error."""
    from mtpspec.kernels import attention as A

    if not A.available():
        pytest.skip("the attention kernel could not be built here")
    gen = torch.Generator().manual_seed(4)
    cache = torch.randn(3, 1, 2, 16, 8, generator=gen).to(dtype)  # (L, B, nkv, max_len, hd)
    pos = torch.tensor([5, 6, 7])
    rows = torch.randn(1, 3, 2, 8, generator=gen).to(dtype).transpose(1, 2)  # (B, nkv, T, hd) from (B, T, nkv, hd)
    for k in (rows, rows.transpose(2, 3).contiguous().transpose(2, 3)):
        span = cache.clone()
        k_buf, v_buf = span[1, ..., :12, :], span[2, ..., :12, :]  # (B, nkv, S, hd) views of the span
        ptr = k_buf.data_ptr()
        torch.ops.mtpspec_attention.write_rows(k_buf, v_buf, pos, k, 2 * k)
        want = cache.clone()
        want[1, ..., :12, :].index_copy_(2, pos, k)
        want[2, ..., :12, :].index_copy_(2, pos, 2 * k)
        assert torch.equal(span, want) and k_buf.data_ptr() == ptr
    with pytest.raises(RuntimeError, match="outside the buffer"):
        torch.ops.mtpspec_attention.write_rows(k_buf, v_buf, torch.tensor([5, 6, 12]), rows, rows)


def _lower_isa_build(source: str, ns: str, isa: str, flags: tuple[str, ...]):
    """A kernel source built for a lower instruction set, its ops under <ns>_<isa> (cached as the kernels are)."""
    from torch.utils.cpp_extension import load

    from mtpspec import kernels

    src = Path(kernels.__file__).with_name(source).read_text().replace(ns, f"{ns}_{isa}")
    cflags = (*kernels.EXACT_CFLAGS, *flags)
    build = kernels.cache_dir() / "isa" / isa / hashlib.sha256((src + " ".join(cflags)).encode()).hexdigest()[:12]
    build.mkdir(parents=True, exist_ok=True)
    if not (build / source).exists():
        (build / source).write_text(src)
    load(name=f"{ns}_{isa}", sources=[str(build / source)], build_directory=str(build), is_python_module=False,
         verbose=False, extra_cflags=list(cflags), extra_ldflags=["-fopenmp"])
    return getattr(torch.ops, f"{ns}_{isa}")


def test_the_instruction_sets_give_the_same_bits():
    """The block kernel's and the row attention's AVX-512 (VNNI), AVX2 and scalar paths compute the same numbers: this
    machine's builds against the same sources built without AVX-512 (where this CPU has it) and without AVX2: every
    block type at 1-12 rows, attention rows with windows and a tree mask."""
    from mtpspec.kernels import attention as A

    assert A.available()
    native = torch.ops.mtpspec_gguf.isa()
    lower = ([("avx2", ("-mno-avx512f",))] if native == "avx512vnni" else []) + [("scalar", ("-mno-avx2", "-mno-avx512f", "-mno-fma"))]
    jobs = [(src, ns, isa, flags) for src, ns in (("gguf_blocks.cpp", "mtpspec_gguf"), ("attention.cpp", "mtpspec_attention"))
            for isa, flags in lower]
    with ThreadPoolExecutor(2) as pool:  # the compilers side by side: ~45 s cold on 2 cores, cached after
        built = dict(zip([(ns, isa) for _, ns, isa, _ in jobs], pool.map(lambda a: _lower_isa_build(*a), jobs)))
    assert {isa: built[("mtpspec_gguf", isa)].isa() for isa, _ in lower} == {isa: isa for isa, _ in lower}
    n, k = 40, 512
    for qtype in Q.TYPES:
        if qtype not in SCALES:
            continue  # float types: not this kernel
        w = Q.from_gguf(_random_blocks(qtype, n, k, seed=5), qtype, (n, k))
        for m in (1, 2, 3, 5, 9, 12):
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
            want = torch.ops.mtpspec_gguf.linear(x, w.data, int(w.qtype), n)
            for isa, _ in lower:
                assert torch.equal(built[("mtpspec_gguf", isa)].linear(x, w.data, int(w.qtype), n), want), (qtype.name, m, isa)
    g = torch.Generator().manual_seed(0)
    for d in (64, 72):  # a head size with a tail past the 16-lane vectors
        q, kk, v = torch.randn(7, 4, d, generator=g), torch.randn(2, 2, 90, d, generator=g), torch.randn(2, 2, 90, d, generator=g)
        seq, hi = torch.tensor([0, 0, 0, 1, 1, 1, 1]), torch.tensor([40, 41, 42, 85, 86, 87, 88])
        lo = torch.tensor([0, 0, 10, 0, 60, 60, 80])
        mask = torch.rand(7, 90, generator=g) < 0.7
        for msk in (None, mask):
            want = torch.ops.mtpspec_attention.attend_rows(q, kk, v, seq, lo, hi, msk, 0.125)
            for isa, _ in lower:
                got = built[("mtpspec_attention", isa)].attend_rows(q, kk, v, seq, lo, hi, msk, 0.125)
                assert torch.equal(got, want), (d, msk is None, isa)

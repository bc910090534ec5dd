"""GGUF block types from --quant (mtpspec.quant, kinds q8_0 ... q6_k): the K-quant quantizers against a scalar
transliteration of llama.cpp's reference (bytes equal), round trips through gguf.quants.dequantize, the layer on the
block kernel (row-invariant, its own dequantized weight), per-layer fallbacks, and every drafter lossless on the
block-quantized demo (a hybrid: Gated DeltaNet + gated attention), batched as alone."""

import gguf
import numpy as np
import pytest
import torch
from torch import nn

import mtpspec
from mtpspec.cli import main
from mtpspec.errors import ConfigError
from mtpspec.kernels import quantized
from mtpspec.models.blocks import holds_blocks
from mtpspec.models.common import Linear
from mtpspec.quant import (BLOCK_KINDS, block_linear, gguf_type, kind_of, layer_kind, quantize, quantize_gguf,
                           quantize_q4_k, quantize_q5_k, quantize_q6_k)

F = np.float32


# A scalar transliteration of llama.cpp's quantize_row_q{4,5,6}_K_ref (ggml-quants.c), one np.float32 operation at
# a time in the C loops' order: the oracle for mtpspec.quant's vectorised K-quants (bytes equal).

def _nearest_int(v) -> int:
    return int(np.rint(F(v)))


def _make_qkx2_quants(nmax, x, weights, rmin, rdelta, nstep):
    n = len(x)
    mn = mx = x[0]
    sum_w = weights[0]
    sum_x = sum_w * x[0]
    for i in range(1, n):
        mn = x[i] if x[i] < mn else mn
        mx = x[i] if x[i] > mx else mx
        sum_w = sum_w + weights[i]
        sum_x = sum_x + weights[i] * x[i]
    if mn > 0:
        mn = F(0)
    if mx == mn:
        return [0] * n, F(0), -mn
    iscale = F(nmax) / (mx - mn)
    scale = F(1) / iscale
    L, best = [0] * n, F(0)
    for i in range(n):
        L[i] = max(0, min(nmax, _nearest_int(iscale * (x[i] - mn))))
        diff = scale * F(L[i]) + mn - x[i]
        best = best + weights[i] * (diff * diff)
    for step in range(nstep + 1):
        iscale = (F(rmin) + F(rdelta) * F(step) + F(nmax)) / (mx - mn)
        aux = [max(0, min(nmax, _nearest_int(iscale * (v - mn)))) for v in x]
        sum_l = sum_l2 = sum_xl = F(0)
        for i in range(n):
            wl = weights[i] * F(aux[i])
            sum_l, sum_l2, sum_xl = sum_l + wl, sum_l2 + wl * F(aux[i]), sum_xl + wl * x[i]
        D = sum_w * sum_l2 - sum_l * sum_l
        if D > 0:
            this_scale = (sum_w * sum_xl - sum_x * sum_l) / D
            this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D
            if this_min > 0:
                this_min, this_scale = F(0), sum_xl / sum_l2
            cur = F(0)
            for i in range(n):
                diff = this_scale * F(aux[i]) + this_min - x[i]
                cur = cur + weights[i] * (diff * diff)
            if cur < best:
                L, best, scale, mn = aux, cur, this_scale, this_min
    return L, scale, -mn


def _k_superblock(x, nmax, rmin, rdelta, nstep):
    L, scales, mins = [0] * 256, [F(0)] * 8, [F(0)] * 8
    max_scale = max_min = F(0)
    for j in range(8):
        xb = x[32 * j : 32 * j + 32]
        sum_x2 = F(0)
        for v in xb:
            sum_x2 = sum_x2 + v * v
        av_x = np.sqrt(sum_x2 / F(32))
        L[32 * j : 32 * j + 32], scales[j], mins[j] = _make_qkx2_quants(nmax, xb, [av_x + abs(v) for v in xb], rmin, rdelta, nstep)
        max_scale = scales[j] if scales[j] > max_scale else max_scale
        max_min = mins[j] if mins[j] > max_min else max_min
    inv_scale = F(63) / max_scale if max_scale > 0 else F(0)
    inv_min = F(63) / max_min if max_min > 0 else F(0)
    s, ls, lm = [0] * 12, [], []
    for j in range(8):
        ls.append(min(63, _nearest_int(inv_scale * scales[j]) & 0xFF))
        lm.append(min(63, _nearest_int(inv_min * mins[j]) & 0xFF))
        if j < 4:
            s[j], s[j + 4] = ls[j], lm[j]
        else:
            s[j + 4] = (ls[j] & 0xF) | ((lm[j] & 0xF) << 4)
            s[j - 4] |= (ls[j] >> 4) << 6
            s[j] |= (lm[j] >> 4) << 6
    d, dmin = np.float16(max_scale / F(63)), np.float16(max_min / F(63))
    for j in range(8):
        dl = F(d) * F(ls[j])
        if dl == 0:
            continue
        ml = F(dmin) * F(lm[j])
        for i in range(32):
            L[32 * j + i] = max(0, min(nmax, _nearest_int((x[32 * j + i] + ml) / dl)))
    return L, np.array([d, dmin], "<f2").tobytes() + bytes(s)


def ref_q4_k(x) -> bytes:
    L, head = _k_superblock(x, 15, -1.0, 0.1, 20)
    return head + bytes(L[j + l] | (L[j + l + 32] << 4) for j in range(0, 256, 64) for l in range(32))


def ref_q5_k(x) -> bytes:
    L, head = _k_superblock(x, 31, -0.5, 0.1, 15)
    qh, ql, m1, m2 = [0] * 32, [], 1, 2
    for n in range(0, 256, 64):
        for j in range(32):
            l1, l2 = L[n + j], L[n + j + 32]
            if l1 > 15:
                l1, qh[j] = l1 - 16, qh[j] | m1
            if l2 > 15:
                l2, qh[j] = l2 - 16, qh[j] | m2
            ql.append(l1 | (l2 << 4))
        m1, m2 = m1 << 2, m2 << 2
    return head + bytes(qh) + bytes(ql)


def _make_qx_quants(nmax, x):
    mx = amax = F(0)
    for v in x:
        if abs(v) > amax:
            amax, mx = abs(v), v
    if amax < F(1e-15):
        return [0] * len(x), F(0)

    def trial(iscale):
        ls = [max(-nmax, min(nmax - 1, _nearest_int(iscale * v))) for v in x]
        sumlx = suml2 = F(0)
        for v, l in zip(x, ls):
            w = v * v
            sumlx, suml2 = sumlx + w * v * F(l), suml2 + w * F(l) * F(l)
        return ls, sumlx, suml2

    ls, sumlx, suml2 = trial(F(-nmax) / mx)
    L = [l + nmax for l in ls]
    scale = sumlx / suml2 if suml2 else F(0)
    best = scale * sumlx
    for step in [*range(-9, 0), *range(1, 10)]:
        ls, sumlx, suml2 = trial(-(F(nmax) + F(0.1) * F(step)) / mx)
        if suml2 > 0 and sumlx * sumlx > best * suml2:
            L, scale = [l + nmax for l in ls], sumlx / suml2
            best = scale * sumlx
    return L, scale


def ref_q6_k(x) -> bytes:
    L, scales = [0] * 256, [F(0)] * 16
    max_scale = max_abs = F(0)
    for ib in range(16):
        L[16 * ib : 16 * ib + 16], scales[ib] = _make_qx_quants(32, x[16 * ib : 16 * ib + 16])
        if abs(scales[ib]) > max_abs:
            max_abs, max_scale = abs(scales[ib]), scales[ib]
    if max_abs < F(1e-15):
        return bytes(210)
    iscale = F(-128) / max_scale
    d = np.float16(F(1) / iscale)
    sc = [min(127, _nearest_int(iscale * s)) for s in scales]
    for j in range(16):
        dl = F(d) * F(sc[j])
        if dl != 0:
            for i in range(16):
                L[16 * j + i] = max(-32, min(31, _nearest_int(x[16 * j + i] / dl))) + 32
    ql, qh = [0] * 128, [0] * 64
    for h, j in enumerate((0, 128)):
        for l in range(32):
            ql[64 * h + l] = (L[j + l] & 0xF) | ((L[j + l + 64] & 0xF) << 4)
            ql[64 * h + l + 32] = (L[j + l + 32] & 0xF) | ((L[j + l + 96] & 0xF) << 4)
            qh[32 * h + l] = (L[j + l] >> 4) | ((L[j + l + 32] >> 4) << 2) | ((L[j + l + 64] >> 4) << 4) | ((L[j + l + 96] >> 4) << 6)
    return bytes(ql) + bytes(qh) + np.array(sc, np.int8).tobytes() + np.array([d], "<f2").tobytes()


def superblocks() -> np.ndarray:
    """(24, 256) fp32: Gaussian, heavy-tailed, one-signed, sub-blocks of very different scales, a few distinct values,
    constant rows; each at three magnitudes."""
    rng = np.random.default_rng(7)
    rows = [rng.standard_normal(256), rng.standard_t(2, 256), rng.uniform(-1, 1, 256), rng.uniform(0.1, 1, 256),
            -rng.uniform(0.1, 1, 256), rng.standard_normal(256) * np.repeat(rng.uniform(0, 2, 16), 16),
            np.round(rng.standard_normal(256) * 4) / 4, np.full(256, -0.3)]
    return np.stack([r * s for r in rows for s in (1e-3, 0.05, 7.0)]).astype(F)


@pytest.mark.parametrize("vectorised, scalar", [(quantize_q4_k, ref_q4_k), (quantize_q5_k, ref_q5_k), (quantize_q6_k, ref_q6_k)])
def test_k_quants_equal_the_reference_loops_bytewise(vectorised, scalar):
    x = superblocks()
    got = vectorised(x)
    for i, row in enumerate(x):
        assert bytes(got[i]) == scalar([F(v) for v in row]), f"super-block {i}"


def weights(n: int = 64, k: int = 512, seed: int = 0) -> np.ndarray:
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(F) * F(0.02)
    w[0] = 0.0  # an all-zero row
    w[1, 3] = 5.0  # an outlier
    w[2, :256] = -0.01  # constant (super-)blocks
    return w


# relative RMS error bound on Gaussian weights (measured: q8_0 0.0076, q6_k 0.017, q5_k 0.034, q5_0 0.040,
# q4_k 0.065, q4_0 0.078), and the rows of one block's worth of magnitude
REL_RMS = {"q8_0": 0.01, "q6_k": 0.025, "q5_k": 0.045, "q5_0": 0.05, "q4_k": 0.08, "q4_0": 0.09}


@pytest.mark.parametrize("kind", BLOCK_KINDS)
def test_round_trip_through_gguf_dequantize(kind):
    w = weights()
    raw = quantize_gguf(torch.from_numpy(w), kind)
    bs, ts = gguf.GGML_QUANT_SIZES[gguf_type(kind)]
    assert raw.dtype == np.uint8 and raw.shape == (64, 512 // bs * ts)
    deq = gguf.quants.dequantize(raw, gguf_type(kind)).reshape(w.shape)
    rest = w[3:]
    rel = np.sqrt(((deq[3:] - rest) ** 2).mean() / (rest**2).mean())
    assert rel < REL_RMS[kind], rel
    assert (deq[0] == 0).all()
    assert np.abs(deq[2, :256] + 0.01).max() < 1e-4  # a constant block comes back close (to fp16 scale rounding)
    assert abs(deq[1, 3] - 5.0) < 5.0 * 0.02  # the outlier keeps its size
    bf = torch.from_numpy(w).bfloat16()  # a bf16 checkpoint: its weights widened exactly, then quantized
    assert np.array_equal(quantize_gguf(bf, kind), quantize_gguf(bf.float().numpy(), kind))


def test_k_quants_beat_the_32_blocks_of_their_bits():
    w = weights(seed=3)[3:]
    err = {k: np.abs(gguf.quants.dequantize(quantize_gguf(w, k), gguf_type(k)).reshape(w.shape) - w).mean() for k in BLOCK_KINDS}
    assert err["q4_k"] < err["q4_0"] and err["q5_k"] < err["q5_0"] and err["q6_k"] < err["q5_k"] and err["q8_0"] < err["q6_k"]


def test_quantize_gguf_errors():
    with pytest.raises(ConfigError, match="multiple of 256"):
        quantize_gguf(np.zeros((4, 640), F), "q4_k")
    with pytest.raises(ConfigError, match="inf or nan"):
        quantize_gguf(np.full((4, 64), np.nan, F), "q8_0")
    with pytest.raises(ConfigError, match="not a GGUF block kind"):
        quantize_gguf(np.zeros((4, 64), F), "int8")


@pytest.mark.parametrize("kind", ["q8_0", "q4_0", "q4_k", "q6_k"])
def test_block_layer_is_the_kernel_over_its_gguf_bytes(kind):
    """The layer is a Linear on block weights whose weight is gguf.quants.dequantize of quantize_gguf's bytes (bit for bit), its
    product the block kernel's (plus the bias), row-invariant; a bf16 input comes back bf16."""
    torch.manual_seed(1)
    lin = nn.Linear(512, 96, bias=True)
    layer = block_linear(lin, kind)
    assert isinstance(layer, Linear) and holds_blocks(layer) and kind_of(layer) == kind
    ref = gguf.quants.dequantize(quantize_gguf(lin.weight, kind), gguf_type(kind)).reshape(96, 512)
    w = quantized.dequantize(layer.qweight)  # (N, K) fp32
    assert torch.equal(w, torch.from_numpy(np.ascontiguousarray(ref)))
    x = torch.randn(9, 512)
    y = layer(x)  # (9, 96)
    assert torch.equal(y, quantized.linear(x, layer.qweight) + lin.bias.detach())
    assert all(torch.equal(y[i : i + 1], layer(x[i : i + 1])) for i in (0, 4, 8))
    assert torch.equal(layer(x.view(3, 3, 512)), y.view(3, 3, 96))
    assert layer(x.bfloat16()).dtype == torch.bfloat16
    # the activations are rounded to 8 bits per 32 inputs: near the fp64 product with the dequantized weight
    wd = w.double()
    exact = x.double() @ wd.t() + lin.bias.double()
    assert ((y.double() - exact).abs() <= 0.02 * (x.double().abs() @ wd.abs().t()) + 1e-5).all()


def test_layer_fallbacks():
    """A K-quant needs K % 256 == 0 (else q8_0), every block kind K % 32 == 0 (else the layer keeps fp weights)."""
    assert layer_kind(512, "q4_k") == "q4_k" and layer_kind(256, "q6_k") == "q6_k"
    assert layer_kind(640, "q4_k") == "q8_0" and layer_kind(640, "q4_0") == "q4_0"
    assert layer_kind(172, "q4_k") is None and layer_kind(172, "q8_0") is None
    with pytest.raises(ConfigError, match="does not fit GGUF block type 'q4_k'"):
        block_linear(nn.Linear(640, 64), "q4_k")


def test_quantize_reports_per_layer_kinds(assets):
    m = assets / "models"
    model = mtpspec.load(m / "stories260K.bin", m / "tok512.bin")
    report = quantize(model.module, "q4_k")  # dim 64: no 256-wide input anywhere, so q8_0; the 172-wide down projections kept
    assert report.kind == "q4_k" and report.layers == {"q8_0": 31, "kept": 5} and report.bytes_after < report.bytes_before / 3
    with pytest.raises(ConfigError, match="fp64"):
        mtpspec.load(m / "stories260K.bin", m / "tok512.bin", dtype="fp64", quant="q4_k")


CODE = ['def mean(data):\n    """Return the sample arithmetic mean of data."""\n',
        "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
        "import os\nimport sys\n\ndef main():\n"]


@pytest.fixture(scope="module", params=["q8_0", "q4_k"])
def demo_block(request):
    return request.param, mtpspec.load("demo", quant=request.param)


def test_demo_layers(demo_block):
    kind, model = demo_block
    kinds = [kind_of(m) for m in model.module.modules() if isinstance(m, Linear) and holds_blocks(m)]
    assert not any(isinstance(m, nn.Linear) and not holds_blocks(m) for m in model.module.modules())  # every linear layer, the head too
    expect = {"q8_0": {"q8_0": 71}, "q4_k": {"q4_k": 62, "q8_0": 9}}[kind]  # q4_k: the K = 640 down projections go q8_0
    assert {k: kinds.count(k) for k in set(kinds)} == expect


def test_drafters_lossless_on_the_block_quantized_demo(demo_block):
    """The quantized hybrid is the target: its own quantized MTP module (k = 3, and 1) and n-gram drafting give its
    plain greedy tokens exactly, 64 tokens on each prompt."""
    _, model = demo_block
    for prompt in CODE:
        ref = model.generate(prompt, max_new_tokens=64).tokens
        for drafter, k in (("mtp", 3), ("mtp", 1), ("ngram", 3)):
            r = model.generate(prompt, drafter=drafter, k=k, max_new_tokens=64)
            assert r.tokens == ref, f"{drafter} k={k} differs on {prompt[:20]!r}"
            assert drafter == "ngram" or r.stats.accepted_tokens > 0


def test_batch_equals_alone_on_the_block_quantized_demo(demo_block):
    _, model = demo_block
    alone = [model.generate(p, max_new_tokens=64).tokens for p in CODE]
    for drafter in ("mtp", "ngram"):
        batch = model.generate_batch(CODE, drafter=drafter, k=3, max_new_tokens=64)
        assert [r.tokens for r in batch] == alone, drafter


def test_cli_generate_block_quantized(capsys, assets):
    m = assets / "models"
    rc = main(["generate", "Once", "--model", str(m / "stories260K.bin"), "--tokenizer", str(m / "tok512.bin"), "--quant", "q8_0",
               "--max-new-tokens", "4", "--json"])
    assert rc == 0 and '"tokens"' in capsys.readouterr().out

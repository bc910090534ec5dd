"""Weight-only int8 / int4 quantization (mtpspec.quant; the GGUF block kinds: test_quant_blocks.py): the layer against its own dequantized weight in fp64,
the int8 round-trip bound, every drafter lossless on the quantized model, and the errors for bad settings."""

import pytest
import torch
from torch import nn

import mtpspec
from mtpspec.cli import main
from mtpspec.errors import ConfigError
from mtpspec.prompts import tinystories_prompts
from mtpspec.quant import QuantConfig, QuantLinear, greedy_agreement, layer_kind, quantize, quantize_int4, quantize_int8

SHAPES = [(256, 4096), (640, 256), (1024, 512), (96, 48)]  # (K, N): the demo's head and MLP, a wider one, a small one


def weights(n: int, k: int, dtype=torch.float32, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.02
    w[0] = 0.0  # an all-zero row
    w[1, 3] = 5.0  # one outlier sets its row's scale
    w[2] = torch.logspace(-30, 1, k)  # magnitudes far below the scale
    return w.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k, n", SHAPES)
def test_int8_round_trip_within_half_a_step(k, n, dtype):
    """|w - q s| <= s / 2 for every element, exactly (the proof is in quantize_int8's docstring); checked in fp64,
    where q s (8 + 8 significant bits) and w - q s (both on a grid of the scale's ulp / 2) are exact."""
    w = weights(n, k, dtype)
    q, s = quantize_int8(w)
    assert q.dtype == torch.int8 and s.dtype == torch.bfloat16 and q.abs().max() <= 127
    err = (w.double() - q.double() * s.double()[:, None]).abs()
    assert (err <= s.double()[:, None] / 2).all()
    assert (q[0] == 0).all()  # the zero row stays exactly zero


@pytest.mark.parametrize("g", [32, 64, 128])
def test_int4_round_trip_within_half_a_step_and_the_zero_points_rounding(g):
    """|w - ((q - 8) s + z)| <= s / 2 + ulp(z) / 2: every weight lies in [z - 8 s, z + 7 s] up to z's bf16 rounding."""
    w = weights(64, 256)
    codes, sz = quantize_int4(w, g)
    assert codes.max() <= 15 and sz.shape == (256 // g, 64, 2)
    s, z = (t.t().repeat_interleave(g, 1) for t in sz.double().unbind(-1))  # (N, K) each
    deq = (codes.double() - 8) * s + z
    ulp_z = (torch.nextafter(z.bfloat16(), torch.full_like(z, float("inf")).bfloat16()).double() - z).abs()
    assert ((w.double() - deq).abs() <= s / 2 + ulp_z / 2 + 1e-30).all()


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("k, n", SHAPES[:3])
def test_quant_linear_equals_its_dequantized_weight_in_fp64(kind, k, n):
    """The kernel's product against x (rounded to bf16, as the layer feeds it) @ deq(W)^T in fp64.

    Tolerance: the kernel accumulates in fp32 (error <= K 2^-24 sum |x| |w|, doubled for slack) and rounds its
    output to bf16 (relative error <= 2^-8); measured errors sit at the bf16 rounding, the accumulation term ~1e-8."""
    torch.manual_seed(1)
    lin = nn.Linear(k, n, bias=True)
    layer = QuantLinear(lin, QuantConfig(kind, 64))
    assert layer.kind == kind
    x = torch.randn(3, 5, k)  # (B, T, K)
    y = layer(x)  # (B, T, N)
    assert y.shape == (3, 5, n) and y.dtype == torch.float32
    xb = x.bfloat16().double()
    w = layer.dequantize()  # (N, K) fp64
    ref = xb @ w.t()  # (B, T, N)
    mag = xb.abs() @ w.abs().t()
    acc = k * 2.0**-23 * mag
    got = y.double() - lin.bias.double()  # the bias is added in fp32 after the kernel: remove it exactly enough
    tol = 2.0**-8 * (ref.abs() + acc) + acc + 2.0**-24 * lin.bias.double().abs()
    assert ((got - ref).abs() <= tol).all()
    assert torch.equal(layer.weight, w.float())  # .weight: the dequantized weight in the model's dtype


def test_shapes_the_kernels_cannot_take():
    cfg = QuantConfig("int4", 64)
    assert layer_kind(512, 256, cfg) == "int4" and layer_kind(4, 256, cfg) == "int8" and layer_kind(512, 96, cfg) == "int8"
    assert layer_kind(64, 172, cfg) is None and layer_kind(64, 172, QuantConfig("int8")) is None
    with pytest.raises(ConfigError, match="K % 8"):
        QuantLinear(nn.Linear(172, 64), QuantConfig("int8"))


def test_rows_do_not_depend_on_how_many_are_computed():
    """What keeps a k+1-row verify equal to plain decoding: row i of an M-row product equals the 1-row product."""
    torch.manual_seed(2)
    for kind in ("int8", "int4"):
        layer = QuantLinear(nn.Linear(256, 512, bias=False), QuantConfig(kind, 32))
        x = torch.randn(9, 256)
        assert torch.equal(layer(x)[4:5], layer(x[4:5]))


def test_quantize_replaces_every_linear_and_falls_back_to_int8_where_int4_cannot(assets):
    m = assets / "models"
    model = mtpspec.load(m / "stories260K.bin", m / "tok512.bin", quant="int4", group_size=32)
    mods = list(model.module.modules())
    kept = [x for x in mods if isinstance(x, nn.Linear)]  # (models.common.Linear, an nn.Linear)
    assert kept and all(x.in_features == 172 for x in kept)  # the down projections: the int8 kernel needs K % 8 == 0
    kinds = {x.kind for x in mods if isinstance(x, QuantLinear)}
    assert kinds == {"int4", "int8"}  # the 172-row gate / up projections (N % 16 != 0) go int8
    assert model.module.model.embed_tokens.weight.dtype == torch.float32  # the tied table is kept for lookups


def test_quantize_reports_and_refuses_fp64(assets):
    m = assets / "models"
    model = mtpspec.load(m / "stories260K.bin", m / "tok512.bin")
    report = quantize(model.module, "int8")
    assert report.layers == {"int8": 31, "kept": 5} and report.bytes_after < report.bytes_before / 3
    with pytest.raises(ConfigError, match="fp64"):
        mtpspec.load(m / "stories260K.bin", m / "tok512.bin", dtype="fp64", quant="int8")
    wide = mtpspec.load(m / "stories260K.bin", m / "tok512.bin", dtype="fp64")
    with pytest.raises(ConfigError, match="fp64"):
        quantize(wide.module, "int8")


@pytest.mark.parametrize("bad, msg", [("int5", "unknown quant 'int5'"), ("INT8", "unknown quant")])
def test_unknown_quant_names(assets, bad, msg):
    m = assets / "models"
    with pytest.raises(ConfigError, match=msg):
        mtpspec.load(m / "stories260K.bin", m / "tok512.bin", quant=bad)


@pytest.fixture(scope="module")
def demo_fp32():
    return mtpspec.load("demo")


@pytest.fixture(scope="module", params=["int8", "int4"])
def demo_quant(request):
    return mtpspec.load("demo", quant=request.param)


CODE = ['def mean(data):\n    """Return the sample arithmetic mean of data."""\n',
        "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n"]


def test_drafters_lossless_on_the_quantized_demo(demo_quant, demo_fp32):
    """The quantized model is the target: mtp (its own quantized MTP module), ngram, and the unquantized model as a
    draft model all give exactly its plain greedy tokens (one prompt: a second one doubled the 5 s per quantization)."""
    for prompt in CODE[:1]:
        ref = demo_quant.generate(prompt, max_new_tokens=40).tokens
        for drafter, k, dm in (("mtp", 1, None), ("mtp", 3, None), ("ngram", 3, None), ("draft", 3, demo_fp32)):
            r = demo_quant.generate(prompt, drafter=drafter, k=k, draft_model=dm, max_new_tokens=40)
            assert r.tokens == ref, f"{drafter} k={k} differs from the quantized model's plain greedy"
            assert drafter == "ngram" or r.stats.accepted_tokens > 0


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_drafters_lossless_on_quantized_stories(assets, stories_q80, kind):
    m = assets / "models"
    target = mtpspec.load(m / "stories260K.bin", m / "tok512.bin", quant=kind, group_size=32)
    for prompt in tinystories_prompts(3):
        ref = target.generate(prompt, max_new_tokens=48).tokens
        for drafter, k in (("ngram", 4), ("draft", 3)):
            r = target.generate(prompt, drafter=drafter, k=k, draft_model=stories_q80 if drafter == "draft" else None, max_new_tokens=48)
            assert r.tokens == ref, f"{drafter} k={k} differs on {prompt!r}"


def test_greedy_agreement(demo_fp32):
    same = greedy_agreement(demo_fp32, demo_fp32, CODE[:1], max_new_tokens=12)
    assert same.match_rate == 1.0 and same.prefix_lengths == [12]
    q8 = mtpspec.load("demo", quant="int8")
    a = greedy_agreement(demo_fp32, q8, CODE, max_new_tokens=12)
    assert 0.0 <= a.match_rate <= 1.0 and len(a.prefix_lengths) == 2 and all(0 <= p <= 12 for p in a.prefix_lengths)
    assert set(a.to_json()) >= {"match_rate", "mean_prefix", "prefix_lengths"}


def run(capsys, *argv):
    try:
        rc = main(list(argv))
    except SystemExit as e:
        rc = e.code
    return rc, capsys.readouterr().err


@pytest.mark.parametrize("extra, msg", [
    (["--quant", "int5"], "unknown quant 'int5' (choose int8, int4, q8_0, q4_0, q5_0, q4_k, q5_k, q6_k, or none)"),
    (["--quant", "int8", "--dtype", "fp64"], "does not combine with fp64"),
    (["--quant", "int4", "--quant-group-size", "48"], "int4 group size must be one of 32, 64, 128"),
])
def test_cli_errors(capsys, assets, extra, msg):
    m = assets / "models"
    rc, err = run(capsys, "generate", "hi", "--model", str(m / "stories260K.bin"), "--tokenizer", str(m / "tok512.bin"), *extra)
    assert rc == 2 and msg in err and "Traceback" not in err


def test_cli_generate_quantized(capsys, assets):
    m = assets / "models"
    rc = main(["generate", "Once", "--model", str(m / "stories260K.bin"), "--tokenizer", str(m / "tok512.bin"), "--quant", "int8",
               "--max-new-tokens", "4", "--json"])
    assert rc == 0 and '"tokens"' in capsys.readouterr().out

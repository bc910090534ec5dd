"""--quant (mtpspec.quant) beyond the block kinds themselves (test_quant_blocks.py): the int8 / int4 names as aliases
of q8_0 / q4_k, block kinds on bf16 models (the layer bitwise the fp32 block product rounded to bf16, row-invariant;
every drafter lossless on the quantized model), greedy_agreement, and the errors for bad settings."""

import pytest
import torch
from torch import nn

import mtpspec
from mtpspec.cli import main
from mtpspec.errors import ConfigError
from mtpspec.kernels import quantized
from mtpspec.models.blocks import holds_blocks
from mtpspec.models.common import Linear
from mtpspec.prompts import tinystories_prompts
from mtpspec.quant import ALIASES, block_linear, check_quant, greedy_agreement, kind_of, quantize


def test_int8_and_int4_are_q8_0_and_q4_k():
    assert ALIASES == {"int8": "q8_0", "int4": "q4_k"}
    assert check_quant("int8").kind == "q8_0" and check_quant("int4", torch.bfloat16).kind == "q4_k"
    torch.manual_seed(0)
    lin = nn.Linear(512, 64)
    x = torch.randn(5, 512)
    for alias, kind in ALIASES.items():
        a, b = nn.Sequential(Linear(512, 64)), nn.Sequential(Linear(512, 64))
        a.load_state_dict(nn.Sequential(lin).state_dict())
        b.load_state_dict(nn.Sequential(lin).state_dict())
        ra, rb = quantize(a, alias), quantize(b, kind)
        assert ra == rb and ra.kind == kind and ra.layers == {kind: 1} and kind_of(a[0]) == kind
        assert torch.equal(a(x), b(x))


def test_aliases_load_the_same_model(assets):
    m = assets / "models"
    a = mtpspec.load(m / "stories260K.bin", m / "tok512.bin", quant="int4")
    b = mtpspec.load(m / "stories260K.bin", m / "tok512.bin", quant="q4_k")
    ids = torch.tensor(a.encode("Once upon a time"))
    assert torch.equal(a.module.forward_tokens(ids, a.module.new_cache()).logits, b.module.forward_tokens(ids, b.module.new_cache()).logits)


@pytest.mark.parametrize("kind", ["q8_0", "q4_0", "q4_k", "q6_k"])
def test_bf16_block_layer_is_the_fp32_product_rounded(kind):
    """On a bf16 layer: x widened exactly, the block kernel's fp32 product plus the fp32 bias, rounded to bf16 once;
    rows independent of how many share the call (bitwise); .weight dequantized into bf16; wide() the same values."""
    torch.manual_seed(1)
    lin = nn.Linear(512, 96, bias=True).bfloat16()
    layer = block_linear(lin, kind)
    assert isinstance(layer, Linear) and holds_blocks(layer) and kind_of(layer) == kind and layer.bias.dtype == torch.float32
    x = torch.randn(9, 512).bfloat16()
    y = layer(x)  # (9, 96)
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, (quantized.linear(x.float(), layer.qweight) + lin.bias.float()).bfloat16())
    assert all(torch.equal(y[i : i + 1], layer(x[i : i + 1])) for i in (0, 4, 8))
    assert torch.equal(layer(x.view(3, 3, 512)), y.view(3, 3, 96))
    assert torch.equal(layer.wide(x), y.float())
    assert layer.weight.dtype == torch.bfloat16 and torch.equal(layer.weight, quantized.dequantize(layer.qweight).bfloat16())
    assert list(layer.state_dict()) == ["bias"]


def test_quantize_a_bf16_model(assets):
    """Every linear layer whose input fits 32-blocks goes on block weights, the head included; the 172-wide down
    projections and the tied embedding table stay bf16; logits stay fp32 (the values of bf16 outputs)."""
    m = assets / "models"
    model = mtpspec.load(m / "stories260K.bin", m / "tok512.bin", dtype="bf16")
    report = quantize(model.module, "int8")
    assert report.kind == "q8_0" and report.layers == {"q8_0": 31, "kept": 5} and report.bytes_after < report.bytes_before / 1.5
    kept = [x for x in model.module.modules() if isinstance(x, nn.Linear) and not holds_blocks(x)]
    assert len(kept) == 5 and all(x.in_features == 172 and x.weight.dtype == torch.bfloat16 for x in kept)
    assert holds_blocks(model.module.lm_head) and model.module.model.embed_tokens.weight.dtype == torch.bfloat16
    assert model.module.dtype == torch.bfloat16
    ids = torch.tensor(model.encode("Once upon a time"))
    logits = model.module.forward_tokens(ids, model.module.new_cache()).logits
    assert logits.dtype == torch.float32 and torch.equal(logits, logits.bfloat16().float())
    again = quantize(model.module, "q4_k")  # layers already on block weights are left alone
    assert again.layers == {"kept": 5}


def test_quantize_refuses_fp64_and_unknown_names(assets):
    m = assets / "models"
    with pytest.raises(ConfigError, match="fp64"):
        mtpspec.load(m / "stories260K.bin", m / "tok512.bin", dtype="fp64", quant="int8")
    wide = mtpspec.load(m / "stories260K.bin", m / "tok512.bin", dtype="fp64")
    with pytest.raises(ConfigError, match="fp64"):
        quantize(wide.module, "q8_0")
    with pytest.raises(ConfigError, match="takes fp32 or bf16 weights"):
        block_linear(nn.Linear(64, 8).double(), "q8_0")
    for bad in ("int5", "INT8", "Q8_0"):
        with pytest.raises(ConfigError, match=f"unknown quant '{bad}'"):
            mtpspec.load(m / "stories260K.bin", m / "tok512.bin", quant=bad)


@pytest.fixture(scope="module")
def demo_fp32():
    return mtpspec.load("demo")


@pytest.fixture(scope="module", params=[("fp32", "int8"), ("bf16", "q8_0"), ("bf16", "int4")], ids=lambda p: "-".join(p))
def demo_quant(request):
    dtype, kind = request.param
    return dtype, mtpspec.load("demo", dtype=dtype, quant=kind)


CODE = ['def mean(data):\n    """Return the sample arithmetic mean of data."""\n',
        "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n"]


def test_drafters_lossless_on_the_quantized_demo(demo_quant, demo_fp32):
    """The quantized model is the target: mtp (its own quantized MTP module), ngram, and the unquantized model as a
    draft model all give exactly its plain greedy tokens; bf16 in exact mode (a bf16 verify pass may round its
    attention differently from one-token steps; the block layers themselves are row-invariant)."""
    dtype, model = demo_quant
    exact = dtype == "bf16"
    for prompt in CODE[:1]:
        ref = model.generate(prompt, max_new_tokens=40, exact=exact).tokens
        for drafter, k, dm in (("mtp", 1, None), ("mtp", 3, None), ("ngram", 3, None), ("draft", 3, demo_fp32)):
            r = model.generate(prompt, drafter=drafter, k=k, draft_model=dm, max_new_tokens=40, exact=exact)
            assert r.tokens == ref, f"{drafter} k={k} differs from the quantized model's plain greedy"
            assert drafter == "ngram" or r.stats.accepted_tokens > 0


@pytest.mark.parametrize("dtype, kind", [("fp32", "int8"), ("bf16", "q8_0")])
def test_drafters_lossless_on_quantized_stories(assets, stories_q80, dtype, kind):
    m = assets / "models"
    target = mtpspec.load(m / "stories260K.bin", m / "tok512.bin", dtype=dtype, quant=kind)
    exact = dtype == "bf16"
    for prompt in tinystories_prompts(3):
        ref = target.generate(prompt, max_new_tokens=48, exact=exact).tokens
        for drafter, k in (("ngram", 4), ("draft", 3)):
            r = target.generate(prompt, drafter=drafter, k=k, draft_model=stories_q80 if drafter == "draft" else None,
                                max_new_tokens=48, exact=exact)
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
    (["--quant", "int5"], "unknown quant 'int5' (choose q8_0, q4_0, q5_0, q4_k, q5_k, q6_k, int8 (= q8_0), int4 (= q4_k), or none)"),
    (["--quant", "int8", "--dtype", "fp64"], "does not combine with fp64"),
    (["--quant", "int4", "--quant-group-size", "64"], "unrecognized arguments: --quant-group-size 64"),
])
def test_cli_errors(capsys, assets, extra, msg):
    m = assets / "models"
    rc, err = run(capsys, "generate", "hi", "--model", str(m / "stories260K.bin"), "--tokenizer", str(m / "tok512.bin"), *extra)
    assert rc == 2 and msg in err and "Traceback" not in err


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_cli_generate_quantized(capsys, assets, dtype):
    m = assets / "models"
    rc = main(["generate", "Once", "--model", str(m / "stories260K.bin"), "--tokenizer", str(m / "tok512.bin"), "--quant", "int8",
               "--dtype", dtype, "--max-new-tokens", "4", "--json"])
    assert rc == 0 and '"tokens"' in capsys.readouterr().out

"""Exact mode: a position's logits are bitwise the same whether computed in a plain step or inside a
verify pass of 2..D+1 positions, so speculation is token-identical to plain decoding in bf16 too."""

import pytest
import torch

import mtpspec
from mtpspec.prompts import tinystories_prompts
from exact_passes import logits_in_passes


@pytest.fixture(scope="module")
def bf16(assets):
    m = assets / "models"
    return (mtpspec.load(m / "stories260K.bin", m / "tok512.bin", dtype="bf16"),
            mtpspec.load(m / "stories260K_q80.bin", m / "tok512.bin", dtype="bf16"))




@pytest.mark.parametrize("dtype", ["bf16", "fp32", torch.float64], ids=["bf16", "fp32", "fp64"])
def test_verify_rows_bitwise_equal_plain_steps(assets, dtype):
    m = mtpspec.load(assets / "models" / "stories260K.bin", assets / "models" / "tok512.bin", dtype=dtype)
    ids = m.encode(tinystories_prompts(2)[1]) + m.generate(tinystories_prompts(2)[1], max_new_tokens=60).tokens
    module, p0 = m.module, 12

    def run(chunk: int) -> torch.Tensor:
        return logits_in_passes(module, torch.tensor(ids), p0, chunk)

    plain = run(1)
    for chunk in (2, 3, 5, 9):  # every row of a pass is computed alone: bitwise in every dtype
        assert torch.equal(run(chunk), plain), f"rows differ for passes of {chunk} positions"


PROMPTS = [""] + tinystories_prompts(3)


@pytest.mark.parametrize("prompts", [PROMPTS[:2], pytest.param(PROMPTS[2:], marks=pytest.mark.slow)], ids=["default", "more"])
def test_bf16_speculation_token_identical_in_exact_mode(bf16, prompts):
    """BOS alone and a story opening in the default suite; the other two prompts (another 9-25 s) in make test-slow."""
    target, draft = bf16
    for prompt in prompts:
        refs = {k: target.generate(prompt, k=k, exact=True, max_new_tokens=128).tokens for k in (4, 8)}  # plain, per width
        for drafter, k in (("ngram", 4), ("draft", 4), ("draft", 8)):
            got = target.generate(prompt, drafter=drafter, k=k, draft_model=draft if drafter == "draft" else None, exact=True, max_new_tokens=128).tokens
            assert got == refs[k], (prompt, drafter, k)

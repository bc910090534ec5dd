"""`mtpspec export`: a complete Hugging Face directory that transformers loads on its own
(AutoModelForCausalLM + AutoTokenizer) and that generates what `mtpspec generate` generates."""

from __future__ import annotations

import json
import random

import pytest
import torch

from mtpspec.cli import main
from mtpspec.export import FP64_TOL, check_export, export_hf, load_hf

FILES = {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
         "special_tokens_map.json"}


def _ours(capsys, prompt: str, model: list[str], n: int) -> dict:
    """`mtpspec generate --json` (greedy) as a dict: text, tokens, prompt_tokens, ..."""
    capsys.readouterr()
    assert main(["generate", prompt, *model, "--json", "--max-new-tokens", str(n)]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def _transformers(directory, prompt: str, n: int) -> tuple[list[int], list[int], str]:
    """(prompt ids, new ids, full decoded text) from transformers with nothing but the directory."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(directory))
    hf = AutoModelForCausalLM.from_pretrained(str(directory)).eval()
    enc = tok(prompt, return_tensors="pt")
    with torch.inference_mode():
        out = hf.generate(**enc, max_new_tokens=n)  # greedy: generation_config.json says do_sample false
    ids = out[0].tolist()
    plen = enc["input_ids"].shape[1]
    return ids[:plen], ids[plen:], tok.decode(ids, skip_special_tokens=True)


@torch.inference_mode()
def _min_margin(module, ids: list[int], new: list[int]) -> float:
    """Smallest top-1 minus top-2 logit gap over the greedy steps that chose `new` after `ids`."""
    logits = module.forward_tokens(torch.tensor(ids + new), module.new_cache()).logits[len(ids) - 1 :]  # (n+1, V)
    top = logits.topk(2, dim=-1).values  # (n+1, 2)
    return float((top[: len(new), 0] - top[: len(new), 1]).min())


def _same_greedy(capsys, directory, prompt, model_args, module, n) -> dict:
    """transformers on the export generates `mtpspec generate`'s greedy tokens and text.

    Greedy equality across two implementations holds for the right reason when every step's
    top-1 / top-2 gap is far above the logits' difference (measured <= 6e-6 for these two models;
    the gaps are >= 0.13); asserted first, so a near-tie would fail as such, not as a mismatch."""
    ours = _ours(capsys, prompt, model_args, n)
    ids, new, text = _transformers(directory, prompt, n)
    assert ids == ours["prompt_tokens"]
    assert _min_margin(module, ids, ours["tokens"]) > 1e-2
    assert new[: len(ours["tokens"])] == ours["tokens"] and len(new) - len(ours["tokens"]) <= 1  # + their stop token
    assert text == prompt + ours["text"]
    return ours


def test_llama2c_export_is_a_complete_hf_directory(tmp_path, assets, capsys):
    """stories260K + tok512: AutoTokenizer + AutoModelForCausalLM from the directory alone generate
    `mtpspec generate`'s greedy tokens and text; our loader reads the directory back the same."""
    import mtpspec

    m = assets / "models"
    src = ["--model", str(m / "stories260K.bin"), "--tokenizer", str(m / "tok512.bin")]
    out = tmp_path / "hf"
    assert main(["export", *src, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "FAILED" not in printed and printed.count(": ok") == 2, printed
    assert FILES <= {p.name for p in out.iterdir()}
    tcfg = json.loads((out / "tokenizer_config.json").read_text())
    assert (tcfg["bos_token"], tcfg["eos_token"], tcfg["add_bos_token"], tcfg["model_max_length"]) == ("<s>", "</s>", True, 512)
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [2, 1] and gen["do_sample"] is False  # run.c stops at BOS too

    model = mtpspec.load(m / "stories260K.bin", tokenizer=m / "tok512.bin")
    back = mtpspec.load(out)
    for prompt in ["", "Lily and Tom went to the park. They saw a big"]:  # BOS alone, and a prompt
        ours = _same_greedy(capsys, out, prompt, src, model.module, 40)
        streamed: list[str] = []
        res = back.generate(prompt, max_new_tokens=40, on_text=streamed.append)
        assert res.tokens == ours["tokens"] and res.text == ours["text"] == "".join(streamed)


def test_hybrid_export_is_a_complete_hf_directory(tmp_path, capsys):
    """The demo model (Qwen3.5-style hybrid, byte-level BPE): the same through transformers'
    Qwen3_5ForCausalLM; the mtp.* tensors are written under the names vLLM loads, and our loader
    reads them back as the MTP module (its drafts are still lossless)."""
    import mtpspec
    from safetensors import safe_open

    out = tmp_path / "hf"
    assert main(["export", "demo", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "FAILED" not in printed and printed.count(": ok") == 2, printed
    assert FILES <= {p.name for p in out.iterdir()}
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3_5ForCausalLM"] and cfg["mtp_num_hidden_layers"] == 1
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert {"mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight",
            "mtp.layers.0.self_attn.q_proj.weight", "mtp.layers.0.mlp.down_proj.weight"} <= names
    tcfg = json.loads((out / "tokenizer_config.json").read_text())
    assert (tcfg["bos_token"], tcfg["eos_token"], tcfg["add_bos_token"]) == ("<|endoftext|>", "<|endoftext|>", True)

    demo = mtpspec.load("demo")
    prompt = "def parse_args(argv):\n"
    ours = _same_greedy(capsys, out, prompt, ["--model", "demo"], demo.module, 16)
    back = mtpspec.load(out)
    assert back.module.mtp is not None
    sd = back.module.state_dict()
    assert all(torch.equal(v, sd[k]) for k, v in demo.module.state_dict().items())
    res = back.generate(prompt, max_new_tokens=16, drafter="mtp", k=2)
    assert res.tokens == ours["tokens"] and res.text == ours["text"]


def test_llama2c_tokenizer_as_hf_encodes_and_decodes_like_ours(assets):
    """The `tokenizers` BPE built from tok512.bin gives run.c's ids and text: TinyStories prompts,
    random slices, random pieces glued together (merge-order ties), leading / repeated spaces,
    non-ASCII and byte-fallback characters (emoji, CJK, control characters), the empty string."""
    from mtpspec.loading.tokenizer_llama2c import BOS, Llama2cTokenizer

    ours = Llama2cTokenizer.load(assets / "models" / "tok512.bin")
    hf = ours.to_hf()
    rng = random.Random(0)
    stories = (assets / "prompts" / "tinystories_val_prefix.txt").read_text().split("\n")
    pieces = [p.decode() for p in ours.pieces[3:] if not p.startswith(b"<0x")]
    chars = list("abcdeThLS .,!?'\"\n\t") + ["  ", "é", "ñ", "日本", "😀", "\x00", "€", "\u200b", "—"]
    texts = stories[:300] + ["", " ", "  x", "Once upon a time", " leading space", "trailing  "]
    for _ in range(3000):
        texts.append("".join(rng.choice(pieces) for _ in range(rng.randrange(10))))
        texts.append("".join(rng.choice(chars) for _ in range(rng.randrange(30))))
        texts.append("".join(chr(rng.randrange(1, 0x2FFFF)) for _ in range(rng.randrange(6))).replace("\u2581", ""))
        s = rng.choice(stories)
        a = rng.randrange(len(s) + 1)
        texts.append(s[a : a + rng.randrange(120)])
    for text in texts:
        if any(0xD800 <= ord(c) < 0xE000 for c in text):
            continue  # lone surrogates are not text
        ids = ours.encode(text)
        assert hf.encode(text).ids == ids, text
        assert hf.decode(ids, skip_special_tokens=True) == ours.decode(ids[1:], prev=BOS), text


def test_chat_template_and_specials_are_carried(tmp_path, assets):
    """An HF tokenizer's chat template (tokenizer_config.json) is written with it, and transformers applies it."""
    from transformers import AutoTokenizer

    from mtpspec.export import write_tokenizer
    from mtpspec.loading import shipped_demo_dir
    from mtpspec.loading.tokenizer_hf import HFTokenizer

    src = tmp_path / "src"
    src.mkdir()
    (src / "tokenizer.json").write_bytes((shipped_demo_dir() / "tokenizer.json").read_bytes())
    template = "{% for m in messages %}<|endoftext|>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    (src / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, "eos_token": "<|endoftext|>"}))
    tok = HFTokenizer.load(src / "tokenizer.json")
    out = tmp_path / "out"
    out.mkdir()
    cfg = write_tokenizer(tok, out, 1024)
    assert cfg["chat_template"] == template and cfg["model_max_length"] == 1024
    hf = AutoTokenizer.from_pretrained(str(out))
    text = hf.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert text == "<|endoftext|>user: hi\n"
    assert hf("x = 1")["input_ids"] == tok.encode("x = 1")


@pytest.mark.parametrize("name", ["stories260K.bin", "stories260K_q80.bin"])
def test_export_round_trip_logits_equal(tmp_path, assets, name):
    import mtpspec

    model = mtpspec.load(assets / "models" / name, tokenizer=assets / "models" / "tok512.bin")
    d = export_hf(model.module, tmp_path / "hf")
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["tie_word_embeddings"] is True
    assert cfg["max_position_embeddings"] == 512 and cfg["rms_norm_eps"] == 1e-5
    assert cfg["rope_parameters"]["rope_theta"] == 10000.0
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (1, 2)
    ids = model.encode("Once upon a time, there was a little dog named Max. He liked to run in the park.")
    chk = check_export(model.module, d, ids, hf_model=load_hf(d))
    assert chk.ok and chk.fp64_rel_diff is not None and chk.fp64_rel_diff <= FP64_TOL, chk  # fp64: transformers' function


def _tiny_hybrid(tie: bool):
    """A tiny random Qwen3.5-style HybridLM of ours (with an MTP module), weights well away from init."""
    from mtpspec.models.qwen35 import HybridConfig, HybridLM
    from qwen35_tiny import randomize

    cfg = HybridConfig(
        vocab_size=96, hidden_size=32, num_layers=4, layer_types=("linear_attention",) * 3 + ("full_attention",),
        num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=48, max_seq_len=256, rope_theta=10000.0,
        tie_embeddings=tie, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
        linear_num_value_heads=4, mtp_num_layers=1,
    )
    torch.manual_seed(0)
    model = HybridLM(cfg)
    randomize(model, seed=3)
    if tie:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval()


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_export_hybrid_as_qwen35_logits_equal(tmp_path, tie):
    """A HybridLM exports as transformers' Qwen3_5ForCausalLM with our logits and greedy tokens; our
    loader reads the folder back, MTP module included.

    40 tokens: chunked Gated DeltaNet on both sides. These random weights make fp32 ill-conditioned
    at two positions (ours and transformers' both differ there by ~5e-5 from the fp64 logits, the
    logits' scale being 3.6): the check's fp32 tolerance follows the function's sensitivity there.
    In fp64 (transformers' fp32 casts made fp64) the two agree to ~1e-15 of the scale."""
    from mtpspec.loading import load_checkpoint

    model = _tiny_hybrid(tie)
    d = export_hf(model, tmp_path / "hf", bos_id=None, eos_id=0)
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_5_text" and cfg["architectures"] == ["Qwen3_5ForCausalLM"]
    assert cfg["rope_parameters"]["partial_rotary_factor"] == 0.25 and cfg["tie_word_embeddings"] is tie
    hf = load_hf(d)
    assert type(hf).__name__ == "Qwen3_5ForCausalLM"
    ids = torch.randint(1, 96, (40,), generator=torch.Generator().manual_seed(1)).tolist()  # > 16: chunked DeltaNet
    chk = check_export(model, d, ids, hf_model=hf)
    assert chk.ok and chk.fp64_rel_diff is not None and chk.fp64_rel_diff <= FP64_TOL, chk  # fp64: transformers' function
    from mtpspec.drafters import NoDrafter
    from mtpspec.engine import generate_tokens
    from mtpspec.sampling import Sampler, SamplingParams

    ours = generate_tokens(model, ids[:12], NoDrafter(), 1, Sampler(SamplingParams()), 16).tokens
    assert _min_margin(model, ids[:12], ours) > 1e-3  # far above the logits' difference: equality is not luck
    with torch.inference_mode():
        theirs = hf.generate(torch.tensor([ids[:12]]), max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert theirs[0, 12:].tolist() == ours
    back, _ = load_checkpoint(d, dtype="fp32", with_tokenizer=False)
    assert back.mtp is not None
    assert all(torch.equal(v, back.state_dict()[k]) for k, v in model.state_dict().items())


def test_export_check_fails_on_a_real_difference(tmp_path):
    """The check is not loose: a norm eps of 1e-5 instead of 1e-6 in the written config.json (a real
    difference in the function) fails it, in fp32 and in fp64."""
    model = _tiny_hybrid(False)
    d = export_hf(model, tmp_path / "hf", bos_id=None, eos_id=0)
    cfg = json.loads((d / "config.json").read_text())
    cfg["rms_norm_eps"] = 1e-5
    (d / "config.json").write_text(json.dumps(cfg))
    ids = torch.randint(1, 96, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    chk = check_export(model, d, ids)
    assert not chk.ok and chk.worst_ratio > 1 and chk.fp64_rel_diff > FP64_TOL, chk


def test_export_check_fails_on_bf16_weights(tmp_path):
    """An fp32-path slip (the written weights rounded to bf16) fails the fp32 check even at these
    ill-conditioned tokens: its tolerance follows the function's sensitivity, not either run's error."""
    from safetensors.torch import load_file, save_file

    model = _tiny_hybrid(False)
    d = export_hf(model, tmp_path / "hf", bos_id=None, eos_id=0)
    sd = {k: v.to(torch.bfloat16).float() for k, v in load_file(str(d / "model.safetensors")).items()}
    save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})
    ids = torch.randint(1, 96, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    chk = check_export(model, d, ids, fp64=False)
    assert not chk.ok and chk.worst_ratio > 10, chk


def test_export_mixture_of_experts_as_qwen3_next(tmp_path):
    """A hybrid with a mixture of experts (and an MTP module with experts) exports as transformers'
    Qwen3NextForCausalLM: in_proj_qkvz / in_proj_ba fused back per key head, experts under their
    per-expert names; fp64 logits equal transformers' to ~1e-15, and our loader reads it back
    (splitting the fused projections) to the same tensors."""
    from mtpspec.loading import load_checkpoint
    from mtpspec.models.qwen35 import HybridConfig, HybridLM
    from qwen35_tiny import randomize

    cfg = HybridConfig(
        vocab_size=96, hidden_size=32, num_layers=4, layer_types=("linear_attention",) * 3 + ("full_attention",),
        num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=48, max_seq_len=256, rope_theta=10000.0,
        linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
        mtp_num_layers=1, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        shared_expert_intermediate_size=24, mlp_only_layers=(1,),
    )
    torch.manual_seed(0)
    model = HybridLM(cfg)
    randomize(model, seed=5)
    model.eval()
    d = export_hf(model, tmp_path / "hf", bos_id=None, eos_id=0)
    hf = load_hf(d)
    assert type(hf).__name__ == "Qwen3NextForCausalLM"
    ids = torch.randint(1, 96, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    chk = check_export(model, d, ids, hf_model=hf)
    assert chk.ok and chk.fp64_rel_diff is not None and chk.fp64_rel_diff <= FP64_TOL, chk
    back, _ = load_checkpoint(d, dtype="fp32", with_tokenizer=False)
    assert back.mtp is not None
    sd = back.state_dict()
    assert all(torch.equal(v, sd[k]) for k, v in model.state_dict().items())


def test_export_check_fp64_reference_is_fp64_throughout(tmp_path):
    """check_export's fp64 reference (transformers' twin from the written directory, mtpspec.hf_reference)
    takes no float32 step: not in its forward, not in its rotary tables (which transformers' weight
    initialisation would otherwise recompute in fp32 after loading)."""
    from mtpspec.hf_reference import float32_ops, load_hf_fp64

    d = export_hf(_tiny_hybrid(False), tmp_path / "hf", bos_id=None, eos_id=0)
    hf64 = load_hf_fp64(d)
    ids = torch.randint(1, 96, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        assert hf64(ids).logits.dtype == torch.float64 and float32_ops(hf64, ids) == []
        assert float32_ops(load_hf(d), ids) != []  # transformers' own fp32 model in the same process: still fp32
    rotary = [m for m in hf64.modules() if hasattr(m, "original_inv_freq")]
    assert rotary and all(torch.equal(m.inv_freq, type(m)(config=m.config).inv_freq) for m in rotary)


@pytest.mark.parametrize("kind", ["llama3", "llama-linear"])
def test_export_rope_scaled_llama_checks_in_fp64(tmp_path, kind):
    """A Llama with scaled rope (Llama 3.x, linear) exports and passes the check in fp64: the twin's
    scaled rotary tables are computed in fp64 too. Measured 7e-16 / 5e-16 of the logits' scale; with
    the tables left in fp32 (transformers' rope-scaling functions) it was 7e-10 / 1.6e-9 (linear failed)."""
    from mtpspec.loading import load_checkpoint
    from qwen35_tiny import save_hf

    save_hf(kind, tmp_path / "src", mtp=False)
    ours, tok = load_checkpoint(tmp_path / "src", dtype="fp32")
    d = export_hf(ours, tmp_path / "hf", tokenizer=tok)
    assert json.loads((d / "config.json").read_text())["rope_parameters"]["rope_type"] != "default"
    ids = torch.randint(0, 96, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    chk = check_export(ours, d, ids)
    assert chk.ok and chk.fp64_rel_diff is not None and chk.fp64_rel_diff <= FP64_TOL, chk

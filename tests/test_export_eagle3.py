"""`mtpspec export HEAD --target MODEL`: an EAGLE-3 head as vLLM / SGLang load it (HF directory) and as llama.cpp does
(GGUF arch eagle3); both read back by our own loader, drafting as the head they came from.

The names and keys checked here are the loaders': vLLM's model_executor/models/llama_eagle3.py
(Eagle3LlamaForCausalLM.load_weights) and v1/worker/gpu/spec_decode/eagle/eagle3_utils.py
(get_eagle3_aux_layers_from_config), SGLang's srt/models/llama_eagle3.py (LlamaForCausalLMEagle3.load_weights) and
srt/models/llama.py (set_eagle3_layers_to_capture), llama.cpp's src/models/eagle3.cpp and conversion/llama.py."""

from __future__ import annotations

import json

import pytest
import torch

from mtpspec.cli import main
from mtpspec.export_eagle3 import eagle3_gguf_tensors
from mtpspec.models.eagle3_io import read_head
from mtpspec.models.heads import DraftHead, load_head, save_head
from mtpspec.train.heads import HeadConfig, head_config, init_eagle3

VLLM_SGLANG_NAMES = {  # every tensor an exported head holds, as both loaders name them
    "fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d",
    *(f"midlayer.{n}.weight" for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm", "self_attn.q_proj",
                                       "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                                       "mlp.up_proj", "mlp.down_proj")),
}


@pytest.fixture(scope="module")
def head_dir(stories, tmp_path_factory):
    """An eagle3 head for stories260K (5 layers; features: the inputs of layers 1, 2 and 4) with a draft vocabulary of
    256 tokens, its weights random, its LM head the target's rows."""
    torch.manual_seed(0)
    m = stories.module
    head = DraftHead(head_config(m, HeadConfig(out="", kind="eagle3", draft_vocab=256, num_heads=4, num_kv_heads=2,
                                                aux_layers="1,2,4")))
    init_eagle3(head, m, [(torch.arange(m.vocab_size).flip(0), None)], 256)
    for p in head.parameters():  # norms away from 1, so a norm read in the wrong place shows
        with torch.no_grad():
            p.add_(0.05 * torch.randn_like(p))
    return save_head(head, tmp_path_factory.mktemp("e3") / "head")


def _drafts(stories, head, prompt="Once upon a time"):
    return [s.draft for s in stories.generate(prompt, drafter="eagle3", k=3, draft_model=head, max_new_tokens=24).steps]


def test_hf_directory_is_what_vllm_and_sglang_load(stories, head_dir, tmp_path):
    out = tmp_path / "hf"
    assert main(["export", str(head_dir), "--target", str(stories_path(stories)[0]), "--tokenizer",
                 str(stories_path(stories)[1]), "--out", str(out)]) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["num_hidden_layers"] == 1
    assert cfg["draft_vocab_size"] == 256 and cfg["vocab_size"] == 512 and cfg["target_hidden_size"] == 64
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [1, 2, 4]  # layer inputs (vLLM, llama.cpp's converter)
    assert cfg["eagle_config"] == {"use_aux_hidden_state": True, "eagle_aux_hidden_state_layer_ids": [0, 1, 3]}  # SGLang
    assert cfg["tie_word_embeddings"] is False and cfg["norm_before_residual"] is False
    from safetensors.torch import load_file

    sd = load_file(str(out / "model.safetensors"))
    assert set(sd) == VLLM_SGLANG_NAMES
    assert sd["fc.weight"].shape == (64, 192) and sd["midlayer.self_attn.q_proj.weight"].shape == (64, 128)
    assert sd["d2t"].dtype == torch.int64 and sd["t2d"].dtype == torch.bool and int(sd["t2d"].sum()) == 256
    target_ids = torch.arange(256) + sd["d2t"]  # vLLM's compute_logits / SGLang's hot token ids
    assert torch.equal(sd["t2d"].nonzero()[:, 0], target_ids)
    back = read_head(out)  # our loader reads the directory back
    orig = load_head(head_dir)
    for (n1, a), (n2, b) in zip(orig.state_dict().items(), back.state_dict().items()):
        assert n1 == n2 and torch.equal(a, b), n1
    assert back.config == orig.config
    assert _drafts(stories, str(out)) == _drafts(stories, str(head_dir))


def stories_path(stories):
    from mtpspec.loading import assets_dir

    m = assets_dir() / "models"
    return m / "stories260K.bin", m / "tok512.bin"


def test_gguf_has_llamacpps_keys_and_reads_back(stories, head_dir, tmp_path):
    import gguf

    out = tmp_path / "e3.gguf"
    model, tok = stories_path(stories)
    assert main(["export", str(head_dir), "--target", str(model), "--tokenizer", str(tok), "--format", "gguf", "--out", str(out)]) == 0
    r = gguf.GGUFReader(str(out))
    assert bytes(r.fields["general.architecture"].parts[-1]).decode() == "eagle3"
    f = r.fields["eagle3.target_layers"]
    assert [int(f.parts[i][0]) for i in f.data] == [1, 2, 4]
    assert int(r.fields["eagle3.target_hidden_size"].parts[-1][0]) == 64
    assert bool(r.fields["eagle3.norm_before_residual"].parts[-1][0]) is False
    assert "tokenizer.ggml.tokens" in r.fields  # llama.cpp compares the draft's vocabulary with the target's
    ts = {t.name: t for t in r.tensors}
    assert "token_embd.weight" not in ts and {"fc.weight", "blk.0.attn_norm_2.weight", "output.weight", "d2t"} <= set(ts)
    assert list(ts["fc.weight"].shape) == [192, 64] and list(ts["output.weight"].shape) == [64, 256]  # ggml's ne
    orig = load_head(head_dir)
    assert ts["d2t"].tensor_type == gguf.GGMLQuantizationType.I64
    assert torch.equal(torch.from_numpy(ts["d2t"].data.copy()), orig.mtp.ids)  # absolute target ids
    q = dict(eagle3_gguf_tensors(orig))["blk.0.attn_q.weight"]
    assert not torch.equal(q, orig.mtp.layers[0].self_attn.q_proj.weight)  # permuted to adjacent-pair rope
    back = read_head(out)
    for (n1, a), (n2, b) in zip(orig.state_dict().items(), back.state_dict().items()):
        assert n1 == n2 and torch.equal(a, b), n1
    assert _drafts(stories, str(out)) == _drafts(stories, str(head_dir))


def test_cli_errors(stories, head_dir, tmp_path, capsys):
    model, tok = stories_path(stories)
    assert main(["export", str(head_dir), "--out", str(tmp_path / "x")]) == 2
    assert "--target" in capsys.readouterr().err
    assert main(["export", str(model), "--tokenizer", str(tok), "--target", str(model), "--out", str(tmp_path / "y")]) == 2
    assert "not a head folder" in capsys.readouterr().err
    torch.manual_seed(0)
    mtp = save_head(DraftHead(head_config(stories.module, HeadConfig(out="", kind="mtp"))), tmp_path / "mtp")
    assert main(["export", str(mtp), "--target", str(model), "--tokenizer", str(tok), "--out", str(tmp_path / "z")]) == 2
    assert "writes eagle3 heads" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------
# llama.cpp itself (slow; skipped without its binaries): `--spec-type draft-eagle3` on the demo (a qwen35 target, whose
# graph exposes its layer inputs: llama.cpp's t_layer_inp, set by llama / qwen3 / qwen35 / ... but not by gemma3)

EAGLE3_DEMO = dict(kind="eagle3", prompts="stdlib", train_prompts=48, heldout_prompts=8, gen_tokens=96, gen_batch=8, depth=3,
                   steps=150, batch_size=16, seq_len=96, draft_vocab=1024, eval_prompts=0)


@pytest.mark.slow
def test_llamacpp_drafts_with_the_eagle3_head(tmp_path):
    """A small eagle3 head trained on the demo, exported as GGUF next to the demo's GGUF: llama-server drafts with it
    (`-md HEAD.gguf --spec-type draft-eagle3`, 3 drafts a step, no early stop) and its greedy tokens are ours; its
    drafts are accepted as often as ours at D = 3 on the same prompts (exact-match acceptance of the same function: a
    slip in the features, the layer, the rope or d2t would leave next to nothing accepted)."""
    import mtpspec
    from mtpspec.bench.llamacpp import LlamaServer, Method, parse_completion, request_body, server_args
    from mtpspec.export_eagle3 import export_eagle3_gguf
    from mtpspec.export_gguf import export_gguf
    from mtpspec.train.data import code_prompts, stdlib_files
    from mtpspec.train.heads import train_head
    from test_export_gguf import GREEDY_PROMPTS, _llama_server

    exe = _llama_server()
    demo = mtpspec.load("demo")
    train_head("demo", HeadConfig(out=str(tmp_path / "head"), **EAGLE3_DEMO), progress_bar=False)
    head = load_head(tmp_path / "head")
    target_gguf = export_gguf(demo.module, demo.tokenizer, tmp_path / "demo.gguf")
    head_gguf = export_eagle3_gguf(head, demo.tokenizer, tmp_path / "eagle3.gguf").path
    spec = ["-md", str(head_gguf), "--spec-type", "draft-eagle3", "--spec-draft-n-max", "3", "--spec-draft-p-min", "0"]
    n, ours_d = 64, [0, 0]
    theirs_d = [0, 0]
    with LlamaServer(lambda port: server_args(exe, target_gguf, Method("llamacpp", "none", None), threads=1, ctx_size=1024,
                                              port=port) + spec) as server:
        for prompt in GREEDY_PROMPTS["demo"] + code_prompts(stdlib_files()[1], 3):  # (the second: held out of its training)
            ids = demo.encode(prompt)
            r = demo.generate(ids, drafter="eagle3", k=3, draft_model=head, max_new_tokens=n)
            assert r.tokens == demo.generate(ids, max_new_tokens=n).tokens
            answer = parse_completion(server.post("/completion", request_body(ids, n)))
            theirs = answer.tokens[:-1] if len(answer.tokens) == n + 1 else answer.tokens
            assert theirs == r.tokens, prompt
            ours_d[0] += r.stats.draft_tokens
            ours_d[1] += r.stats.accepted_tokens
            theirs_d[0] += int(answer.draft_n or 0)
            theirs_d[1] += int(answer.draft_n_accepted or 0)
    print(f"eagle3 on the demo, D = 3: ours {ours_d[1]} of {ours_d[0]} drafts accepted, llama.cpp {theirs_d[1]} of {theirs_d[0]}")
    assert theirs_d[0] > 0 and ours_d[1] > 0.2 * ours_d[0]
    assert abs(theirs_d[1] / theirs_d[0] - ours_d[1] / ours_d[0]) < 0.05

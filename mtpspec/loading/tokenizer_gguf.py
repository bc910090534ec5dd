"""The tokenizer a GGUF file describes (`tokenizer.ggml.*` keys), as a `tokenizers.Tokenizer` in an HFTokenizer.

Gemma's SentencePiece vocabularies run on SentencePiece's BPE over compact arrays instead (tokenizer_spm.py and
tokenizer_bpe.py: the same ids in about 7 MB); this builder stays for the others, where a check of those fails, and for
that tokenizer's `.tokenizer`.
Built as transformers 5.24's GGUF converter builds it, so the ids are those of
`AutoTokenizer.from_pretrained(dir, gguf_file=...)`:

- "llama" (SentencePiece-style BPE with byte fallback), Gemma: whitespace-only tokens containing a space are
  respelled as that many U+2581; merges derived from the vocabulary (every split of a token into two), best first
  by file position (Gemma's scores do not follow its merge order); " " -> U+2581, no prefix space.
- "llama", other architectures: merges derived by score, a Metaspace pre-tokenizer prepending U+2581 to the first
  word, a decoder that strips that one leading space.
- "gpt2" (byte-level BPE): GPT-2's byte alphabet, the file's merges, ByteLevel (or `tokenizer.ggml.pre`'s regex).
- Control tokens (type 3) and BOS / EOS / UNK / PAD are special added tokens, user-defined ones (type 4) plain
  added tokens; BOS / EOS added per `add_bos_token` / `add_eos_token` ("llama" without the flag: BOS, as llama.cpp).
- Chat template: `tokenizer.chat_template`; a gemma3 file without one gets Gemma's turn format, and
  `<end_of_turn>` stops generation as EOS does.
"""

from __future__ import annotations

import gc
import os
from pathlib import Path

import numpy as np

from ..errors import ModelLoadError
from .gguf import GGUFFile, read_gguf
from .tokenizer_hf import HFTokenizer
from .tokenizer_spm import GEMMA_ARCHS, load_spm_tokenizer

CONTROL, USER_DEFINED = 3, 4  # llama.cpp's token types

_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre -> the split regex its merges were learned with (as transformers' converter maps them)
PRE_SPLITS = {name: _LLAMA3_SPLIT for name in ("llama3", "llama-v3", "llama-bpe", "falcon3", "dbrx", "smaug-bpe")}
PRE_SPLITS.update({name: _QWEN2_SPLIT for name in ("qwen2", "deepseek-r1-qwen", "megrez")})


def load_gguf_tokenizer(source: str | Path | GGUFFile) -> HFTokenizer:
    """The file's tokenizer with the HFTokenizer interface (encode / decode / stream / stop_ids / chat_template)."""
    f = source if isinstance(source, GGUFFile) else read_gguf(source)
    out = load_spm_tokenizer(f, lambda path=f.path: build_tokenizer(read_gguf(path)))  # Gemma's vocabulary: CompactBPE, a tenth the memory
    tok = None if out is not None else build_tokenizer(f)
    md = f.metadata
    eos = md.get("tokenizer.ggml.eos_token_id")
    stop = () if eos is None else (int(eos),)
    template = md.get("tokenizer.chat_template")
    template = template if isinstance(template, str) else None
    end_turn = out.token_id("<end_of_turn>") if out is not None else tok.token_to_id("<end_of_turn>")
    if f.architecture == "gemma3" and end_turn is not None:  # a turn ends generation as EOS does (llama.cpp: EOG tokens)
        stop = tuple(dict.fromkeys((*stop, end_turn)))
        if template is None:  # files converted without it (Gemma 3 270M): Gemma's turn format, as llama.cpp falls back to
            template = GEMMA_CHAT_TEMPLATE
    if out is None:
        out = HFTokenizer(tok, stop)
    out.stop_ids = stop
    out.chat_template = template
    return out


# Gemma's chat format: a system message opens the first user turn; the assistant's role is "model"
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set system = messages[0]['content'] | trim ~ '\\n\\n' -%}{%- set rest = messages[1:] -%}"
    "{%- else -%}{%- set system = '' -%}{%- set rest = messages -%}{%- endif -%}"
    "{%- for message in rest -%}"
    "{{ '<start_of_turn>' ~ ('model' if message['role'] == 'assistant' else message['role']) ~ '\\n' }}"
    "{{ (system if loop.first else '') ~ message['content'] | trim }}{{ '<end_of_turn>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
)


def build_tokenizer(f: GGUFFile):
    """A `tokenizers.Tokenizer` from the file's `tokenizer.ggml.*` metadata (strict: bad metadata names its key).

    Deriving a large vocabulary's merges takes seconds (Gemma's 262k tokens: about 9), so they are kept under the model
    cache, keyed by the metadata they were built from and the builder's versions: as token-id pairs (Gemma's 515k
    merges: 4 MB), the tokenizer built from them and the file's vocabulary. A tokenizer built from Python objects holds
    less memory than one read from its tokenizer.json (Gemma's: 79 MB against 101) and serializes the same."""
    cached = _cache_path(f)
    merges = _read_merges(cached, f) if cached is not None else None
    gc_was = gc.isenabled()
    gc.disable()  # a million new tuples would run the cyclic collector over the whole heap again and again
    try:
        tok, built = _checked_build(f, merges)
    finally:
        if gc_was:
            gc.enable()
    if cached is not None and merges is None and built is not None:
        try:
            cached.parent.mkdir(parents=True, exist_ok=True)
            tmp = cached.with_name(f".{cached.name}.{os.getpid()}.tmp")
            with open(tmp, "wb") as fh:
                np.save(fh, built)
            os.replace(tmp, cached)  # readers see no file or a whole one
        except OSError:
            pass  # a read-only cache: derived again next time
    return tok


def _read_merges(path: Path, f: GGUFFile) -> np.ndarray | None:
    """The cached merges (M, 2) int32 token ids, None when absent or damaged (then rebuilt)."""
    if not path.exists():
        return None
    tokens = f.metadata.get("tokenizer.ggml.tokens")
    n = len(tokens) if isinstance(tokens, list) else 0
    try:
        ids = np.load(path, allow_pickle=False)
        if ids.dtype == np.int32 and ids.ndim == 2 and ids.shape[1] == 2 and (ids.size == 0 or (ids.min() >= 0 and ids.max() < n)):
            return ids
    except (OSError, ValueError, EOFError):
        pass
    path.unlink(missing_ok=True)
    return None


def _cache_path(f: GGUFFile) -> Path | None:
    import tokenizers

    return _cache_entry(f, f"{tokenizers.__version__} {BUILDER_VERSION}", "merges.npy")


def _cache_entry(f: GGUFFile, versions: str, suffix: str) -> Path:
    """A cache file named by the builder's `versions`, the architecture and the file's tokenizer metadata."""
    import hashlib

    from .realmodels import model_cache_dir

    md = f.metadata
    h = hashlib.sha256(f"{versions} {f.architecture}".encode())
    for key in sorted(k for k in md if k.startswith("tokenizer.ggml.")):
        v = md[key]
        h.update(key.encode())
        h.update(v.tobytes() if hasattr(v, "tobytes") else "\x00".join(map(str, v)).encode() if isinstance(v, list) else repr(v).encode())
    return model_cache_dir() / "tokenizers" / f"{h.hexdigest()[:24]}.{suffix}"


BUILDER_VERSION = 2  # bump when _build changes the merges it makes: merges cached by older builds are then not read


def _checked_build(f: GGUFFile, merges: np.ndarray | None):
    try:
        return _build(f, merges)
    except ModelLoadError:
        raise
    except Exception as e:  # noqa: BLE001 - the tokenizers library's errors on inconsistent metadata
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise f.error(f"the tokenizer metadata does not form a tokenizer ({first})") from None


def _build(f: GGUFFile, merge_ids: np.ndarray | None = None):
    """(the tokenizer, its merges as token-id pairs (M, 2) int32 to cache, or None when not expressible so); merge_ids:
    the cached pairs, used in place of the file's or derived merges."""
    from tokenizers import AddedToken, Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE

    md = f.metadata
    kind = md.get("tokenizer.ggml.model")
    if kind is None:
        raise f.error("missing key tokenizer.ggml.model (the file has no tokenizer)")
    tokens = md.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens:
        raise f.error("missing or empty key tokenizer.ggml.tokens")
    n = len(tokens)
    types = md.get("tokenizer.ggml.token_type")
    if types is not None and (not hasattr(types, "dtype") or types.dtype.kind not in "iu" or len(types) != n):
        raise f.error(f"tokenizer.ggml.token_type is not one integer per token ({n} tokens)")
    special = {}
    for key in ("bos", "eos", "unknown", "padding"):
        v = md.get(f"tokenizer.ggml.{key}_token_id")
        if v is not None:
            if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < n:
                raise f.error(f"tokenizer.ggml.{key}_token_id is {v!r}, not a token id below {n}")
            special[key] = v
    arch = f.architecture
    letters = None  # the byte-level alphabet (gpt2): a control token spelled outside it is not a real token

    if kind == "llama":
        gemma = arch in GEMMA_ARCHS
        if gemma:
            tokens = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]
        else:
            scores = md.get("tokenizer.ggml.scores")
            if scores is None or len(scores) != n:
                raise f.error("tokenizer.ggml.scores is missing or not one per token")
        vocab = {t: i for i, t in enumerate(tokens)}
        if merge_ids is not None:
            merges = _named(merge_ids, tokens)
        elif "tokenizer.ggml.merges" in md:
            merges = _file_merges(f)
        else:
            rank = {t: -i for i, t in enumerate(tokens)} if gemma else dict(zip(tokens, (float(s) for s in scores)))
            merges = derive_merges(vocab, rank)  # gemma: file order, best first
        unk = "<unk>" if gemma else None  # GemmaTokenizer names one; LlamaTokenizer relies on byte fallback
        tok = Tokenizer(BPE(vocab=vocab, merges=merges, fuse_unk=True, unk_token=unk, byte_fallback=True, dropout=None))
        if gemma:
            tok.normalizer = normalizers.Replace(" ", "\u2581")
            tok.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous", invert=False)
            tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
        else:
            tok.normalizer = None
            tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
            tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                             decoders.Strip(content=" ", left=1)])
        add_bos_default = True  # llama.cpp adds BOS to a SentencePiece vocabulary that does not say otherwise
    elif kind == "gpt2":
        from tokenizers import Regex

        alphabet = _byte_alphabet()
        letters = set(alphabet.values())
        spelled = [t if set(t) <= letters else "".join(alphabet[b] for b in t.encode("utf-8")) for t in tokens]
        vocab = {t: i for i, t in enumerate(spelled)}
        if "tokenizer.ggml.merges" not in md:
            raise f.error("missing key tokenizer.ggml.merges (a gpt2 tokenizer needs its merges)")
        merges = _named(merge_ids, spelled) if merge_ids is not None else _file_merges(f)
        tok = Tokenizer(BPE(vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="",
                            end_of_word_suffix="", fuse_unk=False))
        split = PRE_SPLITS.get(md.get("tokenizer.ggml.pre"))
        if split is None:
            tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        else:
            tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                                         pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        tok.decoder = decoders.ByteLevel()
        add_bos_default = False
    else:
        raise f.error(f"tokenizer.ggml.model '{kind}' is not supported (llama, gpt2)")

    if types is not None:
        names = md["tokenizer.ggml.tokens"]
        control = [AddedToken(names[i], normalized=False, special=True) for i in np.flatnonzero(types == CONTROL).tolist()
                   if letters is None or set(names[i]) <= letters]  # byte-level: llama.cpp mislabels
        if control:
            tok.add_special_tokens(control)
        have = {c.content for c in control}  # with the model's vocabulary: every token the tokenizer knows
        user = [AddedToken(names[i], normalized=False, special=False) for i in np.flatnonzero(types == USER_DEFINED).tolist()
                if names[i] in vocab or names[i] in have]
        if user:
            tok.add_tokens(user)
    # the named special tokens (BOS, EOS, UNK, PAD) are special added tokens too, as transformers adds them
    have = {t.content for t in tok.get_added_tokens_decoder().values()}
    named = [md["tokenizer.ggml.tokens"][i] for i in special.values()]
    named = [AddedToken(t, normalized=False, special=True) for t in dict.fromkeys(named) if t not in have]
    if named:
        tok.add_special_tokens(named)
    _set_post_processor(f, tok, special, tokens, add_bos_default)
    return tok, _merge_ids(merges, vocab) if merge_ids is None else None


def _named(ids: np.ndarray, tokens: list[str]) -> list[tuple[str, str]]:
    """Merges as token-id pairs (M, 2) -> (left, right) token strings (gathered by numpy: no Python int per id)."""
    names = np.array(tokens, dtype=object)  # (V,)
    return list(zip(names[ids[:, 0]].tolist(), names[ids[:, 1]].tolist()))


def _merge_ids(merges: list[tuple[str, str]], vocab: dict[str, int]) -> np.ndarray | None:
    """(M, 2) int32 token ids of the merges' parts; None when a part is not a token (nothing to cache)."""
    try:
        return np.array([(vocab[a], vocab[b]) for a, b in merges], dtype=np.int32).reshape(-1, 2)
    except KeyError:
        return None


def _set_post_processor(f: GGUFFile, tok, special: dict, tokens: list[str], add_bos_default: bool) -> None:
    from tokenizers import processors

    md = f.metadata
    add_bos = md.get("tokenizer.ggml.add_bos_token", add_bos_default) and "bos" in special
    add_eos = md.get("tokenizer.ggml.add_eos_token", False) and "eos" in special
    bos = tokens[special["bos"]] if "bos" in special else None
    eos = tokens[special["eos"]] if "eos" in special else None
    single = f"{bos + ':0 ' if add_bos else ''}$A:0{' ' + eos + ':0' if add_eos else ''}"
    pair = f"{single}{' ' + bos + ':1' if add_bos else ''} $B:1{' ' + eos + ':1' if add_eos else ''}"
    specials = ([(bos, special["bos"])] if add_bos else []) + ([(eos, special["eos"])] if add_eos else [])
    tok.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)


def derive_merges(vocab: dict[str, int], rank: dict[str, float]) -> list[tuple[str, str]]:
    """The merges a vocabulary implies: each split of a token into two vocabulary tokens, ordered by the
    token's rank (best first), then longer left part first; within a token by the parts' ids."""
    found = []
    for n, (token, score) in enumerate(rank.items()):
        splits = [(token[:k], token[k:]) for k in range(1, len(token)) if token[:k] in vocab and token[k:] in vocab]
        splits.sort(key=lambda p: (vocab[p[0]], vocab[p[1]]))
        found += [(score, len(a), len(b), a, b) for a, b in splits]
    found.sort(key=lambda m: (m[0], m[1], m[2]), reverse=True)  # stable: equal keys keep their order
    return [(a, b) for _, _, _, a, b in found]


def _file_merges(f: GGUFFile) -> list[tuple[str, str]]:
    merges = f.metadata["tokenizer.ggml.merges"]
    if not isinstance(merges, list):
        raise f.error("tokenizer.ggml.merges is not a list of strings")
    out = []
    for m in merges:
        parts = m.split(" ")
        if len(parts) != 2:
            raise f.error(f"tokenizer.ggml.merges entry {m!r} is not two tokens separated by one space")
        out.append((parts[0], parts[1]))
    return out


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's printable spelling of the 256 bytes."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out

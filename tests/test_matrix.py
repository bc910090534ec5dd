"""Every model kind x drafter x k x {fp32, bf16 --exact} x {greedy, sampling} x {short prompt, one near the
context limit whose max-new-tokens crosses it}: each cell gives plain greedy's tokens (greedy), a valid run
(sampling), or, for a combination that cannot work, a clear MtpspecError before any token is generated.

The whole matrix is `@pytest.mark.slow`; the default suite runs one seeded cell per (model kind, drafter)
pair, three verify windows longer than 16 positions on the hybrids, and a few cells through `mtpspec.cli.main`.

Greedy references: fp32 cells are compared with plain fp32 greedy decoding. A verify pass computes a
position's logits in a (D+1)-row forward, plain decoding in a 1-row one; in fp32 they may differ in the last
bits, so a first divergence is accepted only where the plain model's top two logits are a near tie
(gap <= 1e-4 x the logits' scale: fp32 rounding of a sum of a few hundred products is ~1e-6 relative,
so a real disagreement cannot hide below that). bf16 cells run `--exact`, where every position is computed as a
one-token step computes it, so they must equal plain bf16 `--exact` decoding bitwise.

`test_matrix_batched`: per model kind, every drafter that fits it drafts for its own sequence, short and edge
prompts together, all sharing each target forward (fp32, and bf16 --exact): each equals its plain reference.
"""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

import pytest
import torch

import mtpspec
from mtpspec.cli import main
from mtpspec.errors import MtpspecError

HEADS = Path(__file__).resolve().parents[1] / "models" / "heads"
KINDS = ("llama2c", "llama", "qwen3", "qwen35", "qwen3next", "demo")
DRAFTERS = ("none", "ngram", "draft", "mtp", "eagle", "medusa")
KS = (1, 2, 7, 15, 16, 17, 31, "auto")
MODES = ("fp32", "bf16-exact")
SAMPLING = ("greedy", "sampling")
PLACES = ("short", "edge")
N_SHORT, N_EDGE, EDGE_ROOM = 20, 24, 10  # new tokens; the edge prompt leaves EDGE_ROOM positions of context
HF_KINDS = ("llama", "qwen3", "qwen35", "qwen3next")
AUTO_K = 8  # Model.generate(k="auto") drafts up to 8 (the exact-mode width of a plain reference)


class Models:
    """Lazily built and loaded checkpoints (tiny HF ones written once per session)."""

    def __init__(self, root: Path, assets: Path) -> None:
        self.root, self.assets, self.cache = root, assets, {}

    def path(self, kind: str) -> tuple[str, str | None]:
        m = self.assets / "models"
        if kind == "llama2c":
            return str(m / "stories260K.bin"), str(m / "tok512.bin")
        if kind == "demo":
            return "demo", None
        d = self.root / kind
        if not (d / "config.json").exists():
            from qwen35_tiny import save_hf

            save_hf(kind, d, mtp=True, seed=3)
        return str(d), None

    def get(self, kind: str, dtype: str) -> mtpspec.Model:
        if (kind, dtype) not in self.cache:
            self.cache[kind, dtype] = mtpspec.load(*self.path(kind), dtype=dtype)
        return self.cache[kind, dtype]

    def draft_model(self, kind: str, drafter: str, dtype: str):
        """What the cell passes as draft_model (a path for heads, a loaded model for 'draft')."""
        if drafter == "draft":
            if kind == "llama2c":
                key = ("q80", dtype)
                if key not in self.cache:
                    self.cache[key] = mtpspec.load(self.assets / "models" / "stories260K_q80.bin",
                                                   self.assets / "models" / "tok512.bin", dtype)
                return self.cache[key]
            return self.get(kind, dtype)  # the same checkpoint drafts for itself
        if drafter in ("eagle", "medusa") or (drafter == "mtp" and kind == "llama2c"):
            return str(HEADS / f"stories260K-{drafter}")  # heads trained for stories260K
        return None  # mtp on the others: the checkpoint's own MTP module


def expected_error(kind: str, drafter: str) -> str | None:
    """The combinations that cannot work, and the message that says why."""
    if drafter in ("eagle", "medusa") and kind != "llama2c":
        return "head was trained for hidden 64 / vocabulary 512"
    if drafter == "mtp" and kind in ("llama", "qwen3"):
        return "needs a model with an MTP module"
    return None


def prompt_ids(model: mtpspec.Model, place: str) -> tuple[list[int], int]:
    """(prompt ids, max_new_tokens): a short story opening, or a prompt that ends EDGE_ROOM short of the
    context with max_new_tokens crossing the end (a repeating pattern, so prompt lookup has matches)."""
    ids = model.encode("Once upon a time there was a")
    if not ids or max(ids) >= model.module.vocab_size:  # (the tiny word-level tokenizers know w0..w95 only)
        ids = ([1] if place == "short" else []) + [5, 9, 2, 7]
    if place == "short":
        return ids, N_SHORT
    n = model.max_seq_len - EDGE_ROOM
    pattern = [(7 * i) % 23 + 3 for i in range(11)]
    return (ids + pattern * n)[:n], N_EDGE


def k_value(k):
    return AUTO_K if k == "auto" else k


REFS: dict = {}


def reference(models: Models, kind: str, mode: str, place: str, k) -> mtpspec.GenerationResult:
    """Plain greedy decoding (fp32), or plain bf16 --exact with the cell's k."""
    key = (kind, mode, place, k_value(k) if mode == "bf16-exact" else None)
    if key not in REFS:
        m = models.get(kind, "bf16" if mode == "bf16-exact" else "fp32")
        ids, n = prompt_ids(m, place)
        if mode == "bf16-exact":
            REFS[key] = m.generate(ids, max_new_tokens=n, exact=True, k=k_value(k))
        else:
            REFS[key] = m.generate(ids, max_new_tokens=n)
    return REFS[key]


def near_tie(model: mtpspec.Model, ids: list[int]) -> bool:
    """Are the plain model's top two logits after `ids` within fp32 rounding of each other?"""
    with torch.inference_mode():
        cache = model.module.new_cache()
        logits = model.module.forward_tokens(torch.tensor(ids), cache).logits[-1].double()  # (V,)
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1]) <= 1e-4 * float(logits.abs().max())


def check_valid(res, model: mtpspec.Model, ids: list[int], n: int) -> None:
    v = model.module.vocab_size
    assert all(isinstance(t, int) and 0 <= t < v for t in res.tokens)
    assert len(res.tokens) <= n
    assert res.finish_reason in ("stop", "length", "context")
    if res.finish_reason == "length":
        assert len(res.tokens) == n
    if res.finish_reason == "context":
        assert len(ids) + len(res.tokens) == model.max_seq_len + 1  # the cache full, the last token emitted
    if res.finish_reason == "stop":
        assert len(res.tokens) < n


def run_cell(models: Models, kind: str, drafter: str, k, mode: str, sampling: str, place: str) -> None:
    dtype = "bf16" if mode == "bf16-exact" else "fp32"
    model = models.get(kind, dtype)
    ids, n = prompt_ids(model, place)
    kw = dict(drafter=drafter, k=k, draft_model=models.draft_model(kind, drafter, dtype), max_new_tokens=n,
              exact=mode == "bf16-exact")
    if sampling == "sampling":
        kw.update(temperature=0.8, top_p=0.95, seed=11)
    err = expected_error(kind, drafter)
    if err is not None:
        def never(_):
            raise AssertionError("generation started before the error")

        with pytest.raises(MtpspecError, match=err):
            model.generate(ids, on_tokens=never, **kw)
        return
    res = model.generate(ids, **kw)
    check_valid(res, model, ids, n)
    if sampling == "sampling":
        return
    ref = reference(models, kind, mode, place, k)
    assert res.finish_reason == ref.finish_reason or res.tokens != ref.tokens
    check_same(models, kind, mode, ids, res.tokens, ref.tokens)


def check_same(models: Models, kind: str, mode: str, ids: list[int], got: list[int], ref: list[int]) -> None:
    """got == the plain reference, or (fp32) a first divergence at a near tie of the plain model."""
    if got == ref:
        return
    assert mode == "fp32", f"bf16 --exact differs from plain bf16 --exact: {got} vs {ref}"
    i = next((j for j, (a, b) in enumerate(zip(got, ref)) if a != b), min(len(got), len(ref)))
    assert near_tie(models.get(kind, "fp32"), ids + ref[:i]), (
        f"differs from plain greedy at new token {i} without a near tie: {got} vs {ref}")


ALL = list(itertools.product(KINDS, DRAFTERS, KS, MODES, SAMPLING, PLACES))


def sampled_cells() -> list[tuple]:
    """One seeded cell per (model kind, drafter) pair: every pair in the default suite, each run on a
    different k / mode / sampling / prompt draw."""
    rng = random.Random(20261130)
    cells = []
    for kind, d in itertools.product(KINDS, DRAFTERS):
        cell = (kind, d, rng.choice(KS), rng.choice(MODES), rng.choice(SAMPLING), rng.choice(PLACES))
        if cell[0] == "demo" and cell[3] == "bf16-exact" and cell[5] == "edge":  # a 1014-token bf16 prefill
            cell = cell[:5] + ("short",)  # (~20 s on 2 cores): the slow matrix has these
        cells.append(cell)
    for kind, d in (("qwen35", "mtp"), ("qwen3next", "ngram"), ("demo", "mtp")):  # verify windows past 16 positions
        cells.append((kind, d, rng.choice((17, 31)), rng.choice(MODES), rng.choice(SAMPLING), "short"))
    return cells


@pytest.fixture(scope="module")
def models(tmp_path_factory, assets) -> Models:
    return Models(tmp_path_factory.mktemp("matrix"), assets)


def _id(cell) -> str:
    return "-".join(map(str, cell))


@pytest.mark.parametrize("cell", sampled_cells(), ids=_id)
def test_matrix_sample(models, cell):
    run_cell(models, *cell)


@pytest.mark.slow
@pytest.mark.parametrize("cell", ALL, ids=_id)
def test_matrix_full(models, cell):
    run_cell(models, *cell)


CLI_CELLS = [("llama2c", "mtp", "17", []), ("qwen35", "ngram", "auto", ["--exact", "--dtype", "bf16"]),
             ("demo", "mtp", "2", []), ("llama", "draft", "31", [])]


@pytest.mark.parametrize("kind, drafter, k, flags", CLI_CELLS, ids=lambda x: str(x) if not isinstance(x, list) else "")
def test_matrix_through_cli(models, capsys, kind, drafter, k, flags):
    path, tok = models.path(kind)
    dtype = "bf16" if "bf16" in flags else "fp32"
    model = models.get(kind, dtype)
    text = "Once upon a time" if kind in ("llama2c", "demo") else "w5 w9 w2 w7"
    argv = ["generate", text, "--model", path, "--json", "--drafter", drafter, "--k", k, "--max-new-tokens", "16", *flags]
    argv += ["--tokenizer", tok] if tok else []
    dm = models.draft_model(kind, drafter, dtype)
    if dm is not None:
        argv += ["--draft-model", dm if isinstance(dm, str) else (str(models.assets / "models" / "stories260K_q80.bin") if kind == "llama2c" else path)]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    exact = "--exact" in flags
    ref = model.generate(text, max_new_tokens=16, exact=exact, k=k_value(k if k == "auto" else int(k)))
    check_same(models, kind, "bf16-exact" if exact else "fp32", model.encode(text), out["tokens"], ref.tokens)


@pytest.mark.parametrize("kind, mode", [
    pytest.param(kind, mode, marks=pytest.mark.slow) if (kind, mode) == ("demo", "bf16-exact") else (kind, mode)
    for kind in KINDS for mode in MODES])  # demo bf16 --exact: two 1014-token bf16 prefills (16 s), in make test-slow
def test_matrix_batched(models, kind, mode):
    """Every drafter that fits `kind`, one sequence each (short and edge prompts alternating), in one batch."""
    from mtpspec.config import draft_model_arg
    from mtpspec.drafters import make_drafter
    from mtpspec.engine import Engine
    from mtpspec.sampling import Sampler, SamplingParams

    dtype = "bf16" if mode == "bf16-exact" else "fp32"
    model = models.get(kind, dtype)
    engine = Engine(model.module, max_batch=6, exact=mode == "bf16-exact", prefill_chunk=256)
    runs = []
    for i, d in enumerate(x for x in DRAFTERS if expected_error(kind, x) is None):
        place, k = PLACES[i % 2], (1, 2, 7, 17)[i % 4]
        ids, n = prompt_ids(model, place)
        drafter = make_drafter(d, model.module, draft_model=draft_model_arg(models.draft_model(kind, d, dtype), d))
        runs.append((engine.add(ids, drafter, Sampler(SamplingParams(), 0), k, n, model.tokenizer.stop_ids), ids, n, place, k))
    results = engine.run()
    for sid, ids, n, place, k in runs:
        res = results[sid]
        check_valid(res, model, ids, n)
        check_same(models, kind, mode, ids, res.tokens, reference(models, kind, mode, place, k).tokens)

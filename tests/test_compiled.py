"""The compiled decode step (mtpspec/models/compiled.py): the graph entries run the model's one forward, and
generation through it gives plain greedy's tokens.

- The static functions are checked in fp64, run as plain eager code: logits, hidden states and every
  rollback slot of the Gated DeltaNet equal the model's own forward to 1e-10 of their scale (fp64
  rounding is ~1e-16; a wrong mask, position or state would be O(1)).
- CompiledStep / CompiledDraftStep are checked through dynamo with the "eager" backend (the same traced
  graphs, no C++ code generated, seconds): full graphs with no break, one graph per width, the cache's
  bookkeeping, and every drafter's output equal to plain greedy decoding without compiling.
- With inductor (real compilation, minutes on 2 cores) the slow test checks the demo model: greedy
  identity for plain, MTP and prompt lookup, and the logits within the fp32 bound stated there.
"""

from __future__ import annotations

import pytest
import torch

import mtpspec
from mtpspec.models.compiled import CompiledStep, check_compilable, compile_model, dense_graph, hybrid_graph
from mtpspec.errors import ConfigError
from mtpspec.models.dense import DenseConfig, DenseLM
from mtpspec.models.qwen35 import HybridConfig, HybridLM
from qwen35_tiny import randomize


def tiny_hybrid(dtype=torch.float32) -> HybridLM:
    cfg = HybridConfig(
        vocab_size=96, hidden_size=32, num_layers=4, layer_types=("linear_attention",) * 3 + ("full_attention",),
        num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=48, max_seq_len=128, rope_theta=10000.0,
        linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4, mtp_num_layers=1,
    )
    torch.manual_seed(0)
    model = HybridLM(cfg)
    randomize(model, seed=5)
    return model.to(dtype).eval()


def tiny_dense(dtype=torch.float32, window: int = 0, row_kernels: bool = False) -> DenseLM:
    cfg = DenseConfig(vocab_size=96, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64,
                      max_seq_len=128, layer_windows=(window, 0) if window else (), row_kernels=row_kernels)
    torch.manual_seed(0)
    model = DenseLM(cfg)
    randomize(model, seed=6)
    return model.to(dtype).eval()


def _static_step(model, tokens, cache, window_form: bool = False):
    """One static-function forward run eagerly, with the cache bookkeeping CompiledStep does (window_form: Gated
    DeltaNet windows of 2+ positions as one exact chunk, the form a model with large states compiles)."""
    step = CompiledStep.__new__(CompiledStep)  # its __call__ without torch.compile: fn is the plain function
    step.module, step.max_width, step.hybrid, step.window_form = model, 16, hasattr(cache, "n_linear"), window_form
    step.params, step.version, step.graphs, step.backend = [], (), {}, "none"
    from mtpspec.models.compiled import CompileStats, fuse_projections

    fuse_projections(model)
    step.stats, step.fn = CompileStats(), (hybrid_graph if step.hybrid else dense_graph)
    step.run = lambda t, cache, *args, fn=None, extra=(): (fn or step.fn)(*args, 1)
    return step(tokens, cache)


def _rel(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("kind", ["hybrid", "hybrid-chunk", "dense", "dense-window"])
@torch.inference_mode()
def test_static_forward_is_the_model_forward_fp64(kind):
    """Decode and verify windows of widths 1..5 after a 20-token prefill, then rollback to every slot:
    the static function's logits and the states it leaves equal the model's own forward (fp64), the Gated
    DeltaNet position by position or (hybrid-chunk) as one exact chunk per window."""
    model = {"hybrid": tiny_hybrid, "hybrid-chunk": tiny_hybrid, "dense": tiny_dense,
             "dense-window": lambda dt: tiny_dense(dt, window=6)}[kind](torch.float64)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 96, (20,), generator=g)
    for width in range(1, 6):
        window = torch.randint(0, 96, (width,), generator=g)
        for keep in range(width + 1):  # roll back to every slot; the next token must then agree too
            runs = []
            for static in (False, True):
                c = model.new_cache()
                model.forward_tokens(prompt, c, prefill=True)
                out = _static_step(model, window, c, kind == "hybrid-chunk") if static else model.forward_tokens(window, c)
                c.crop(20 + keep)
                runs.append((out, model.forward_tokens(window[:1], c).logits))
            (oe, ne), (os_, ns) = runs
            assert _rel(os_.logits, oe.logits) < 1e-10 and _rel(os_.hidden, oe.hidden) < 1e-10, width
            assert _rel(ns, ne) < 1e-10, (width, keep)


@pytest.mark.parametrize("kind", ["hybrid", pytest.param("hybrid-window", marks=pytest.mark.slow), "dense", "dense-blocks",
                                  pytest.param("hybrid-blocks", marks=pytest.mark.slow)])  # 18 s; dense-blocks covers the kernels
def test_compiled_generation_equals_plain_greedy(kind):
    """Through dynamo (eager backend): every drafter gives plain greedy's tokens without compiling, one full
    graph per width is built, and prefill / exact mode stay eager. hybrid-window: verify windows take the Gated
    DeltaNet's chunk form (what a model with large states compiles: CompiledStep.window_form). -blocks: linear layers
    on GGUF Q8_0 blocks (--quant), the dense one with the row-invariant norm and attention kernels a GGUF file's
    model runs on: the kernels are opaque ops in the graph."""
    import torch._dynamo

    from mtpspec.quant import quantize

    torch._dynamo.reset()
    model = tiny_hybrid() if kind.startswith("hybrid") else tiny_dense(row_kernels=kind == "dense-blocks")
    if kind.endswith("-blocks"):
        quantize(model, "q8_0")
    g = torch.Generator().manual_seed(2)
    prompt = [int(t) for t in torch.randint(0, 96, (12,), generator=g)]
    runs = [("none", 1), ("ngram", 3)] + ([("mtp", 1), ("mtp", 3)] if kind.startswith("hybrid") else [])
    from mtpspec.drafters import make_drafter
    from mtpspec.engine import generate_tokens
    from mtpspec.sampling import Sampler, SamplingParams

    def gen(drafter, k, exact=False):
        return generate_tokens(model, prompt, make_drafter(drafter, model), k, Sampler(SamplingParams(), 0), 24, exact=exact).tokens

    ref = {r: gen(*r) for r in runs}
    step = compile_model(model, max_width=5, backend="eager")
    assert not step.window_form  # the tiny model's states are small
    step.window_form = kind == "hybrid-window"
    for r in runs:
        assert gen(*r) == ref[r], r
    assert step.built and {key[0] for key in step.built} <= {1, 4, 5}  # windows padded to their buckets
    assert step.stats.graphs == len(step.built)
    assert any(key[2:] == ("window",) for key in step.built) == (kind == "hybrid-window")
    if kind.startswith("hybrid"):
        drafts = model.mtp.compiled_step
        assert drafts.built, "the MTP drafter went through its compiled step"
    n = step.stats.graphs
    assert gen("none", 1, exact=True) == ref["none", 1] and step.stats.graphs == n  # exact mode: eager


@pytest.mark.parametrize("draft_vocab", [None, pytest.param(40, marks=pytest.mark.slow)])  # a draft vocabulary's graphs: 12 s
def test_greedy_draft_chain_equals_the_step_by_step_drafts(draft_vocab):
    """The compiled greedy chain (a round's k drafts from one graph, CompiledDraftStep.chain; deeper than chain_max, from
    segments) proposes, round after round, exactly what the step-by-step compiled drafter proposes (eager backend: the
    same static functions, so the same bits), with the full LM head and with a draft vocabulary; generation through it
    equals plain greedy; and the built graphs are called without dynamo (compiled._direct)."""
    import torch._dynamo

    from mtpspec.models.compiled import _direct
    from mtpspec.drafters import make_drafter
    from mtpspec.models.draft_vocab import TokenRanking
    from mtpspec.engine import generate_tokens
    from mtpspec.sampling import Sampler, SamplingParams

    torch._dynamo.reset()
    model = tiny_hybrid()
    if draft_vocab:
        model.token_ranking = TokenRanking(torch.randperm(96, generator=torch.Generator().manual_seed(4)), draft_vocab)
    prompt = [int(t) for t in torch.randint(0, 96, (14,), generator=torch.Generator().manual_seed(7))]
    ref = generate_tokens(model, prompt, make_drafter("none", model), 1, Sampler(SamplingParams(), 0), 30).tokens
    compile_model(model, max_width=5, backend="eager")

    def run(chain: bool, k: int):
        d = make_drafter("mtp", model, draft_vocab=draft_vocab)
        if not chain:
            d._chains = lambda: False
        drafts, propose = [], d.propose
        d.propose = lambda c, n: drafts.append(propose(c, n)) or drafts[-1]
        out = generate_tokens(model, prompt, d, k, Sampler(SamplingParams(), 0), 30).tokens
        return out, [x.tokens.tolist() for x in drafts]

    step = model.mtp.compiled_step
    step.chain_max = 3  # segments: 4 = 3 + 1, 7 = 3 + 3 + 1
    for k in (1, 3, 4, 7):
        (out_c, drafts_c), (out_s, drafts_s) = run(True, k), run(False, k)
        assert out_c == out_s == ref and drafts_c == drafts_s, k
    chains = {key[2:4] for key in step.built if key[2:3] in (("chain",), ("cont",))}
    # 4 = 3 + 1, 7 = 3 + 3 + 1 (a later segment fed the previous one's last draft first); the last rounds, short of room, less
    assert {("chain", 3), ("cont", 1), ("cont", 3)} <= chains and max(n for _, n in chains) == 3
    assert all(g.__code__.co_name.startswith(("draft_chain_graph", "module_graph")) for g in step.graphs.values())
    assert _direct(lambda: None) is None  # a function dynamo never compiled: no entry, the guarded call serves


def test_two_models_compiled_in_one_process_trace_apart():
    """Each compiled step names its graphs' code objects apart (compiled._Compiled._compile): dynamo keeps a frame's
    shapes by (file, line, name), and a second model traced under the first one's names got its differing sizes
    made dynamic, i.e. generic kernels rounding otherwise (the demo's compiled plain greedy left eager's at token 23
    after a tiny model had been compiled in the same process)."""
    names = []
    for model in (tiny_hybrid(), tiny_hybrid()):  # the same function traced for each
        step = compile_model(model, max_width=5, backend="eager")
        with torch.inference_mode():
            c = model.new_cache()
            model.forward_tokens(torch.tensor([1, 2, 3]), c, prefill=True)
            model.forward_tokens(torch.tensor([4]), c)
        names += [g.__code__.co_name for g in step.graphs.values()]
    assert len(names) == 2 and len(set(names)) == 2, names


def test_spans_cover_the_context_in_powers_of_two():
    from mtpspec.models.compiled import span, spans

    assert [span(n, 1024) for n in (1, 64, 65, 128, 129, 1000, 1024)] == [64, 64, 128, 128, 256, 1024, 1024]
    assert span(700, 1000) == 1000  # the buffer itself past the last power of two below it
    assert spans(100, 300, 1024) == [(128, 64), (256, 128), (512, 256)]
    assert spans(1, 1000, 1000) == [(64, 0), (128, 64), (256, 128), (512, 256), (1000, 512)]


def test_windows_run_in_power_of_two_buckets_and_eagerly_where_the_padding_finds_no_room():
    """A window's rows are padded to a bucket (1, 4, 6, 8 rows, at most the widest graph), so --k auto's widths share
    a few graphs; a window whose bucket would pass the buffer's end runs eagerly rather than in a graph of its own.
    (That the padded rows change nothing is checked in fp64 above: windows of 2, 3 and 5 rows run padded to 4 and 6.)"""
    from mtpspec.models.compiled import _Compiled, bucket, buckets

    assert [bucket(t, 8) for t in range(1, 9)] == [1, 4, 4, 4, 6, 6, 8, 8]
    assert buckets(range(1, 12), 5) == [1, 4, 5] and buckets(range(1, 4), 3) == [1, 3]
    step = _Compiled.__new__(_Compiled)
    step.max_width = 8
    with torch.inference_mode():
        assert step.usable(3, 124, 128, torch.float32, 1) and not step.usable(3, 125, 128, torch.float32, 1)
        assert step.usable(4, 124, 128, torch.float32, 1) and not step.usable(10, 0, 128, torch.float32, 1)
    assert not step.usable(1, 0, 128, torch.float32, 1)  # outside inference mode: eager


@pytest.mark.slow  # 14 s of graph builds
def test_prepare_builds_every_graph_a_run_needs_before_it():
    """After prepare(widths, lo, hi), generation over those positions builds no graph (the bench times no
    compilation), and gives plain greedy's tokens."""
    import torch._dynamo

    from mtpspec.models.compiled import prepare, span
    from mtpspec.drafters import make_drafter
    from mtpspec.engine import generate_tokens
    from mtpspec.sampling import Sampler, SamplingParams

    torch._dynamo.reset()
    model = tiny_hybrid()
    prompt = [int(t) for t in torch.randint(0, 96, (40,), generator=torch.Generator().manual_seed(3))]

    def gen():
        return generate_tokens(model, prompt, make_drafter("mtp", model), 3, Sampler(SamplingParams(), 0), 40).tokens

    ref = gen()
    step = compile_model(model, max_width=5, backend="eager")
    prepare(model, range(1, 5), len(prompt), len(prompt) + 40 + 3, chains=(1, 2, 3))  # (1, 2: the last rounds, short of room)
    built, drafts = step.built, model.mtp.compiled_step.built
    assert sorted(t for t, _ in built) == [1, 4]  # one graph per bucket for both spans (64 and 128): its length symbolic
    assert sorted(key[0] for key in drafts if len(key) == 2) == [1, 4]
    assert sorted(key[3] for key in drafts if len(key) > 2) == [1, 2, 3]  # chains of depth 1 to 3
    assert gen() == ref and step.built == built and model.mtp.compiled_step.built == drafts
    assert span(len(prompt) + 40, model.max_seq_len) == 128


@pytest.mark.slow  # 20 s of graph builds
def test_warm_builds_every_graph_any_depth_takes():
    """After warm(model, 8, mtp=True, chains=True) (what Model.generate runs first on a compiled model), greedy MTP at any fixed
    depth and with --k auto's policy builds no graph, and every run gives plain greedy's tokens."""
    import torch._dynamo

    from mtpspec.adaptive import ByBatchSize
    from mtpspec.drafters import make_drafter
    from mtpspec.engine import generate_tokens
    from mtpspec.models.compiled import warm
    from mtpspec.sampling import Sampler, SamplingParams

    torch._dynamo.reset()
    model = tiny_hybrid()
    prompt = [int(t) for t in torch.randint(0, 96, (20,), generator=torch.Generator().manual_seed(8))]

    def gen(k, depth=None):
        return generate_tokens(model, prompt, make_drafter("mtp", model), k, Sampler(SamplingParams(), 0), 40, depth=depth).tokens

    ref = gen(1)
    step = compile_model(model, max_width=8, backend="eager")
    warm(model, 8, True, True)
    built = step.stats.graphs + model.mtp.compiled_step.stats.graphs
    warm(model, 8, True, True)  # once
    for k in (1, 2, 5, 7):
        assert gen(k) == ref, k
    assert gen(8, ByBatchSize(k_max=8)) == ref
    assert step.stats.graphs + model.mtp.compiled_step.stats.graphs == built
    assert sorted(key[0] for key in step.built) == [1, 4, 6, 8]


def test_compile_refuses_what_it_does_not_cover():
    with pytest.raises(ConfigError, match="fp32 or bf16"):
        check_compilable(None, torch.float64)
    with pytest.raises(ConfigError, match="True or False"):
        mtpspec.load("demo", compile="yes")


@pytest.mark.parametrize("argv, message", [
    (["generate", "x", "--model", "demo", "--compile", "--dtype", "fp64"], "--compile needs fp32 or bf16"),
    (["serve", "--model", "demo", "--compile", "--dtype", "fp64"], "--compile needs fp32 or bf16"),
])
def test_compile_cli_errors(capsys, argv, message):
    """One line on stderr and exit status 2, before anything is compiled (or served)."""
    from mtpspec.cli import main

    assert main(argv) == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_inductor_demo_greedy_identity_and_logits():
    """Real compilation (inductor, C++ kernels) of the demo: tokens equal eager's for plain, MTP and prompt
    lookup; logits of 24 decode steps within 1e-4 of eager's scale (fp32: a fused kernel sums in another
    order, ~1e-6 relative per reduction measured; the bound leaves room for the model's conditioning). The runs cross
    from the 64-position KV span into the 128 one: the same graphs serve both (the span's length is symbolic)."""
    model = mtpspec.load("demo", threads=1)
    ids = model.encode("import os\nimport sys\n\n\ndef read_lines(path):\n    with open(path) as f:\n"
                       "        return [line.rstrip() for line in f]\n\n\ndef parse(line):\n    ")
    assert len(ids) < 64 < len(ids) + 32
    runs = [("none", 1), ("mtp", 2), ("ngram", 4)]
    ref = {r: model.generate(ids, drafter=r[0], k=r[1], max_new_tokens=32).tokens for r in runs}
    with torch.inference_mode():
        c = model.module.new_cache()
        model.module.forward_tokens(torch.tensor(ids[:-1]), c, prefill=True)
        tok, eager_logits = torch.tensor(ids[-1:]), []
        for _ in range(24):
            lg = model.module.forward_tokens(tok, c).logits
            eager_logits.append(lg)
            tok = lg.argmax(-1)
    compile_model(model.module, max_width=5)
    for r in runs:
        assert model.generate(ids, drafter=r[0], k=r[1], max_new_tokens=32).tokens == ref[r], r
    with torch.inference_mode():
        c = model.module.new_cache()
        model.module.forward_tokens(torch.tensor(ids[:-1]), c, prefill=True)
        tok = torch.tensor(ids[-1:])
        for want in eager_logits:
            lg = model.module.forward_tokens(tok, c).logits
            assert _rel(lg, want) < 1e-4
            tok = want.argmax(-1)


@pytest.mark.slow  # compiles Gemma 3 270M's graphs with inductor: minutes on 2 cores (cached on disk after)
def test_inductor_gemma_block_weights_rows_and_greedy_identity():
    """Gemma 3 270M from its Q4_K_M file, compiled: the block kernels, the row-invariant norm and attention run as
    opaque ops inside the graph, so a compiled 5-row verify window computes each row bitwise as the compiled one-row
    step does, and prompt lookup's greedy text equals plain greedy's through the compiled graphs."""
    from conftest_gemma import gemma_path

    model = mtpspec.load(str(gemma_path()), compile=True, threads=2)
    m = model.module
    ids = model.encode("def fibonacci(n):\n    if n")
    with torch.inference_mode():
        a, b = m.new_cache(), m.new_cache()
        for c in (a, b):
            m.forward_tokens(torch.tensor(ids), c, prefill=True)
        window = torch.tensor(model.encode(" < 2:\n        return")[:5])
        together = m.forward_tokens(window, a).logits  # (5, V) one compiled 5-row graph
        alone = torch.cat([m.forward_tokens(window[i : i + 1], b).logits for i in range(window.shape[0])])
    assert torch.equal(together, alone)
    plain = model.generate(ids, drafter="none", max_new_tokens=32).tokens
    assert model.generate(ids, drafter="ngram", k=4, max_new_tokens=32).tokens == plain
    assert m.compiled_step.stats.graphs >= 2

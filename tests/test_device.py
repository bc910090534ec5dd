"""Devices (mtpspec/device.py, models/placement.py): what computes where, and that it stays lossless there.

On the CPU: device names are checked (no CUDA: one error line, exit 2), everything a CPU model and its engine allocate
is on the CPU, the C++ kernels serve its products, and the torch path a GPU runs (kernels.torch_path()) is lossless on
its own for plain / MTP / n-gram at batch 1 and 3. On a CUDA machine the same losslessness runs there (skipped
here); `MTPSPEC_DEVICE=cuda pytest -k "lossless or device"` also runs the default suite's lossless tests on CUDA
(scripts/cuda_check.py).
"""

from __future__ import annotations

import pytest
import torch

import mtpspec
from mtpspec import kernels
from mtpspec.cli import main
from mtpspec.device import resolve
from mtpspec.drafters import make_drafter
from mtpspec.engine import Engine
from mtpspec.errors import ConfigError
from mtpspec.models.blocks import holds_blocks
from mtpspec.models.placement import densify, place
from mtpspec.sampling import Sampler, SamplingParams

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device (scripts/cuda_check.py runs these where one is lent)")
PROMPTS = ["Once upon a time", "The little dog ran", "She said that the"]
N = 32
CPU = torch.device("cpu")


def tensors_of(obj, seen=None):
    """Every tensor reachable from `obj`'s attributes (lists, tuples, dicts, nested objects), each once."""
    seen = set() if seen is None else seen
    if id(obj) in seen or obj is None or isinstance(obj, (int, float, str, bool, torch.nn.Module, torch.Generator)):
        return []
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        items = list(obj.values())
    elif isinstance(obj, (list, tuple)):
        items = list(obj)
    elif hasattr(obj, "__dict__"):
        items = list(vars(obj).values())
    else:
        return []
    return [t for x in items for t in tensors_of(x, seen)]


@pytest.fixture(scope="module")
def demo_cpu() -> mtpspec.Model:
    return mtpspec.load("demo", device="cpu")


def test_device_names_are_checked(monkeypatch):
    assert resolve("cpu") == CPU and resolve(torch.device("cpu")) == CPU and resolve(" CPU ") == CPU
    monkeypatch.setenv("MTPSPEC_DEVICE", "cpu")
    assert resolve(None) == CPU
    for bad, why in (("tpu", "unknown device"), ("cuda:x", "unknown device"), ("mps", "not supported"), (3, "must be a name")):
        with pytest.raises(ConfigError, match=why):
            resolve(bad)


@pytest.mark.skipif(CUDA, reason="checks the refusal on a machine without CUDA")
def test_cuda_without_cuda_is_one_error_line(capsys):
    with pytest.raises(ConfigError, match="CUDA is not available"):
        mtpspec.load("demo", device="cuda")
    for argv in (["generate", "hi", "--model", "demo", "--device", "cuda"], ["generate", "hi", "--model", "demo", "--device", "cuda:1"],
                 ["train", "head", "--model", "demo", "--out", "unused", "--device", "cuda"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("mtpspec: error: CUDA is not available"), err


def test_a_cpu_model_and_its_engine_allocate_on_the_cpu(demo_cpu, monkeypatch):
    """Weights, rotary tables, every sequence's cache, the batch's KV slots and the drafters' state: all on the CPU,
    with the products on the C++ kernels (when they build here)."""
    module = demo_cpu.module
    assert demo_cpu.device == CPU
    assert {t.device for t in [*module.parameters(), *module.buffers()]} == {CPU}
    calls = []
    real = kernels.packed_linear
    monkeypatch.setattr(kernels, "packed_linear", lambda *a, **k: calls.append(1) or real(*a, **k))
    engine = Engine(module, max_batch=2)
    assert engine.device == CPU
    for i, p in enumerate(PROMPTS[:2]):
        engine.add(demo_cpu.encode(p), make_drafter("mtp", module), Sampler(SamplingParams(temperature=0.8), i), 3, 8)
    engine.step()
    engine.step()
    found = tensors_of([engine.storage, *[(s.cache, s.drafter.__dict__, s.buf, s.sampler) for s in engine.running]])
    assert len(found) > 10 and {t.device for t in found} == {CPU}
    assert bool(calls) == kernels.available()  # the kernel path on the CPU, F.linear only without a compiler


def test_off_the_cpu_no_kernel_is_chosen(monkeypatch):
    """Dispatch only (meta tensors stand in for a device's: shapes, no data): a product, a norm and a derived product
    on a non-CPU tensor take torch's ops, and a cache buffer there is a plain allocation, never a CPU mapping."""
    from mtpspec.cache import KVCache, lazy_zeros
    from mtpspec.models.common import Linear, RMSNorm

    monkeypatch.setattr(kernels, "packed_linear", lambda *a, **k: pytest.fail("a kernel product on a non-CPU tensor"))
    x = torch.empty(3, 64, device="meta")
    assert not kernels.takes(x, torch.float32)
    with torch.inference_mode():
        lin = Linear(64, 32, device="meta")
        assert lin(x).shape == (3, 32) and lin.wide(x).device.type == "meta"
        norm = RMSNorm(64, row_kernel=True).to("meta")
        assert norm(x).device.type == "meta"
        prod = kernels.Product(torch.empty(32, 64, device="meta"))
        assert prod.panels is None and prod(x).shape == (3, 32)
    big = lazy_zeros((1 << 20,), torch.float32, "meta")  # 4 MiB: a mapping on the CPU
    assert big.device.type == "meta"
    assert KVCache(2, 1, 8, 16, device="meta").k.device.type == "meta"


def test_place_on_the_cpu_changes_nothing(demo_cpu):
    before = {n: p.data_ptr() for n, p in demo_cpu.module.named_parameters()}
    assert place(demo_cpu.module, CPU) is demo_cpu.module
    assert before == {n: p.data_ptr() for n, p in demo_cpu.module.named_parameters()}


def test_densify_turns_block_layers_into_their_dequantized_dense_layers(assets):
    """A device without the block kernel computes a GGUF-block model on its exactly dequantized weights (in fp
    activations: close to the block kernel's 8-bit-activation products, not equal)."""
    m = mtpspec.load(assets / "models" / "stories260K.bin", tokenizer=assets / "models" / "tok512.bin", quant="q8_0", device="cpu")
    module = m.module
    blocks = {n: mm.weight.detach().clone() for n, mm in module.named_modules() if holds_blocks(mm)}
    ids = torch.tensor(m.encode(PROMPTS[0]))
    ref = module.forward_tokens(ids, module.new_cache(), prefill=True).logits
    assert densify(module) == len(blocks) > 0
    assert not any(holds_blocks(mm) for mm in module.modules())
    dense = dict(module.named_modules())
    for n, w in blocks.items():
        assert torch.equal(dense[n].weight, w.to(dense[n].weight.dtype)), n
    got = module.forward_tokens(ids, module.new_cache(), prefill=True).logits
    assert (got - ref).abs().max() < 0.02 * ref.abs().max()


def test_torch_path_is_lossless_for_plain_mtp_and_ngram_at_batch_1_and_3(monkeypatch):
    """kernels.torch_path(): the products a CUDA device runs (F.linear, torch norms and attention), on the CPU. Greedy
    speculation is token-identical to plain greedy on it, one sequence at a time and three sharing each forward."""
    with kernels.torch_path():
        m = mtpspec.load("demo", device="cpu")
        monkeypatch.setattr(kernels, "packed_linear", lambda *a, **k: pytest.fail("a kernel product on the torch path"))
        n = 24
        plain = [m.generate(p, max_new_tokens=n).tokens for p in PROMPTS]
        for drafter in ("mtp", "ngram"):
            alone = [m.generate(p, drafter=drafter, k=3, max_new_tokens=n) for p in PROMPTS]
            assert [r.tokens for r in alone] == plain, drafter
            together = m.generate_batch(PROMPTS, drafter=drafter, k=3, max_new_tokens=n)
            assert [r.tokens for r in together] == plain, drafter
        assert sum(r.stats.accepted_tokens for r in alone) > 0


def test_serve_exact_reaches_the_engine_and_answers_plain_greedy(demo_cpu):
    """`serve --exact` (ServeOptions.exact): the server's engines verify in exact mode; a completion is plain's text."""
    from fastapi.testclient import TestClient

    from mtpspec.server import create_app
    from mtpspec.server.options import ServeOptions
    from mtpspec.server.registry import Served

    app = create_app(Served({"demo": demo_cpu}), ServeOptions(drafter="mtp", k=2, max_batch=2, exact=True))
    with TestClient(app) as client:
        assert all(s.engine.exact for s in app.state.schedulers.values())
        r = client.post("/v1/completions", json={"model": "demo", "prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == demo_cpu.generate(PROMPTS[0], max_new_tokens=12).text


@pytest.mark.slow
def test_torch_path_gguf_model_as_a_device_runs_it_is_lossless():
    """Gemma 3 270M as place() makes it for a device (dense dequantized weights, batched attention and norms), on the
    CPU's torch path: greedy MTP and n-gram equal plain at batch 1 and 3, and in exact mode."""
    from mtpspec.loading.realmodels import gemma3_270m_available
    from mtpspec.models.placement import plain_rows

    if not gemma3_270m_available():
        pytest.skip("Gemma 3 270M is not installed (the `real` extra)")
    prompts = ["def fibonacci(n):", "The capital of France is", "import numpy as np\n"]
    with kernels.torch_path():
        m = mtpspec.load("gemma3-270m", device="cpu")
        assert densify(m.module) > 0
        plain_rows(m.module)
        assert not m.module.config.row_kernels
        plain = [m.generate(p, max_new_tokens=16).tokens for p in prompts]
        for drafter in ("mtp", "ngram"):
            assert [m.generate(p, drafter=drafter, k=3, max_new_tokens=16).tokens for p in prompts] == plain, drafter
            for exact in (False, True):
                got = m.generate_batch(prompts, drafter=drafter, k=3, max_new_tokens=16, exact=exact)
                assert [r.tokens for r in got] == plain, (drafter, exact)


def test_sampler_draws_on_the_host_generator_whatever_the_default_device():
    s = Sampler(SamplingParams(temperature=1.0), seed=5)
    u = s.uniform(4)
    assert u.device == CPU and torch.equal(u, torch.rand(4, generator=torch.Generator().manual_seed(5)))


# -- on a CUDA device (skipped without one) ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def demo_cuda() -> mtpspec.Model:
    return mtpspec.load("demo", device="cuda")


@needs_cuda
def test_cuda_model_and_engine_allocate_on_the_device(demo_cuda):
    module = demo_cuda.module
    assert demo_cuda.device.type == "cuda"
    assert {t.device.type for t in [*module.parameters(), *module.buffers()]} == {"cuda"}
    engine = Engine(module, max_batch=2)
    for i, p in enumerate(PROMPTS[:2]):
        engine.add(demo_cuda.encode(p), make_drafter("mtp", module), Sampler(SamplingParams(temperature=0.8), i), 3, 8)
    engine.step()
    engine.step()
    found = tensors_of([engine.storage, *[(s.cache, s.drafter.__dict__, s.buf) for s in engine.running]])
    assert len(found) > 10 and {t.device.type for t in found} == {"cuda"}


@needs_cuda
@pytest.mark.parametrize("drafter", ["mtp", "ngram"])
def test_cuda_greedy_lossless_at_batch_1_and_8(demo_cuda, drafter):
    """Greedy speculation on CUDA equals plain greedy on CUDA (cuBLAS may round a batched verify's rows differently:
    a token could differ only where the top two logits tie within that rounding; exact mode below is bitwise)."""
    prompts = (PROMPTS * 3)[:8]
    plain = [demo_cuda.generate(p, max_new_tokens=N).tokens for p in prompts]
    assert [demo_cuda.generate(p, drafter=drafter, k=3, max_new_tokens=N).tokens for p in prompts] == plain
    assert [r.tokens for r in demo_cuda.generate_batch(prompts, drafter=drafter, k=3, max_new_tokens=N)] == plain


@needs_cuda
def test_cuda_exact_mode_lossless_and_batch_invariant(demo_cuda):
    prompts = (PROMPTS * 3)[:8]
    plain = [demo_cuda.generate(p, max_new_tokens=N, exact=True).tokens for p in prompts]
    got = demo_cuda.generate_batch(prompts, drafter="mtp", k=3, max_new_tokens=N, exact=True)
    assert [r.tokens for r in got] == plain


@needs_cuda
def test_cuda_gumbel_sampling_lossless_across_drafters(demo_cuda):
    """Seeded Gumbel sampling: the text is a function of the seed alone (its integer noise is exact on the device)."""
    runs = [demo_cuda.generate(PROMPTS[0], drafter=d, k=3, temperature=0.8, seed=11, sampler="gumbel", max_new_tokens=N).tokens
            for d in ("none", "mtp", "ngram")]
    assert runs[0] == runs[1] == runs[2]


@needs_cuda
def test_cuda_gguf_model_lossless_on_dense_weights():
    from mtpspec.loading.realmodels import gemma3_270m_available

    if not gemma3_270m_available():
        pytest.skip("Gemma 3 270M is not installed (the `real` extra)")
    m = mtpspec.load("gemma3-270m", device="cuda")
    assert not any(holds_blocks(mm) for mm in m.module.modules())
    plain = m.generate("def fibonacci(n):", max_new_tokens=N).tokens
    assert m.generate("def fibonacci(n):", drafter="ngram", k=4, max_new_tokens=N).tokens == plain

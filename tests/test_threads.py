"""The thread rule (mtpspec.threads): its choices by model size and machine load, the API's threads argument,
and every command's --threads default going through it. No timings here: the measurements behind the rule are
in docs/decisions.md ("Default thread count")."""

import pytest
import torch
from torch import nn

import mtpspec
from mtpspec import threads as th
from mtpspec.cli import build_parser, main
from mtpspec.errors import ConfigError


def big_module() -> nn.Module:
    """1.6 GB of fp32 weights on the meta device (no memory): above SMALL_BYTES."""
    return nn.Linear(20_000, 20_000, bias=False, device="meta")


def test_small_models_get_one_thread_whatever_the_machine(stories):
    assert th.parameter_bytes(stories.module) < th.SMALL_BYTES
    for cores in (1, 2, 16):
        for load in (0.0, 1.0, 8.0):
            assert th.default_threads(stories.module, cores=cores, load=load) == 1


def test_large_models_get_the_idle_cores():
    m = big_module()
    assert th.parameter_bytes(m) == 20_000 * 20_000 * 4 > th.SMALL_BYTES
    assert th.default_threads(m, cores=2, load=0.0) == 2  # a quiet 2-core machine
    assert th.default_threads(m, cores=2, load=0.4) == 2
    assert th.default_threads(m, cores=2, load=1.2) == 1  # one core busy
    assert th.default_threads(m, cores=2, load=4.0) == 1  # never below 1
    assert th.default_threads(m, cores=8, load=3.0) == 5
    assert th.default_threads(m, cores=1, load=0.0) == 1


def test_compiled_small_models_get_the_idle_cores():
    """A compiled step is mostly the kernel's products, which a second thread splits; an eager small step is dispatch."""
    small = nn.Linear(64, 64, bias=False, device="meta")
    assert th.default_threads(small, cores=2, load=0.0) == 1
    assert th.default_threads(small, cores=2, load=0.0, compiled=True) == 2
    assert th.default_threads(small, cores=2, load=1.2, compiled=True) == 1  # a busy machine: still one
    small.compiled_step = object()  # what compile_model leaves on a model: found without being told
    assert th.default_threads(small, cores=2, load=0.0) == 2
    assert th.resolve_threads(None, small, compiled=False) == 1 and th.resolve_threads(3, small) == 3


def test_models_on_the_row_kernels_get_the_idle_cores():
    """A GGUF block model's step is the kernels' products (its layers one call): split like a compiled step's, from
    ROW_BYTES (a tiny file's products are not worth a fork)."""
    from types import SimpleNamespace

    mid = nn.Linear(4096, 4096, bias=False, device="meta")  # 64 MiB: between ROW_BYTES and SMALL_BYTES
    tiny = nn.Linear(64, 64, bias=False, device="meta")
    for m in (mid, tiny):
        m.config = SimpleNamespace(row_kernels=True)
    assert th.ROW_BYTES <= th.parameter_bytes(mid) < th.SMALL_BYTES
    assert th.default_threads(mid, cores=2, load=0.0) == 2
    assert th.default_threads(mid, cores=2, load=1.2) == 1  # a busy machine: still one
    assert th.default_threads(tiny, cores=2, load=0.0) == 1


def test_parameter_bytes_counts_a_tied_head_once(stories):
    params = {id(p): p for p in stories.module.parameters()}  # parameters() already yields a tied weight once
    assert th.parameter_bytes(stories.module) == sum(p.numel() * p.element_size() for p in params.values())


def test_the_rule_boundary():
    under = nn.Linear(th.SMALL_BYTES // 4 // 1024 - 1, 1024, bias=False, device="meta")  # just under, fp32
    assert th.default_threads(under, cores=4, load=0.0) == 1
    over = nn.Linear(th.SMALL_BYTES // 4 // 1024 + 1, 1024, bias=False, device="meta")
    assert th.default_threads(over, cores=4, load=0.0) == 4


def test_load_applies_the_rule_and_generate_its_threads(assets):
    m = assets / "models"
    model = mtpspec.load(m / "stories260K.bin", m / "tok512.bin")
    assert model.threads == th.default_threads(model.module) == 1
    seen = []
    model.generate("Once", max_new_tokens=3, threads=2, on_tokens=lambda t: seen.append(torch.get_num_threads()))
    assert seen and set(seen) == {2}  # the call ran with the count asked for
    seen.clear()
    model.generate("Once", max_new_tokens=3, on_tokens=lambda t: seen.append(torch.get_num_threads()))
    assert set(seen) == {1}  # and the next call with the model's own again
    pinned = mtpspec.load(m / "stories260K.bin", m / "tok512.bin", threads=2)
    assert pinned.threads == 2 and torch.get_num_threads() == 2
    torch.set_num_threads(1)


@pytest.mark.parametrize("bad", [0, -1, 1.5, "2", True])
def test_bad_threads_are_config_errors(stories, assets, bad):
    with pytest.raises(ConfigError, match="threads must be"):
        stories.generate("Once", max_new_tokens=1, threads=bad)
    m = assets / "models"
    with pytest.raises(ConfigError, match="threads must be"):
        mtpspec.load(m / "stories260K.bin", m / "tok512.bin", threads=bad)


def test_numpy_integers_are_accepted(stories):
    np = pytest.importorskip("numpy")
    assert len(stories.generate("Once", max_new_tokens=2, threads=np.int64(1)).tokens) == 2


COMMANDS = {  # command line (minimal) -> how to find its parsed --threads
    "generate": ["generate", "hi", "--model", "demo"],
    "trace": ["trace", "hi", "--model", "demo", "--out", "x.html"],
    "bench": ["bench", "--model", "demo", "--prompts", "tinystories", "--out", "o"],
    "serve": ["serve"],
    "demo": ["demo"],
    "train eval": ["train", "eval", "--model", "demo", "--runs", "ngram:2"],
}


@pytest.mark.parametrize("name", list(COMMANDS))
def test_every_command_defaults_to_the_rule(name):
    parser = build_parser()
    args = parser.parse_args(COMMANDS[name])
    assert args.threads is None  # None = mtpspec.threads.default_threads, in api.load / Model.generate
    assert parser.parse_args(COMMANDS[name] + ["--threads", "3"]).threads == 3


def test_threads_help_names_the_rule(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    assert "chosen per model" in " ".join(capsys.readouterr().out.split())


def test_generate_command_goes_through_the_rule(monkeypatch, capsys, assets):
    """`mtpspec generate` without --threads asks the rule about the loaded module (and runs with its answer)."""
    asked = []

    def rule(module, cores=None, load=None, compiled=None):
        asked.append(module)
        return 1

    monkeypatch.setattr(th, "default_threads", rule)
    m = assets / "models"
    rc = main(["generate", "Once", "--model", str(m / "stories260K.bin"), "--tokenizer", str(m / "tok512.bin"), "--max-new-tokens", "2"])
    assert rc == 0 and asked and all(a.vocab_size == 512 for a in asked)


def test_bad_threads_on_the_command_line(capsys, assets):
    m = assets / "models"
    rc = main(["generate", "Once", "--model", str(m / "stories260K.bin"), "--tokenizer", str(m / "tok512.bin"), "--threads", "0"])
    err = capsys.readouterr().err
    assert rc == 2 and "--threads must be >= 1" in err and "Traceback" not in err

"""Training under torchrun (mtpspec/train/distributed.py): two gloo processes on CPU follow the trajectory of one
process over the same global batch, only rank 0 writes, and a checkpoint written by two processes resumes in one.

The bound. DDP gives each rank half the global batch and averages the two gradients: with equal shards that is the
full batch's mean gradient, changed only by float summation order (each half's matmuls and means are summed in
another order than the whole batch's), a few fp32 ulps (~1e-7 relative) per step. AdamW divides by the gradient's
own scale, so such a difference stays of the same relative size in the update; over the few steps here the losses
(~1-5) agree to far better than 1e-4 relative, which is the bound (a data order that differed, a gradient summed
instead of averaged, or a rank's shard taken twice moves them by 1e-2 and more). The trained weights are compared
the same way, at lr-scaled absolute tolerance: AdamW's first update is lr * sign(g), so a gradient entry that is ~0
could flip sign under reordering and move one weight by 2 lr; the check is that (almost) all agree tightly.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mtpspec.models.heads import load_head
from mtpspec.models.qwen35 import HybridConfig, HybridLM
from mtpspec.train.heads import HeadConfig, train_head
from qwen35_tiny import randomize

REL = 1e-4  # the losses' bound, relative (see the docstring)
LR = 3e-3

TARGET = HybridConfig(
    vocab_size=16, hidden_size=32, num_layers=2, layer_types=("linear_attention", "full_attention"),
    num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=48, max_seq_len=128, linear_key_head_dim=8,
    linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4, mtp_num_layers=0, tie_embeddings=False,
)


class _DigitTokenizer:
    """Digits as tokens 1..10 after BOS 0."""

    def encode(self, text: str) -> list[int]:
        return [0] + [int(c) + 1 for c in text if c.isdigit()]


def _target() -> tuple[HybridLM, _DigitTokenizer]:
    torch.manual_seed(0)
    m = HybridLM(TARGET)
    randomize(m, 3)
    return m.eval(), _DigitTokenizer()


def _head_cfg(tmp: Path, out: str, **kw) -> HeadConfig:
    prompts = tmp / "prompts.txt"
    if not prompts.exists():
        prompts.write_text("\n".join(["1 2 3", "4 5 6 7", "8 9", "3 1 4 1 5", "9 2 6", "2 7 1 8", "6 6 6"]) + "\n")
    return HeadConfig(**{**dict(out=str(tmp / out), prompts=str(prompts), heldout_prompts=1, train_prompts=6, gen_tokens=16,
                                depth=2, steps=6, batch_size=4, seq_len=12, lr=LR, num_heads=2, num_kv_heads=2,
                                checkpoint_every=2, eval_prompts=0), **kw})


def _worker(rank: int, world: int, init: str, job, args: tuple) -> None:
    """One rank: joins the gloo group through a file, runs job(rank, *args), leaves."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    try:
        job(rank, *args)
    finally:
        dist.destroy_process_group()


def _spawn(tmp: Path, job, *args) -> None:
    mp.start_processes(_worker, args=(2, str(tmp / f"pg-{job.__name__}"), job, args), nprocs=2, start_method="spawn")


def _head_job(rank: int, tmp: Path, out: str, stop_after: int, cfg_kw: dict) -> None:
    """train_head on rank `rank`, recording what it writes; stop_after > 0: interrupted before that optimizer step."""
    import mtpspec.train.heads as heads
    import mtpspec.train.pretrain as pretrain

    writes: list[str] = []
    real_save, real_head, real_step = torch.save, heads.save_head, pretrain.optimizer_step
    torch.save = lambda obj, f, *a, **kw: (isinstance(f, (str, Path)) and writes.append(str(f)), real_save(obj, f, *a, **kw))[1]
    heads.save_head = lambda head, d, *a: (writes.append(str(d)), real_head(head, d, *a))[1]
    calls = []

    def step(*a, **kw):
        calls.append(1)
        if len(calls) == stop_after:
            raise KeyboardInterrupt
        return real_step(*a, **kw)

    pretrain.optimizer_step = step
    try:
        report = train_head("tiny", _head_cfg(tmp, out, **cfg_kw), target=_target(), progress_bar=False)
    except KeyboardInterrupt:
        report = {"interrupted": True}
    (tmp / f"{out}-rank{rank}.json").write_text(json.dumps({"report": report, "writes": writes}))


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= REL * max(1.0, abs(a))


def _same_history(a: list[dict], b: list[dict]) -> None:
    assert [h.keys() for h in a] == [h.keys() for h in b]
    for x, y in zip(a, b):
        assert all(_close(x[k], y[k]) for k in x), (x, y)


def _same_weights(a: dict, b: dict) -> None:
    """Every weight within 2 lr (one flipped first update), and 99.9% of them within 1e-5 of each other."""
    diffs = torch.cat([(a[k] - b[k]).abs().flatten() for k in a])
    assert a.keys() == b.keys() and diffs.max() <= 2 * LR
    assert (diffs <= 1e-5).float().mean() >= 0.999, diffs.max()


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The reference: one process over the whole global batch, the data cached for comparison."""
    tmp = tmp_path_factory.mktemp("one")
    report = train_head("tiny", _head_cfg(tmp, "out", data_cache=str(tmp / "data.pt")), target=_target(), progress_bar=False)
    return tmp, report


def test_two_processes_follow_one_and_only_rank_0_writes(tmp_path, one_process):
    ref_dir, ref = one_process
    _spawn(tmp_path, _head_job, tmp_path, "out", 0, {"data_cache": str(tmp_path / "data.pt")})
    r0, r1 = (json.loads((tmp_path / f"out-rank{r}.json").read_text()) for r in (0, 1))
    # the sharded self-distillation data, gathered, is the one-process data
    one, two = torch.load(ref_dir / "data.pt"), torch.load(tmp_path / "data.pt")
    assert len(one) == len(two) and all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(one, two))
    _same_history(r0["report"]["history"], ref["history"])
    _same_weights(load_head(tmp_path / "out").state_dict(), load_head(ref_dir / "out").state_dict())
    # one output, written by rank 0; rank 1 wrote nothing and reports nothing
    assert r1 == {"report": {}, "writes": [w for w in r1["writes"] if "partial-1-of-2" in w]}
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["head.json", "head.safetensors", "report.json"]
    assert [w for w in r0["writes"] if "/out" in w].count(str(tmp_path / "out")) == 1


def test_a_two_process_checkpoint_resumes_in_one_process(tmp_path, one_process):
    ref_dir, ref = one_process
    data = {"data_cache": str(ref_dir / "data.pt")}
    _spawn(tmp_path, _head_job, tmp_path, "out", 4, data)  # steps 0-2 done, the checkpoint of step 2 kept
    state = torch.load(tmp_path / "out" / "train_state.pt", weights_only=False)
    assert state["step"] == 2 and not any(k.startswith("module.") for k in state["head"])  # the bare head's state
    r1 = json.loads((tmp_path / "out-rank1.json").read_text())
    assert r1["writes"] == []
    report = train_head("tiny", _head_cfg(tmp_path, "out", **data), target=_target(), progress_bar=False)
    _same_history(report["history"], ref["history"])
    _same_weights(load_head(tmp_path / "out").state_dict(), load_head(ref_dir / "out").state_dict())
    assert not (tmp_path / "out" / "train_state.pt").exists()


def test_a_batch_that_does_not_split_is_refused(tmp_path):
    from mtpspec.errors import ConfigError
    from mtpspec.train.distributed import World

    with pytest.raises(ConfigError, match="--batch-size 5 is the global batch, split equally over 2 processes"):
        World(rank=1, size=2).check_batch(5)
    World(rank=0, size=2).check_batch(4)
    assert World(1, 2).mine(5) == [1, 3] and World(0, 2).shard(torch.arange(4)).tolist() == [0, 1]


def _pretrain_cfg(out: Path, steps: int):
    from mtpspec.train import data as D
    from mtpspec.train.pretrain import PretrainConfig

    train, held = D.stdlib_files()
    small = [f for f in train if f.name in ("abc.py", "bisect.py", "colorsys.py", "keyword.py", "glob.py")]
    return PretrainConfig(
        out=str(out), vocab_size=300, hidden_size=32, num_layers=4, num_heads=2, num_kv_heads=1, head_dim=16,
        intermediate_size=64, linear_key_heads=1, linear_value_heads=2, linear_head_dim=16, max_seq_len=256,
        seq_len=32, batch_size=4, steps=steps, eval_every=2, save_every=3, eval_windows=2, warmup_steps=2, lr=LR,
        mtp_depth=2, data_files=[str(p) for p in small], heldout_files=[str(held[0])],
    )


def _pretrain_job(rank: int, out: Path, steps: int) -> None:
    from mtpspec.train.pretrain import pretrain

    report = pretrain(_pretrain_cfg(out, steps), progress_bar=False)
    (out.parent / f"pretrain-rank{rank}.json").write_text(json.dumps(report))


@pytest.mark.slow  # ~15 s: pretraining's two processes beside one; the head's cases above keep DDP in the default suite
def test_pretraining_in_two_processes_follows_one(tmp_path):
    """`train pretrain` under DDP: the history (the global batch's train loss, rank 0's held-out loss) and the
    weights of one process over the same batch; rank 0 alone returns the report."""
    from safetensors.torch import load_file

    from mtpspec.train.pretrain import pretrain

    ref = pretrain(_pretrain_cfg(tmp_path / "one", 4), progress_bar=False)
    _spawn(tmp_path, _pretrain_job, tmp_path / "two", 4)
    two = json.loads((tmp_path / "pretrain-rank0.json").read_text())
    assert json.loads((tmp_path / "pretrain-rank1.json").read_text()) == {}
    strip = [{k: v for k, v in h.items() if k != "elapsed_s"} for h in two["history"]]
    _same_history(strip, [{k: v for k, v in h.items() if k != "elapsed_s"} for h in ref["history"]])
    _same_weights(load_file(str(tmp_path / "two" / "model.safetensors")), load_file(str(tmp_path / "one" / "model.safetensors")))


@pytest.mark.slow
def test_torchrun_runs_the_command_unchanged(tmp_path):
    """`python -m torch.distributed.run --nproc-per-node 2 -m mtpspec train head | mtp ...`: one report printed, one
    output; a batch that does not split is refused."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(f"Once upon a time there was a {w}." for w in ("cat", "dog", "king", "ship", "tree")) + "\n")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "mtpspec", "train", "head",
           "--model", "demo", "--out", str(tmp_path / "h"), "--prompts", str(prompts), "--heldout-prompts", "1",
           "--train-prompts", "4", "--gen-tokens", "16", "--steps", "3", "--batch-size", "2", "--seq-len", "16",
           "--eval-prompts", "1", "--eval-tokens", "8", "--no-progress"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=Path(__file__).resolve().parents[1], timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("\"heldout_greedy\"") == 1  # rank 0's report only
    assert (tmp_path / "h" / "head.safetensors").exists() and not (tmp_path / "h" / "train_state.pt").exists()
    bad = subprocess.run(cmd[:-1] + ["--batch-size", "3"], capture_output=True, text=True, env=env, timeout=300)
    assert bad.returncode != 0 and "--batch-size 3 is the global batch, split equally over 2 processes" in bad.stderr
    tune = cmd[:8] + ["mtp", "--model", "demo", "--out", str(tmp_path / "m"), "--prompts", str(prompts), "--heldout-prompts", "1",
                      "--train-prompts", "4", "--gen-tokens", "12", "--steps", "2", "--batch-size", "2", "--seq-len", "12",
                      "--depth", "1", "--eval-tokens", "8", "--no-progress"]
    r = subprocess.run(tune, capture_output=True, text=True, env=env, cwd=Path(__file__).resolve().parents[1], timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count('"mtp_layers_trained"') == 1 and (tmp_path / "m" / "mtp_tune_report.json").exists()

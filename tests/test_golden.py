"""Golden output on real weights: the upstream model card's greedy sample, byte for byte, via the CLI."""

import json

from mtpspec.cli import main


def test_golden_greedy_through_cli(assets, capsys):
    m = assets / "models"
    golden = (m / "stories260K_greedy_golden.txt").read_bytes()
    rc = main(["generate", "", "--model", str(m / "stories260K.bin"), "--tokenizer", str(m / "tok512.bin"),
               "--temperature", "0", "--max-new-tokens", "256", "--drafter", "none"])
    assert rc == 0
    out = capsys.readouterr().out
    assert out.encode("utf-8").rstrip(b"\n") == golden


def test_golden_json_and_every_drafter(assets, capsys):
    m = assets / "models"
    golden = (m / "stories260K_greedy_golden.txt").read_text(encoding="utf-8")
    for extra in (["--drafter", "none"], [], ["--drafter", "ngram", "--k", "4"], ["--drafter", "draft", "--draft-model", str(m / "stories260K_q80.bin"), "--k", "5"]):
        rc = main(["generate", "", "--model", str(m / "stories260K.bin"), "--tokenizer", str(m / "tok512.bin"),
                   "--max-new-tokens", "256", "--json", *extra])
        assert rc == 0
        obj = json.loads(capsys.readouterr().out)
        assert obj["text"] == golden
        assert len(obj["tokens"]) == 256 and obj["prompt_tokens"] == [1]
        st = obj["stats"]
        for key in ("target_forwards", "draft_tokens", "accepted_tokens", "mean_accepted_length",
                    "acceptance_by_position", "wall_seconds", "tokens_per_second"):
            assert key in st
        assert st["mean_accepted_length"] * st["target_forwards"] >= 256 - 1e-6

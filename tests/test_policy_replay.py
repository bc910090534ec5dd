"""scripts/policy_replay.py: L(p) recorded from the demo replays the engine's acceptance exactly, and the replay
loop drives a real policy through batch sizes that shrink as sequences leave."""

import importlib.util
from pathlib import Path

import mtpspec
from mtpspec.adaptive import ByBatchSize
from mtpspec.bench.harness import prepare_ids
from mtpspec.drafters import make_drafter
from mtpspec.engine import Engine
from mtpspec.prompts import load_prompts
from mtpspec.sampling import Sampler, SamplingParams

spec = importlib.util.spec_from_file_location("policy_replay", Path(__file__).parents[1] / "scripts" / "policy_replay.py")
replay_mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(replay_mod)


class Depths:
    """A fixed schedule of depths (one per step, cycled), recording each step's drafted and accepted."""

    def __init__(self, schedule: list[int]) -> None:
        self.schedule, self.t, self.steps = schedule, 0, []

    def next_depths(self, seqs, k_max):
        d = self.schedule[self.t % len(self.schedule)]
        self.t += 1
        return [min(d, k) for k in k_max]

    def observe(self, step) -> None:
        self.steps.append([(s.drafted, s.accepted) for s in step.seqs])

    def drop(self, seq) -> None: ...


def test_recorded_agreement_predicts_every_step_of_a_real_run():
    """Generated with depths 0-5 in turn, each drafting step of the demo accepts min(d, L(p)) at its position p."""
    table = replay_mod.record("demo", "humaneval", 2, 40, 8)
    model = mtpspec.load("demo", threads=1)
    for ids, row in zip(prepare_ids(model, load_prompts("humaneval", 2), 40), table):
        policy = Depths([3, 0, 5, 1, 2, 0, 4])
        engine = Engine(model.module, depth=policy)
        engine.add(ids, make_drafter("mtp", model.module), Sampler(SamplingParams()), 8, 40, model.tokenizer.stop_ids)
        engine.run()
        p, checked = 0, 0
        for [(drafted, accepted)] in policy.steps:
            if drafted:
                assert accepted == min(drafted, row[p]), (p, drafted, accepted, row[p])
                checked += 1
            p += accepted + 1
        assert checked >= 5


def test_replay_counts_steps_as_the_loop_does_and_runs_the_auto_policy():
    """L = 8 everywhere: fixed D = 3 emits 4 tokens a step, so a 32-token budget takes 8 steps per sequence; the auto
    policy runs through batch classes 1-7 as the sequences of a group of 7 leave one by one."""
    steps = []

    class Counting(replay_mod.Fixed):
        def observe(self, step) -> None:
            steps.append(len(step.seqs))

    replay_mod.replay(Counting(3), [[8] * 40] * 4, batch=2, rounds=1, budget=32)
    assert steps == [2] * 8 * 2
    table = [[8 if (p + i) % 5 else 0 for p in range(40)] for i in range(7)]
    ragged = [row[: 16 + 4 * i] for i, row in enumerate(table)]  # past its row, a sequence accepts nothing
    rate = replay_mod.replay(ByBatchSize(k_max=8), ragged, batch=7, rounds=2, budget=40, drift=0.05, spike=0.1)
    assert rate > 0


def test_a_queue_keeps_the_batch_full_where_groups_leave_a_tail():
    """A accepts 8 everywhere (D = 3: 8 steps for 32 tokens), B nothing (32 steps). Groups of 2 over [A, B, A]: A and B
    together for 8 steps, B alone for 24, then the last A alone for 8. A queue of the same three: the second A takes
    the first one's slot, so the batch stays at 2 for 16 steps, and only B's last 16 run alone."""
    a, b = [8] * 40, [0] * 40

    def sizes(**kw) -> list[int]:
        seen = []

        class Counting(replay_mod.Fixed):
            def observe(self, step) -> None:
                seen.append(len(step.seqs))

        replay_mod.replay(Counting(3), kw.pop("table"), batch=2, rounds=1, budget=32, **kw)
        return seen

    assert sizes(table=[a, b, a]) == [2] * 8 + [1] * 24 + [1] * 8
    assert sizes(table=[a, b], queue=3) == [2] * 16 + [1] * 16

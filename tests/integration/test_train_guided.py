"""Guided episodes in a real run (the main job: toolbench on 127.0.0.1, tiny-qwen3, the local trainer): the
random policy fails every group, so the first RL step's groups each get the oracle's member, trained with
policy shaping, and from `guidance_until_step` on none is guided."""
import pytest
from fixtures.runs import events_of, make_config, rewind, steps_by_number

from quaero.tools import review


@pytest.mark.slow
def test_a_run_guides_its_all_fail_groups_until_the_schedule_reaches_none(tmp_path):
    from quaero.recipe.train import train

    _, cfg = make_config(tmp_path, "guided", steps=3, warmup=0, eval_every=10, extra=[
        "guidance.mode=episode", "guidance.members=1", "guidance.until_step=2"])
    run = train(cfg)
    steps = events_of(run, "train_step")
    evals = events_of(run, "eval")
    assert evals and all(e["eval_guided_tokens"] == 0 for e in evals)  # evals never guide
    for e in evals:  # each episode's format beside its result: [index, malformed actions, actions]
        formats = e["eval_formats"]
        assert [f[0] for f in formats] == [r[0] for r in e["eval_results"]]
        assert all(0 <= bad <= actions for _, bad, actions in formats)
        assert e["eval_well_formed"] == round(sum(f[1] == 0 for f in formats) / len(formats), 6)
    assert any(f[1] > 0 for f in evals[0]["eval_formats"])  # the random-init policy writes malformed actions
    assert [s["phase"] for s in steps] == ["rl"] * 3
    first, *later = steps
    assert first["guidance_members"] == 1
    assert first["groups_guided"] == first["guided_members"] >= 1
    assert first["signal_groups_guided"] == first["signal_groups"] >= 1  # the random policy never succeeds
    assert first["guided_action_tokens"] > 0 and first["guided_tokens"] == first["guided_action_tokens"]
    assert first["onpolicy_action_tokens"] + first["guided_action_tokens"] == first["action_tokens"]
    low, mean, high = (first[f"guidance_shaping_{k}"] for k in ("min", "mean", "max"))
    assert 0 < low <= mean <= high < 1
    for s in later:  # RL steps 2 and 3: the schedule is at none
        assert s["guidance_members"] == 0 and s["groups_guided"] == 0 and s["guided_action_tokens"] == 0
        assert s["guidance_shaping_mean"] is None
    summary = review.summarize(review.load_run(run))  # the review says how much signal was guided
    g = summary.guidance
    assert (g.groups_guided, g.signal_groups_guided, g.guided_action_tokens) == (
        first["groups_guided"], first["signal_groups_guided"], first["guided_action_tokens"])
    line = review.guidance_line(g, summary.rl_vs_warm_start)
    assert line.startswith(f"guidance: {g.groups_guided} of {g.groups} ")
    assert line.endswith("RL over warm start not judged: no warm start")


def _weights(run_dir) -> bytes:
    return b"".join(p.read_bytes() for p in sorted((run_dir / "final").glob("*.safetensors")))


GUIDED_FIGURES = ("guidance_members", "groups_guided", "guided_members", "guided_members_succeeded",
                  "guided_action_tokens", "onpolicy_action_tokens", "guided_tokens", "loss", "grad_norm")


@pytest.mark.slow
def test_a_prefix_guided_run_resumed_mid_schedule_reaches_the_same_weights_bit_for_bit(tmp_path):
    """`prefix` guidance, k = 1 and 3 guide turns annealed to none at RL step 4 (3, 2, 1, 0 turns; max_turns
    is 2, so steps 1 and 2 are the guide's whole episodes and step 3 a 1-turn prefix the policy continues):
    resumed from its step-2 checkpoint (mid-schedule), the run guides the same groups with the same tokens as
    the unstopped one and ends on the same weights, bit for bit."""
    from quaero.recipe.train import train

    extra = ["guidance.mode=prefix", "guidance.members=1", "guidance.prefix_turns=3",
             "guidance.until_step=4"]
    _, cfg = make_config(tmp_path, "whole", steps=4, warmup=0, eval_every=0, eval_tasks=0, extra=extra)
    whole = train(cfg)  # checkpointed at steps 2 and 4 ([training] checkpoint_every = 2)
    want, weights = steps_by_number(whole), _weights(whole)
    rewind(whole, 2)  # back to step 2's checkpoint, and on from there
    resumed = train(cfg, resume=True)
    assert [e["step"] for e in events_of(resumed, "resumed")] == [2]
    got = steps_by_number(resumed)  # steps 3 and 4: the resumed run's events, logged after the first run's
    assert [want[s]["guidance_members"] for s in (1, 2, 3, 4)] == [1, 1, 1, 0]
    assert all(want[s]["guided_action_tokens"] > 0 for s in (1, 2))  # guided (with spread) before the cut
    assert want[3]["groups_guided"] >= 1 and want[4]["groups_guided"] == 0  # a prefix after it, then none
    assert want[3]["guided_tokens"] < want[2]["guided_tokens"]  # the prefix is shorter than a whole episode
    for s in (3, 4):
        assert {k: got[s][k] for k in GUIDED_FIGURES} == {k: want[s][k] for k in GUIDED_FIGURES}, s
    assert weights and _weights(resumed) == weights

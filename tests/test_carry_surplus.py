"""carry_surplus (training/sampling.py Sampling.logprob_passes, draws.choose_groups): the varied groups a batch
step's draws yield beyond batch_size are trained by the next batch step, ahead of its new draws, instead of
dropped. Checked against the rule written here from its definition, group by group and row by row; a checkpoint
drops them in the run that writes it as in the resumed one, so resume equals the uninterrupted run."""

from __future__ import annotations

import numpy as np
import pytest

from mlx_grpo.commands import assembly as assembly_mod
from mlx_grpo.commands import train as run_mod
from mlx_grpo.training.draws import choose_groups
from mlx_grpo.training.sampling import Sampling

from conftest import interrupt_before_update, run_metrics, same_last_checkpoint
from test_dynamic_waves import make_cfg, quarter_reward

CARRY = ("carry_surplus=true", "rollout_correction=token_truncate")


def test_choose_groups_against_the_definition():
    """The first batch_size varied groups in draw order are trained on, the next `keep` carried, the rest
    dropped: a walk over every draw's groups, on random flags."""
    rng = np.random.default_rng(0)
    for _ in range(300):
        B, n = int(rng.integers(1, 7)), int(rng.integers(1, 5))
        flags = [rng.random(B) < rng.random() for _ in range(n)]
        keep = int(rng.integers(0, B))
        trained, carried = [], []
        for i, f in enumerate(flags):
            for g in range(B):
                if f[g] and len(trained) < B:
                    trained.append((i, g))
                elif f[g] and len(carried) < keep:
                    carried.append((i, g))
        assert choose_groups(flags, B, keep) == (trained, carried)


def group_rows(draw, g: int) -> list[tuple]:
    """Group g's rows of a draw as (text, sampled ids, sampler log-probs), each cut to its own extent."""
    r, G = draw.rollout, draw.rollout.group_size
    ids, lps = np.array(r.completion_ids), np.array(r.sampler_logprobs)
    return [(r.texts[k], ids[k, :n].tolist(), lps[k, :n].tolist())
            for k, n in zip(range(g * G, (g + 1) * G), r.extents[g * G:(g + 1) * G])]


def batch_rows(rollout) -> list[tuple]:
    ids, lps = np.array(rollout.completion_ids), np.array(rollout.sampler_logprobs)
    return [(t, ids[k, :n].tolist(), lps[k, :n].tolist()) for k, (t, n) in enumerate(zip(rollout.texts,
                                                                                          rollout.extents))]


@pytest.mark.run  # a few seconds: a tiny model, 8 batch steps of up to 4 draws
def test_each_batch_step_trains_the_carried_groups_first(tiny_model_dir, tmp_path):
    """Batch step after batch step: the groups trained on are the carried ones, then the new draws' varied
    ones, the first batch_size of them; the next batch_size - 1 varied ones are carried, with their rows and
    rewards as sampled; groups_carried counts those trained from an earlier step."""
    cfg = make_cfg(tiny_model_dir, tmp_path,
                   quarter_reward(tmp_path), "batch_size=4", "max_train_samples=160", *CARRY)
    job = assembly_mod.build_job(cfg)
    s: Sampling = job.sampling
    B = cfg.training.batch_size
    steps = used = 0
    for _ in range(8):
        examples = s.next_examples()
        if examples is None:
            break
        carried = [(d, g) for d, mask in s.carried for g in np.flatnonzero(mask)]
        assert len(carried) <= B - 1
        batch = s.batch_step(examples)
        job.trainer.score(batch)
        varied = carried + [(d, int(g)) for d in batch.draws for g in np.flatnonzero(s.flags(d))]
        trained, left = varied[:B], varied[B:2 * B - 1]
        assert [(e.prompt, e.answer) for e in batch.stats.examples] == \
            [(d.examples[g].prompt, d.examples[g].answer) for d, g in trained]
        assert batch_rows(batch.rollout) == [row for d, g in trained for row in group_rows(d, g)]
        G = cfg.rollout.num_generations
        np.testing.assert_array_equal(batch.stats.rewards, np.concatenate(
            [d.scores.total[g * G:(g + 1) * G] for d, g in trained]))
        assert batch.stats.groups_carried == sum(1 for d, _ in trained if d not in batch.draws)
        assert [(d, int(g)) for d, mask in s.carried for g in np.flatnonzero(mask)] == left
        steps, used = steps + 1, used + batch.stats.groups_carried
    assert steps >= 4 and used > 0  # groups were carried and trained on


@pytest.mark.run
def test_resume_equals_uninterrupted_with_carried_groups(tiny_model_dir, tmp_path, monkeypatch):
    """A checkpoint drops the carried groups in the run that writes it and the run resumed from it starts with
    none: both continue alike, to the bit. A run that kept them past its checkpoint would differ."""
    items = (quarter_reward(tmp_path), "batch_size=2", "max_train_samples=64", "save_steps=2", *CARRY)
    full = run_mod.train(make_cfg(tiny_model_dir, tmp_path, "run_name=full", *items))
    want = run_metrics(full)
    assert len(want) >= 4 and want[2]["groups_carried"] == 0 and any(r["groups_carried"] for r in want)

    cfg = make_cfg(tiny_model_dir, tmp_path, "run_name=cut", *items)
    interrupt_before_update(run_mod.train, cfg, monkeypatch, 3)
    resumed = run_mod.train(cfg, resume="latest")
    assert run_metrics(resumed) == want
    assert same_last_checkpoint(full, resumed)

    with monkeypatch.context() as mp:  # groups carried across every checkpoint: no longer what a resume does
        mp.setattr(Sampling, "drop_carried", lambda self: None)
        kept = run_metrics(run_mod.train(make_cfg(tiny_model_dir, tmp_path, "run_name=kept", *items)))
    assert kept[:2] == want[:2] and kept != want


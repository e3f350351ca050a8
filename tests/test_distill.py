"""On-policy distillation through the trainer (loss-level math: tests/test_loss.py): a teacher's log-probs
reach the loss, pure distillation needs no reward function, the student moves towards the teacher, a teacher
that is the student gives no signal, and a teacher with another tokenizer or a missing setting is one line."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest

from caller_model import CALLER, write_caller_model
from mlx_grpo.base.errors import UserError
from mlx_grpo.commands import train as run_mod
from mlx_grpo.commands.assembly import build_job
from mlx_grpo.config import build_config, parse_set
from mlx_grpo.models.forward import completion_logprobs
from mlx_grpo.models.tiny import write_tiny_model
from mlx_grpo.training.policy import logprob_pass


def distill_cfg(student, teacher, out, *items):
    base = [f"model_name={student}", f"output_dir={out}", "batch_size=2", "num_generations=4", "max_new_tokens=8",
            "max_train_samples=8", "learning_rate=1e-2", "warmup_ratio=0", "log_completions_steps=0",
            "max_prompt_length=96", "system_prompt=", "kl_coeff=0", "save_steps=0", "model_dtype=float32"]
    extra = [f"teacher_model={teacher}", "distill_coeff=1"] if teacher is not None else []
    return build_config("train", overrides=parse_set(base + extra + list(items)))


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    """Another tiny llama with the student's tokenizer: the same architecture, other random weights."""
    return write_tiny_model(tmp_path_factory.mktemp("teacher") / "model", seed=5)


def rows(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_pure_distillation_moves_the_student_towards_the_teacher(tiny_model_dir, teacher_dir, tmp_path):
    """No reward function: the teacher is the only signal. The student's reverse KL to the teacher, measured
    on a fixed set of the student's samples before and after, falls."""
    cfg = distill_cfg(tiny_model_dir, teacher_dir, tmp_path, "reward_funcs=[]")
    job = build_job(cfg)
    steps = job.source.next()
    rollout = steps.batches[0].rollout
    job.close()

    def reverse_kl(student_dir):
        from mlx_lm import load

        student = load(str(student_dir))[0]
        s = logprob_pass(student, rollout, 1.0, 8, job.trainer.pad_id)
        t = logprob_pass(job.trainer.policies.teacher, rollout, 1.0, 8, job.trainer.pad_id)
        mask = mx.array(np.arange(s.shape[1])[None, :] < rollout.lengths[:, None])
        return ((s - t) * mask).sum().item() / mask.sum().item()

    run = run_mod.train(cfg)
    records = rows(run)
    assert len(records) == 4 and all(r["teacher_kl"] is not None and np.isfinite(r["loss"]) for r in records)
    assert all(r["reward_mean"] == 0.0 for r in records)  # no reward function: every completion scores 0
    before, after = reverse_kl(tiny_model_dir), reverse_kl(run / "checkpoint-4")
    assert after < before - 0.05, (before, after)


def test_a_teacher_that_is_the_student_gives_no_signal(tiny_model_dir, tmp_path):
    """The teacher's log-probs of the student's samples are the student's own: the logged reverse KL is 0 up
    to float32 rounding of the two passes."""
    run = run_mod.train(distill_cfg(tiny_model_dir, tiny_model_dir, tmp_path, "max_train_samples=2"))
    (record,) = rows(run)
    assert abs(record["teacher_kl"]) < 1e-5


def test_distillation_with_rewards_adds_to_grpo(tiny_model_dir, teacher_dir, tmp_path):
    """distill_coeff mixes the teacher into GRPO's reward advantages: both runs keep the rewards' figures,
    only the distilled one logs teacher_kl, and their updates differ."""
    grpo = run_mod.train(distill_cfg(tiny_model_dir, None, tmp_path, "run_name=grpo", "max_train_samples=2"))
    both = run_mod.train(distill_cfg(tiny_model_dir, teacher_dir, tmp_path, "run_name=both", "max_train_samples=2"))
    (a,), (b,) = rows(grpo), rows(both)
    assert "teacher_kl" not in a and "teacher_kl" in b and a["reward_mean"] == b["reward_mean"]
    assert a["loss"] != b["loss"]


def test_a_teacher_with_another_tokenizer_is_one_line(tiny_model_dir, tmp_path):
    other = write_caller_model(tmp_path / "other", CALLER)  # the student's byte tokenizer plus tool tokens
    with pytest.raises(UserError, match=r"teacher_model .* has a vocabulary of \d+ tokens, the student .* \d+: "
                                        r"on-policy distillation needs the same tokenizer"):
        build_job(distill_cfg(tiny_model_dir, other, tmp_path))


def test_a_resume_keeps_the_teacher_a_run_directory_stood_for(tiny_model_dir, tmp_path):
    """teacher_model = a run directory means its latest checkpoint when the run starts; a resume after that run
    wrote a later one is refused in one line naming the teacher the checkpoint was distilled from."""
    import shutil

    teacher_run = run_mod.train(distill_cfg(tiny_model_dir, None, tmp_path, "run_name=teacher", "save_steps=1",
                                            "max_train_samples=4"))
    cfg = distill_cfg(tiny_model_dir, teacher_run, tmp_path, "run_name=student", "max_train_samples=4")
    student = run_mod.train(cfg)
    state = json.loads((student / "checkpoint-2" / "trainer_state.json").read_text())
    assert state["teacher"] == str((teacher_run / "checkpoint-2").resolve())
    shutil.copytree(teacher_run / "checkpoint-2", teacher_run / "checkpoint-3")  # the teacher's run went on
    with pytest.raises(UserError, match=r"--resume: .*checkpoint-2 was distilled from the teacher .*teacher/checkpoint-2"
                                        r", and the teacher is now .*checkpoint-3: set teacher_model"):
        run_mod.train(cfg, resume="latest")


@pytest.mark.parametrize("items, message", [
    (["distill_coeff=1"], "distill_coeff > 0 needs a teacher: set teacher_model"),
    (["teacher_model=x", "distill_coeff=1", "dynamic_sampling=true"], "drop dynamic_sampling"),
    (["teacher_model=x", "distill_coeff=1", "demonstrations=zero_groups"], "demonstrations = \"off\""),
    (["teacher_model=x", "distill_coeff=1", "importance_sampling_level=sequence", "num_iterations=2"],
     "keep it token with distill_coeff"),
    (["teacher_model=x", "distill_coeff=1", "train_type=lora", "lora_dropout=0.1"], "set lora_dropout = 0"),
    (["teacher_model=x", "distill_coeff=1", "max_updates_without_signal=3"], "so it is off: drop it"),
    (["teacher_model=x"], "teacher_model only applies with distill_coeff > 0"),
    (["reward_funcs=[]"], "reward_funcs must name at least one reward function"),
])
def test_distillation_settings_that_cannot_act_are_refused(tiny_model_dir, tmp_path, items, message):
    with pytest.raises(UserError, match=message):
        distill_cfg(tiny_model_dir, None, tmp_path, *items)


# ----------------------------------------------------------------------------- distill_topk: the top-k forward KL

def test_topk_forward_kl_trains_and_is_logged(tiny_model_dir, teacher_dir, tmp_path, capsys):
    """distill_topk > 0: the teacher's top-k reaches the loss through the records, every update logs forward_kl,
    the update differs from the same run without it, and the student's forward KL to the teacher, measured on
    a fixed set of its samples before and after, falls."""
    cfg = distill_cfg(tiny_model_dir, teacher_dir, tmp_path, "reward_funcs=[]", "distill_topk=8", "run_name=topk")
    job = build_job(cfg)
    steps = job.source.next()
    batch = steps.batches[0]
    rollout, topk = batch.rollout, batch.teacher_topk
    teacher = job.trainer.policies.teacher
    job.close()
    assert topk.ids.shape == (*rollout.completion_ids.shape, 8) and topk.ids.dtype == mx.int32
    # the same pass gives the teacher's log-probs of the sampled tokens as the plain teacher pass
    np.testing.assert_allclose(np.array(batch.teacher_logprobs), np.array(logprob_pass(teacher, rollout, 1.0, 8,
                               job.trainer.pad_id)), rtol=1e-5, atol=1e-5)

    def forward_kl(student_dir):
        from mlx_lm import load

        from mlx_grpo.loss import topk_forward_kl
        from mlx_grpo.rollout.rollout_records import chunk_batch

        student = load(str(student_dir))[0]
        rows = mx.arange(len(rollout.texts))
        packed, width = chunk_batch(rollout, rows, job.trainer.pad_id)
        _, s = completion_logprobs(student, packed, 1.0, extra=topk.ids[:, :width])
        fkl = topk_forward_kl(s, topk.logprobs[:, :width])
        return ((fkl * packed.mask).sum() / packed.mask.sum()).item()

    run = run_mod.train(cfg)
    records = rows(run)
    assert len(records) == 4
    assert all(np.isfinite(r["forward_kl"]) and r["forward_kl"] > 0 and np.isfinite(r["loss"]) for r in records)
    before, after = forward_kl(tiny_model_dir), forward_kl(run / "checkpoint-4")
    assert after < before - 0.05, (before, after)
    assert "[mlx-grpo]   forward_kl: " in capsys.readouterr().out  # the summary's first -> last updates
    plain = run_mod.train(distill_cfg(tiny_model_dir, teacher_dir, tmp_path, "reward_funcs=[]", "run_name=plain"))
    assert "forward_kl" not in rows(plain)[0] and rows(plain)[0]["loss"] != records[0]["loss"]


def test_a_teacher_that_is_the_student_at_k_vocab_gives_zero_forward_kl(tiny_model_dir, tmp_path):
    """k = the vocabulary size: the top-k forward KL is the full forward KL, 0 for a teacher that is the student
    (up to float32 rounding of the teacher's pass and the training pass)."""
    vocab = json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
    run = run_mod.train(distill_cfg(tiny_model_dir, tiny_model_dir, tmp_path, "max_train_samples=2",
                                    f"distill_topk={vocab}"))
    (record,) = rows(run)
    assert abs(record["forward_kl"]) < 1e-5 and abs(record["teacher_kl"]) < 1e-5


def test_distill_topk_more_than_the_vocabulary_is_one_line(tiny_model_dir, teacher_dir, tmp_path):
    with pytest.raises(UserError, match=r"distill_topk = 100000 is more than the vocabulary's \d+ tokens"):
        build_job(distill_cfg(tiny_model_dir, teacher_dir, tmp_path, "distill_topk=100000"))


@pytest.mark.parametrize("items, message", [
    (["distill_topk=4"], "distill_topk > 0 adds to on-policy distillation"),
    (["teacher_model=x", "distill_coeff=1", "distill_topk_coeff=0.5"],
     "distill_topk_coeff only applies with distill_topk > 0"),
    (["teacher_model=x", "distill_coeff=1", "distill_topk=-1"], "distill_topk must be"),
    (["teacher_model=x", "distill_coeff=1", "distill_topk=4", "distill_topk_coeff=0"], "distill_topk_coeff must be"),
])
def test_distill_topk_settings_that_cannot_act_are_refused(tiny_model_dir, tmp_path, items, message):
    with pytest.raises(UserError, match=message):
        distill_cfg(tiny_model_dir, None, tmp_path, *items)


def test_topk_runs_compiled_and_with_layer_checkpointing_equal_the_plain_run(tiny_model_dir, teacher_dir, tmp_path):
    """The student's top-k log-probs through mx.compile and through recomputed layers: the same losses and
    forward_kl as the plain run."""
    def run(name, *items):
        cfg = distill_cfg(tiny_model_dir, teacher_dir, tmp_path, "max_train_samples=4", "distill_topk=8",
                          f"run_name={name}", *items)
        return [(r["loss"], r["forward_kl"]) for r in rows(run_mod.train(cfg))]

    plain = run("plain")
    assert len(plain) == 2
    for name, item in (("compiled", "use_compile=true"), ("checkpointed", "grad_checkpoint=true")):
        np.testing.assert_allclose(run(name, item), plain, rtol=1e-5, err_msg=name)

"""Mixed precision: float32 master weights under bfloat16 compute follow the float32 run; without them a
run whose updates would round away is refused with the share lost; the sampler/trainer mismatch metric."""

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlx_grpo.base.errors import UserError
from mlx_grpo.commands import train as run_mod
from mlx_grpo.commands.assembly import build_job
from mlx_grpo.config import build_config, parse_set
from mlx_grpo.models.precision import rounding_share
from mlx_grpo.rollout.decode import generate_rollout
from mlx_grpo.rollout.rollout_records import SamplingParams
from mlx_grpo.training.optimization import MasterWeights
from mlx_grpo.training.records import StepData
from mlx_grpo.training.records import UpdateSteps



def make_cfg(model_dir, out, *items):
    base = [f"model_name={model_dir}", f"output_dir={out}", "batch_size=2", "num_generations=4",
            "max_new_tokens=8", "max_train_samples=8", "warmup_ratio=0", "lr_scheduler_type=constant",
            "log_completions_steps=0", "max_prompt_length=96", "system_prompt=", "kl_coeff=0",
            "max_grad_norm=0"]
    return build_config("train", overrides=parse_set(base + list(items)))


def _fixed_steps(job, n_steps=3):
    """Rollouts sampled once from the float32 model, with fixed advantages, reused by every trainer."""
    from mlx_lm import load

    model, tok = load(str(job.cfg.model.model_name))
    steps = []
    for i in range(n_steps):
        prompts = [tok.encode(f"question {i} {j}") for j in range(2)]
        rollout = generate_rollout(model, tok, prompts, 4, SamplingParams(8, 1.0), mx.random.key(i))
        adv = mx.array(np.random.default_rng(i).normal(size=8).astype(np.float32))
        steps.append(StepData(rollout, adv, None, None))
    return steps


def _train(cfg, steps):
    job = build_job(cfg)
    for step in steps:
        job.trainer.update(UpdateSteps([step], job.sampling.position()))
    return job


def test_bf16_with_master_weights_follows_the_float32_run(tiny_model_dir, tmp_path):
    w0 = {k: np.array(v.astype(mx.float32)) for k, v in
          tree_flatten(__import__("mlx_lm").load(str(tiny_model_dir))[0].parameters())}
    fp32_cfg = make_cfg(tiny_model_dir, tmp_path, "model_dtype=float32", "learning_rate=1e-5")
    steps = _fixed_steps(build_job(fp32_cfg))
    ref = _train(fp32_cfg, steps)
    assert not ref.trainer.masters.active  # float32 compute needs no masters
    mixed = _train(make_cfg(tiny_model_dir, tmp_path, "model_dtype=bfloat16", "learning_rate=1e-5"), steps)
    assert mixed.trainer.masters.active
    a = {k: np.array(v) for k, v in tree_flatten(ref.model.parameters())}
    compute = dict(tree_flatten(mixed.model.parameters()))
    masters = mixed.trainer.masters.masters
    moved_ref = moved_master = total = 0
    for k, w in a.items():
        assert compute[k].dtype == mx.bfloat16 and masters[k].dtype == mx.float32
        # the compute copy is exactly the masters rounded to bfloat16
        assert mx.array_equal(compute[k], masters[k].astype(mx.bfloat16)), k
        m = np.array(masters[k])
        # the masters follow the float32 run: their update differs from its update by far less than its size
        delta = w - w0[k]
        assert np.linalg.norm(m - w) <= 0.1 * np.linalg.norm(delta) + 1e-12, k
        # and the bfloat16 weights are the float32 run's weights within bfloat16 rounding (1 spacing)
        spacing = 2.0 ** (np.floor(np.log2(np.maximum(np.abs(w), 1e-30))) - 7)
        close = np.abs(np.array(compute[k].astype(mx.float32)) - w) <= spacing
        assert close.mean() >= 0.99, (k, close.mean())
        moved_ref += int((delta != 0).sum())
        moved_master += int((m != w0[k]).sum())
        total += w.size
    assert moved_ref / total > 0.9 and moved_master / total > 0.9


def test_without_master_weights_a_run_that_rounds_away_is_refused(tiny_model_dir, tmp_path):
    cfg = make_cfg(tiny_model_dir, tmp_path, "model_dtype=bfloat16", "master_weights=false", "learning_rate=1e-6")
    with pytest.raises(UserError, match=r"bfloat16 weights without master weights.*\d+% of the trained weights"):
        build_job(cfg)
    # a learning rate large enough for bfloat16 trains without masters, in bfloat16 state
    job = build_job(make_cfg(tiny_model_dir, tmp_path, "model_dtype=bfloat16", "master_weights=false",
                                     "learning_rate=1e-1"))
    assert not job.trainer.masters.active


def test_rounding_share_counts_steps_below_half_a_spacing():
    w = mx.array([1.0, 1.0, 2.0 ** -10, 0.0])  # bf16 spacing at 1.0 is 2^-7; at 2^-10 it is 2^-17
    assert rounding_share({"w": w}, 1e-3, mx.bfloat16) == pytest.approx(0.5)  # both 1.0s: 1e-3 < 2^-8
    assert rounding_share({"w": w}, 1e-2, mx.bfloat16) == 0.0
    assert rounding_share({"w": w}, 1e-3, mx.float32) == 0.0


def test_master_weights_are_float32_and_adopt_a_checkpoint(tiny_model_dir):
    from mlx_lm import load

    model, _ = load(str(tiny_model_dir))
    masters = MasterWeights(model, enabled=True)
    assert all(v.dtype == mx.float32 for v in masters.arrays())
    saved = {k: v + 1 for k, v in masters.masters.items()}
    masters.adopt(saved)
    masters.sync(model)
    assert all(mx.array_equal(dict(tree_flatten(model.parameters()))[k], v) for k, v in saved.items())


def _metrics(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_mismatch_is_zero_when_sampler_and_trainer_are_one_float32_model(tiny_model_dir, tmp_path):
    run = run_mod.train(make_cfg(tiny_model_dir, tmp_path, "learning_rate=1e-3", "max_train_samples=4"))
    for row in _metrics(run):
        assert row["sampler_kl"] < 1e-6 and row["sampler_diff_max"] < 1e-4
        assert row["is_weight_mean"] == 1.0 and row["is_capped_fraction"] == 0.0


def test_a_sampler_that_differs_shows_the_mismatch_and_tis_truncates_it(tiny_model_dir, tmp_path, monkeypatch):
    """A sampler whose log-probs are 0.05 below the trainer's on every sampled token: the logged k3 KL is
    exp(0.05) - 0.05 - 1 per token and the largest difference 0.05; token_truncate caps every ratio
    exp(0.05) at the cap."""
    from mlx_grpo.rollout.engine import RolloutEngine

    real = RolloutEngine.generate_many

    def shifted(*args, **kwargs):
        rollouts = real(*args, **kwargs)
        for rollout in rollouts:
            rollout.sampler_logprobs = (rollout.sampler_logprobs - 0.05) * rollout.mask
        return rollouts

    monkeypatch.setattr(RolloutEngine, "generate_many", shifted)
    run = run_mod.train(make_cfg(tiny_model_dir, tmp_path, "learning_rate=1e-3", "max_train_samples=4",
                                 "rollout_correction=token_truncate", "rollout_correction_cap=1.01"))
    for row in _metrics(run):
        assert row["sampler_kl"] == pytest.approx(np.exp(0.05) - 0.05 - 1, rel=1e-3)
        assert row["sampler_diff_max"] == pytest.approx(0.05, rel=1e-3)
        assert row["is_capped_fraction"] == 1.0 and row["is_weight_mean"] == pytest.approx(1.01)


def test_resume_in_another_compute_dtype_is_refused(tiny_model_dir, tmp_path):
    run = run_mod.train(make_cfg(tiny_model_dir, tmp_path, "model_dtype=bfloat16", "learning_rate=1e-4",
                                 "max_train_samples=4"))
    # model_dtype itself is a setting that changes the run: refused by the config check, naming it
    with pytest.raises(UserError, match="model_dtype"):
        run_mod.train(make_cfg(tiny_model_dir, tmp_path, "model_dtype=float32", "learning_rate=1e-4",
                               "max_train_samples=4"), resume="latest")
    # the same config, but `auto` resolving to another dtype (another machine): refused by the weights' dtype
    cfg = make_cfg(tiny_model_dir, tmp_path, "model_dtype=bfloat16", "learning_rate=1e-4", "max_train_samples=4")
    from mlx_grpo.commands.assembly import build_job as build
    from mlx_grpo.storage import checkpoint as ckpt

    job = build(make_cfg(tiny_model_dir, tmp_path, "model_dtype=float32", "learning_rate=1e-4",
                         "max_train_samples=4"))
    path = run / "checkpoint-2"
    with pytest.raises(UserError, match="holds bfloat16 weights and this run computes in float32"):
        job.restore(path, (*ckpt.load_checkpoint(path), ckpt.load_masters(path)), False)
    assert cfg.model.model_dtype == "bfloat16"

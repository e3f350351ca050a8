"""Trainer behaviour on tiny random models: schedule, invariances, determinism, resume, NaN skips,
checkpoints that load, and a run where a simple reward measurably rises."""

import json
import math
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlx_grpo.base.errors import UserError
from mlx_grpo.commands import assembly as assembly_mod
from mlx_grpo.commands import train as run_mod
from mlx_grpo.commands.cli import main
from mlx_grpo.config import build_config, parse_set
from mlx_grpo.rewards.scoring import RewardScores
from mlx_grpo.rollout.decode import generate_rollout
from mlx_grpo.rollout.engine import RolloutEngine
from mlx_grpo.rollout.rollout_records import Rollout, SamplingParams
from mlx_grpo.training import trainer as trainer_mod
from mlx_grpo.training.draws import varied_groups
from mlx_grpo.training.optimization import accumulate_gradients, loss_weights, make_grad_fn
from mlx_grpo.training.records import StepData
from mlx_grpo.training.records import UpdateSteps
from mlx_grpo.training.step_sources import FreshSteps

from conftest import interrupt_before_update, run_metrics
from mlx_grpo.loss import group_advantages

FIXTURES = Path(__file__).parent / "fixtures"
def make_cfg(model_dir, out, *items):
    base = [f"model_name={model_dir}", f"output_dir={out}", "batch_size=2", "num_generations=4",
            "max_new_tokens=8", "max_train_samples=8", "learning_rate=1e-3", "warmup_ratio=0",
            "log_completions_steps=0", "max_prompt_length=96", "system_prompt="]
    return build_config("train", overrides=parse_set(base + list(items)))


metrics = run_metrics


def weights(path):
    """The trained tensors of a checkpoint: the whole model, or the adapters of a lora/dora run."""
    path = Path(path)
    return mx.load(str(path / ("adapters.safetensors" if (path / "adapters.safetensors").is_file()
                               else "model.safetensors")))


def assert_same_weights(a, b, atol=0.0):
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_allclose(np.array(a[k].astype(mx.float32)), np.array(b[k].astype(mx.float32)), atol=atol,
                                   rtol=0, err_msg=k)


def test_schedule_warmup_cosine_linear_constant():
    cfg = build_config("train", overrides=parse_set(["warmup_ratio=0.25", "learning_rate=1.0"]))
    lrs = [trainer_mod.learning_rate_at(u, 8, cfg) for u in range(1, 9)]
    assert lrs[0] == pytest.approx(0.5) and lrs[1] == pytest.approx(1.0)  # warmup: 2 updates, first > 0
    assert all(a >= b for a, b in zip(lrs[1:], lrs[2:])) and 0 < lrs[-1] < 0.1
    lin = build_config("train", overrides=parse_set(["warmup_ratio=0", "lr_scheduler_type=linear"]))
    assert trainer_mod.learning_rate_at(2, 4, lin) == pytest.approx(lin.optimizer.learning_rate * 0.75)
    const = build_config("train", overrides=parse_set(["warmup_ratio=0", "lr_scheduler_type=constant"]))
    assert trainer_mod.learning_rate_at(4, 4, const) == const.optimizer.learning_rate


def _split_rollout(r: Rollout, prompt: int) -> Rollout:
    G = r.group_size
    rows = slice(prompt * G, (prompt + 1) * G)
    return Rollout([r.prompt_ids[prompt]], r.completion_ids[rows], r.mask[rows], r.sampler_logprobs[rows],
                   r.truncated[rows], r.texts[rows], G)


@pytest.mark.parametrize("micro,max_tokens,loss_type", [(1, 0, "grpo"), (3, 0, "grpo"), (64, 0, "grpo"),
                                                     (64, 40, "grpo"), (3, 0, "dapo"), (3, 40, "dr_grpo"),
                                                     (3, 0, "cispo"), (3, 40, "sapo")])
def test_accumulation_1x8_equals_8x1(tiny_model_dir, tmp_path, micro, max_tokens, loss_type):
    """One batch step of 8 prompts == 8 accumulated steps of 1 (bnpo normalises per step by definition)."""
    from mlx_lm import load

    model, tok = load(str(tiny_model_dir))
    cfg = make_cfg(tiny_model_dir, tmp_path, "kl_coeff=0", f"loss_type={loss_type}")
    prompts = [tok.encode(f"question {i}" + "?" * i) for i in range(8)]
    big = generate_rollout(model, tok, prompts, 4, SamplingParams(8, 1.0), mx.random.key(0))
    rewards = mx.array(np.random.default_rng(0).normal(size=32).astype(np.float32))
    adv = group_advantages(rewards, 4)
    one = [StepData(big, adv, None, None)]
    eight = [StepData(_split_rollout(big, p), adv[p * 4:(p + 1) * 4], None, None) for p in range(8)]
    step = make_grad_fn(cfg, model)
    g1, sums1 = accumulate_gradients(step, one, loss_weights(cfg, one), micro, 0, max_tokens)
    g8, sums8 = accumulate_gradients(step, eight, loss_weights(cfg, eight), micro, 0, max_tokens)
    for a, b in zip(sums1, sums8):
        assert a.item() == pytest.approx(b.item(), rel=1e-5, abs=1e-7)
    for (k, a), (_, b) in zip(tree_flatten(g1), tree_flatten(g8)):
        np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-4, atol=1e-7, err_msg=k)
    assert any(float(mx.abs(a).max()) > 0 for _, a in tree_flatten(g1))  # not a vacuous comparison


@pytest.mark.parametrize("loss_type,same_as,compiled", [("cispo", "dapo", False), ("sapo", "grpo", False),
                                                       ("cispo", "dapo", True), ("sapo", "grpo", True)])
def test_cispo_sapo_on_policy_gradients_equal_their_clipped_counterparts(tiny_model_dir, tmp_path, loss_type,
                                                                         same_as, compiled):
    """On-policy (ratio 1) CISPO's weight is 1 and SAPO's gate has slope 1: through the real model, CISPO's
    gradient is DAPO's (both token means) and SAPO's is GRPO's (both per-sequence means), compiled too."""
    from mlx_lm import load

    model, tok = load(str(tiny_model_dir))
    prompts = [tok.encode(f"question {i}" + "?" * i) for i in range(4)]
    r = generate_rollout(model, tok, prompts, 4, SamplingParams(8, 1.0), mx.random.key(2))
    adv = group_advantages(mx.array(np.random.default_rng(1).normal(size=16).astype(np.float32)), 4)
    steps = [StepData(r, adv, None, None)]
    grads = {}
    for name in (loss_type, same_as):
        cfg = make_cfg(tiny_model_dir, tmp_path, "kl_coeff=0", f"loss_type={name}", f"use_compile={compiled}")
        grads[name], _ = accumulate_gradients(make_grad_fn(cfg, model), steps, loss_weights(cfg, steps), 3, 0)
    for (k, a), (_, b) in zip(tree_flatten(grads[loss_type]), tree_flatten(grads[same_as])):
        np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-4, atol=1e-7, err_msg=k)
    assert any(float(mx.abs(a).max()) > 0 for _, a in tree_flatten(grads[loss_type]))


@pytest.mark.parametrize("bucket", [64, 128])  # 128: the packed widths on a CUDA GPU
def test_micro_batches_respect_row_and_token_limits(tiny_model_dir, monkeypatch, bucket):
    """Every row lands in exactly one micro-batch; each holds at most `size` rows and, when it has more
    than one row, at most max_tokens tokens in the packed batch itself; longest completions first."""
    from mlx_lm import load

    from mlx_grpo.models import forward
    monkeypatch.setattr(forward, "pack_bucket", lambda: bucket)

    from mlx_grpo.rollout.rollout_records import chunk_batch as _chunk_batch
    from mlx_grpo.rollout.rollout_records import row_chunks

    model, tok = load(str(tiny_model_dir))
    prompts = [tok.encode(f"q{i}" + "?" * (3 * i)) for i in range(6)]
    r = generate_rollout(model, tok, prompts, 3, SamplingParams(10, 1.0), mx.random.key(1))
    for size, max_tokens in [(4, 0), (18, 200), (18, 400), (18, 1)]:
        chunks = row_chunks(r, size, max_tokens)
        order = sum((c.tolist() for c in chunks), [])
        assert sorted(order) == list(range(18))
        assert [int(r.lengths[i]) for i in order] == sorted(r.lengths.tolist(), reverse=True)
        for c in chunks:
            packed = _chunk_batch(r, c, 0)[0].inputs  # what the model actually gets
            assert packed.shape[1] % bucket == 0
            assert c.size <= size
            assert c.size == 1 or not max_tokens or packed.size <= max_tokens
        if max_tokens == 400:
            assert 1 < max(c.size for c in chunks) < 18  # the budget binds without being vacuous
    assert len(row_chunks(r, 18, 1)) == 18  # a row is never split, even past the budget


def test_one_update_changes_weights_loss_finite(tiny_model_dir, tmp_path):
    cfg = make_cfg(tiny_model_dir, tmp_path, "max_train_samples=2", "save_steps=0",
                   f"reward_funcs={FIXTURES / 'toy_rewards.py'}:share_of_even_ids")
    run = run_mod.train(cfg)
    rows = metrics(run)
    assert len(rows) == 1 and np.isfinite(rows[0]["loss"]) and rows[0]["grad_norm"] > 0
    before = dict(tree_flatten(__import__("mlx_lm").load(str(tiny_model_dir))[0].parameters()))
    after = weights(run / "checkpoint-1")
    assert any(not np.allclose(np.array(before[k]), np.array(after[k])) for k in after)


def test_same_seed_same_run(tiny_model_dir, tmp_path):
    a = run_mod.train(make_cfg(tiny_model_dir, tmp_path, "run_name=a"))
    b = run_mod.train(make_cfg(tiny_model_dir, tmp_path, "run_name=b"))
    assert metrics(a) == metrics(b)
    assert_same_weights(weights(a / "checkpoint-4"), weights(b / "checkpoint-4"))
    c = run_mod.train(make_cfg(tiny_model_dir, tmp_path, "run_name=c", "seed=7"))
    assert metrics(c) != metrics(a)


@pytest.mark.parametrize("extra", [[], ["update_every=2", "kl_coeff=0.1"], ["num_iterations=2"],
                                   ["train_type=lora", "kl_coeff=0.1", "learning_rate=1e-2"],
                                   ["train_type=dora", "update_every=2", "lora_dropout=0.2", "lora_rank=4"],
                                   ["dynamic_sampling=true", "max_train_samples=16",
                                    f"reward_funcs={FIXTURES / 'toy_rewards.py'}:flat_unless_even_answer"],
                                   ["model_dtype=bfloat16", "learning_rate=1e-4"],
                                   # training/health.py's state: the plateau warning (update 2) is not given again
                                   ["plateau_updates=2", "reward_funcs="
                                    f"{FIXTURES / 'toy_rewards.py'}:share_of_even_ids,correctness"],
                                   # the rollout engine's sampling copy, refreshed after updates and on resume
                                   ["rollout_engine=copy", "learning_rate=1e-2"],
                                   ["rollout_engine=copy", "train_type=lora", "update_every=2", "kl_coeff=0.1",
                                    "learning_rate=1e-2"],
                                   ["rollout_engine=copy", "model_dtype=bfloat16", "learning_rate=1e-4"]])
def test_resume_equals_uninterrupted(tiny_model_dir, tmp_path, monkeypatch, extra):
    full = run_mod.train(make_cfg(tiny_model_dir, tmp_path, "run_name=full", "save_steps=2", *extra))
    cfg = make_cfg(tiny_model_dir, tmp_path, "run_name=cut", "save_steps=2", *extra)
    interrupt_before_update(run_mod.train, cfg, monkeypatch, 3 if "num_iterations=2" not in extra else 5)
    with pytest.raises(UserError, match="--resume"):
        run_mod.train(cfg)  # nothing is overwritten without --resume
    resumed = run_mod.train(cfg, resume="latest")
    assert metrics(resumed) == metrics(full)
    last = max(int(p.name.split("-")[1]) for p in full.glob("checkpoint-*"))
    assert_same_weights(weights(full / f"checkpoint-{last}"), weights(resumed / f"checkpoint-{last}"))
    masters = full / f"checkpoint-{last}" / "master_weights.safetensors"
    if "model_dtype=bfloat16" in extra:  # bfloat16 compute: float32 masters, resumed exactly too
        assert all(v.dtype == mx.float32 for v in mx.load(str(masters)).values())
        assert all(v.dtype == mx.bfloat16 for v in weights(full / f"checkpoint-{last}").values())
        assert_same_weights(mx.load(str(masters)), mx.load(str(resumed / f"checkpoint-{last}" / masters.name)))


def test_nan_update_is_skipped_and_reported(tiny_model_dir, tmp_path, monkeypatch):
    real = trainer_mod.accumulate_gradients
    calls = {"n": 0}

    def poisoned(*args):
        grads, sums = real(*args)
        calls["n"] += 1
        if calls["n"] == 2:
            sums = sums._replace(loss=mx.array(float("nan")))
        return grads, sums

    monkeypatch.setattr(trainer_mod, "accumulate_gradients", poisoned)
    run = run_mod.train(make_cfg(tiny_model_dir, tmp_path, "save_steps=1"))
    rows = metrics(run)
    assert [r["skipped"] for r in rows] == [False, True, False, False]
    assert rows[-1]["skipped_total"] == 1
    assert_same_weights(weights(run / "checkpoint-1"), weights(run / "checkpoint-2"))  # never written


def test_consecutive_nan_aborts(tiny_model_dir, tmp_path, monkeypatch):
    real = trainer_mod.accumulate_gradients

    def always_nan(*args):
        grads, sums = real(*args)
        return grads, sums._replace(loss=mx.array(float("nan")))

    monkeypatch.setattr(trainer_mod, "accumulate_gradients", always_nan)
    with pytest.raises(UserError, match="2 consecutive updates"):
        run_mod.train(make_cfg(tiny_model_dir, tmp_path, "max_consecutive_skips=2"))


def test_simple_reward_rises(tiny_model_dir, tmp_path):
    """Learning really happens: a tiny model learns to sample more even token ids."""
    cfg = make_cfg(tiny_model_dir, tmp_path, "max_train_samples=0", "num_generations=8", "batch_size=2",
                   "learning_rate=3e-3", "lr_scheduler_type=constant", "kl_coeff=0", "max_grad_norm=1.0",
                   "num_epochs=1", "save_steps=0", f"reward_funcs={FIXTURES / 'toy_rewards.py'}:share_of_even_ids",
                   "max_train_samples=60")
    rows = metrics(run_mod.train(cfg))
    first = np.mean([r["reward_mean"] for r in rows[:5]])
    last = np.mean([r["reward_mean"] for r in rows[-5:]])
    assert last > first + 0.1, (first, last)


def test_checkpoint_loads_in_generate(tiny_model_dir, tmp_path, capsys):
    run = run_mod.train(make_cfg(tiny_model_dir, tmp_path, "max_train_samples=2"))
    ckpt = run / "checkpoint-1"
    names = {p.name for p in ckpt.iterdir()}
    assert {"model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json",
            "optimizer.safetensors", "trainer_state.json", "config.resolved.json"} <= names
    assert main(["generate", "--model", str(ckpt), "--prompt", "hi", "--max-tokens", "4"]) == 0
    assert json.loads((run / "config.resolved.json").read_text())["batch_size"] == 2


@pytest.mark.parametrize("extra", [[], ["train_type=lora", "kl_coeff=0.1", "learning_rate=1e-2"],
                                   ["train_type=lora", "lora_dropout=0.3"],
                                   ["train_type=dora", "grad_checkpoint=true", "learning_rate=1e-2"],
                                   ["kl_coeff=0"], ["model_dtype=bfloat16", "kl_coeff=0.1"]])
def test_compiled_step_matches_eager(tiny_model_dir, tmp_path, extra):
    eager = run_mod.train(make_cfg(tiny_model_dir, tmp_path, "run_name=e", "max_train_samples=4", *extra))
    compiled = run_mod.train(make_cfg(tiny_model_dir, tmp_path, "run_name=c", "max_train_samples=4",
                                          "use_compile=true", *extra))
    for a, b in zip(metrics(eager), metrics(compiled)):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4, abs=1e-6)
    assert_same_weights(weights(eager / "checkpoint-2"), weights(compiled / "checkpoint-2"), atol=1e-5)


def test_quantized_rollouts_run(tiny_model_dir, tmp_path):
    run = run_mod.train(make_cfg(tiny_model_dir, tmp_path, "quantize_for_rollouts=true",
                                     "max_train_samples=4", "micro_batch_size=3"))
    rows = metrics(run)
    assert len(rows) == 2 and all(np.isfinite(r["loss"]) for r in rows)


def test_grad_checkpoint_without_effect_is_reported(tiny_model_dir, tmp_path, monkeypatch, capsys):
    assembly_mod.build_job(make_cfg(tiny_model_dir, tmp_path, "grad_checkpoint=true"))
    assert "grad_checkpoint has no effect" not in capsys.readouterr().out  # llama layers are recomputed
    monkeypatch.setattr(assembly_mod, "supports_layer_checkpointing", lambda model: False)
    assembly_mod.build_job(make_cfg(tiny_model_dir, tmp_path, "grad_checkpoint=true"))
    assert "grad_checkpoint has no effect for model type 'llama'" in capsys.readouterr().out


def test_copy_settings_off_the_copy_are_reported(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """running_rows and lookahead shape the sampling copy's loop: where auto picks the model path (a CPU here),
    the run says they are ignored; where the copy samples, nothing is said."""
    monkeypatch.setattr(assembly_mod, "uses_copy", lambda mode, model: False)
    assembly_mod.build_job(make_cfg(tiny_model_dir, tmp_path, "running_rows=8", "lookahead=2"))
    assert "warning: running_rows and lookahead shape the sampling copy's decode, and rollouts decode on the model " \
           "itself here (rollout_engine = auto): ignored" in capsys.readouterr().out
    monkeypatch.setattr(assembly_mod, "uses_copy", lambda mode, model: True)
    assembly_mod.build_job(make_cfg(tiny_model_dir, tmp_path, "running_rows=8", "lookahead=2"))
    assert "sampling copy's decode" not in capsys.readouterr().out
    monkeypatch.setattr(assembly_mod, "uses_copy", lambda mode, model: False)
    assembly_mod.build_job(make_cfg(tiny_model_dir, tmp_path))  # the defaults: nothing to say
    assert "sampling copy's decode" not in capsys.readouterr().out
    assembly_mod.build_job(make_cfg(tiny_model_dir, tmp_path, "lookahead=3"))
    assert "warning: lookahead shapes the sampling copy's decode" in capsys.readouterr().out
    assembly_mod.build_job(make_cfg(tiny_model_dir, tmp_path, "running_rows=8", "lookahead=3", "decode_graph=true"))
    assert "warning: running_rows, lookahead and decode_graph shape the sampling copy's decode" \
        in capsys.readouterr().out


# ----------------------------------------------------------------------------- objective options, adapters

def test_lora_trains_only_adapters_and_its_reference_is_the_base(tiny_model_dir, tmp_path):
    from mlx_lm import load

    from mlx_grpo.training.policy import logprob_pass

    cfg = make_cfg(tiny_model_dir, tmp_path, "train_type=lora", "kl_coeff=0.04", "learning_rate=1e-2",
                   f"reward_funcs={FIXTURES / 'toy_rewards.py'}:share_of_even_ids")
    t = assembly_mod.build_job(cfg)
    before = {k: mx.array(v) for k, v in tree_flatten(t.model.parameters())}
    trainable = {k for k, _ in tree_flatten(t.model.trainable_parameters())}
    assert trainable and all(k.endswith(("lora_a", "lora_b")) for k in trainable)
    for _ in range(2):
        step = t.sampling.batch_step(t.sampling.next_examples())
        t.trainer.update(UpdateSteps([step], t.sampling.position()))
    after = dict(tree_flatten(t.model.parameters()))
    changed = {k for k in after if not np.array_equal(np.array(after[k]), np.array(before[k]))}
    assert changed and changed <= trainable  # the base weights are bitwise unchanged
    assert {k for k, _ in tree_flatten(t.trainer.optimizer.state) if k.endswith(("m", "v"))} <= \
        {f"{k}.{s}" for k in trainable for s in ("m", "v")}
    # The KL reference is the base model: the same log-probs as the model loaded afresh, with no copy.
    assert t.trainer.policies.reference is None
    base, _ = load(str(tiny_model_dir))
    ref = t.trainer.policies.reference_logprobs(step.rollout, t.trainer.pad_id)
    plain = logprob_pass(base, step.rollout, cfg.rollout.temperature, cfg.training.micro_batch_size, t.trainer.pad_id,
                         cfg.training.micro_batch_tokens)
    np.testing.assert_array_equal(np.array(ref), np.array(plain))
    adapted = logprob_pass(t.model, step.rollout, cfg.rollout.temperature, cfg.training.micro_batch_size, t.trainer.pad_id, 0)
    assert not np.allclose(np.array(adapted), np.array(plain))  # the adapters are trained, and on again
    t.run_dir.mkdir(parents=True)
    ckpt = t.save()
    names = {p.name for p in ckpt.iterdir()}
    assert {"adapters.safetensors", "adapter_config.json"} <= names and "model.safetensors" not in names


@pytest.fixture(scope="module")
def wider_model_dir(tmp_path_factory):
    """Hidden size 64: the layers' inputs are whole quantization groups (QLoRA)."""
    from conftest import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("wide") / "model", hidden=64)


def test_qlora_run_generate_and_fuse(wider_model_dir, tmp_path, capsys):
    cfg = make_cfg(wider_model_dir, tmp_path, "train_type=lora", "load_in_bits=4", "kl_coeff=0.04",
                   "max_train_samples=4", "learning_rate=1e-2", "save_steps=0")
    t = assembly_mod.build_job(cfg)
    assert any(k.endswith(".scales") for k, _ in tree_flatten(t.model.parameters()))  # the base is 4-bit
    run = run_mod.train(cfg)
    rows = metrics(run)
    assert len(rows) == 2 and all(np.isfinite(r["loss"]) for r in rows)
    ckpt = run / "checkpoint-2"
    assert main(["generate", "--model", str(ckpt), "--prompt", "hi", "--max-tokens", "4"]) == 0
    fused = tmp_path / "fused"
    assert main(["fuse", "--checkpoint", str(ckpt), "--output-dir", str(fused), "--dequantize"]) == 0
    assert main(["generate", "--model", str(fused), "--prompt", "hi", "--max-tokens", "4"]) == 0
    assert main(["fuse", "--checkpoint", str(ckpt), "--output-dir", str(fused)]) == 2  # exists: one line
    assert "already exists" in capsys.readouterr().err


def test_quantized_base_needs_adapters(wider_model_dir, tmp_path):
    with pytest.raises(UserError, match="train_type"):
        build_config("train", overrides=parse_set(["load_in_bits=4"]))  # full training: the field does nothing
    with pytest.raises(UserError, match="load_in_bits must be"):
        build_config("train", overrides=parse_set(["train_type=lora", "load_in_bits=3"]))


def test_masked_truncation_leaves_truncated_completions_out(tiny_model_dir, tmp_path, capsys):
    """A random tiny model never ends within 8 tokens: with masking nothing enters the loss, so the
    update is skipped (weights unchanged) and the log says why; without masking the weights move."""
    masked = run_mod.train(make_cfg(tiny_model_dir, tmp_path, "run_name=m", "max_train_samples=2",
                                        "mask_truncated_completions=true"))
    plain = run_mod.train(make_cfg(tiny_model_dir, tmp_path, "run_name=p", "max_train_samples=2"))
    out = capsys.readouterr().out
    assert "no completion entered the loss" in out
    row = metrics(masked)[0]
    assert row["truncated_fraction"] == 1.0 and row["loss"] is None and row["loss_tokens"] == 0
    assert "truncated" in row["warnings"] and "hit max_new_tokens" in out
    initial = dict(tree_flatten(__import__("mlx_lm").load(str(tiny_model_dir))[0].parameters()))
    assert_same_weights(weights(masked / "checkpoint-1"), {k: initial[k] for k in weights(masked / "checkpoint-1")})
    assert metrics(plain)[0]["loss_tokens"] > 0


def test_loss_weights_zero_exactly_the_truncated_rows(tiny_model_dir, tmp_path):
    from mlx_grpo.training.optimization import loss_weights

    r = Rollout([[1], [2]], mx.zeros((4, 3), dtype=mx.int32), mx.array([[1, 1, 1], [1, 0, 0], [1, 1, 0], [1, 1, 1.0]]),
                mx.zeros((4, 3)), np.array([True, False, False, True]), ["a"] * 4, 2)
    step = StepData(r, mx.zeros(4), None, None)
    for loss_type, expected in (("grpo", [0, 1 / 4, 1 / 8, 0]), ("dapo", [0, 1 / 3, 1 / 3, 0])):
        cfg = make_cfg(tiny_model_dir, tmp_path, "mask_truncated_completions=true", f"loss_type={loss_type}",
                       "max_new_tokens=3")
        np.testing.assert_allclose(np.array(loss_weights(cfg, [step])[0]), expected, rtol=1e-6)
    cfg = make_cfg(tiny_model_dir, tmp_path, "loss_type=dapo", "max_new_tokens=3")
    np.testing.assert_allclose(np.array(loss_weights(cfg, [step])[0]), [1 / 9] * 4, rtol=1e-6)


def test_dynamic_sampling_trains_only_informative_groups(tiny_model_dir, tmp_path, capsys):
    """Questions with odd answers give flat groups: they are dropped, more prompts are drawn, and every
    trained group has reward variance; the report says how many draws each update made."""
    rewards = f"reward_funcs={FIXTURES / 'toy_rewards.py'}:flat_unless_even_answer"
    cfg = make_cfg(tiny_model_dir, tmp_path, rewards, "dynamic_sampling=true", "max_train_samples=24",
                   "log_completions_steps=1", "max_resample_batches=2")
    run = run_mod.train(cfg)
    rows = metrics(run)
    assert sum(r["draws"] for r in rows) > len(rows)  # extra draws happened
    assert all(r["groups_trained"] <= 2 for r in rows) and any(r["groups_trained"] == 2 for r in rows)
    assert len(rows) < 12  # the data (12 batches) ran out before 12 updates
    peak = cfg.optimizer.learning_rate  # the schedule follows the data consumed: the last update is at its end
    assert rows[-1]["lr"] == pytest.approx(trainer_mod.learning_rate_at(12, 12, cfg)) and rows[-1]["lr"] < 0.05 * peak
    out = capsys.readouterr().out
    assert "the training data ran out" in out
    # the ETA follows the data left at the run's draws per update: 0 once the data is drawn, not 12 - updates
    assert [line for line in out.splitlines() if line.startswith("[mlx-grpo] update ")][-1].endswith("ETA 0s")
    completions = [json.loads(x) for x in (run / "completions.jsonl").read_text().splitlines()]
    assert completions and all(int(c["answer"]) % 2 == 0 for c in completions)  # only informative groups
    plain = run_mod.train(make_cfg(tiny_model_dir, tmp_path, rewards, "run_name=plain", "max_train_samples=24",
                                       "log_completions_steps=1"))
    assert len(metrics(plain)) == 12 and all(r["draws"] == 1 for r in metrics(plain))
    odd = [c for c in (json.loads(x) for x in (plain / "completions.jsonl").read_text().splitlines())
           if int(c["answer"]) % 2]
    assert odd and all(c["advantage"] == 0 for c in odd)


def test_varied_groups_total_named_and_not_applicable():
    """A group is varied when its scores differ; None (NaN) counts as 0, as in the total."""
    per = {"fmt": np.array([0, 0.5, 0, 0, 1, 1, np.nan, np.nan], np.float32),
           "correct": np.array([0, 0, 1, 1, np.nan, 1, np.nan, np.nan], np.float32)}
    total = np.nan_to_num(per["fmt"]) + np.nan_to_num(per["correct"])
    scores = RewardScores(["fmt", "correct"], per, total)
    assert varied_groups(scores, 2).tolist() == [True, False, True, False]
    assert varied_groups(scores, 2, "correct").tolist() == [False, False, True, False]  # [None, 1] = [0, 1]
    assert varied_groups(scores, 2, "fmt").tolist() == [True, False, False, False]  # never applies: not varied
    tiny = RewardScores(["p"], {"p": np.array([1e-30, 0.0], np.float32)}, np.array([1e-30, 0.0], np.float32))
    assert varied_groups(tiny, 2).tolist() == [True]  # any difference, however small


def test_dynamic_sampling_keyed_on_one_reward_drops_groups_that_differ_only_in_another(tiny_model_dir, tmp_path):
    """With two rewards, every group differs in share_of_even_ids; keyed on flat_unless_even_answer, only the
    even-answer questions' groups (the ones that differ in it) are trained, as DAPO keeps groups by accuracy."""
    toy = FIXTURES / "toy_rewards.py"
    both = f'reward_funcs=["{toy}:flat_unless_even_answer","{toy}:share_of_even_ids"]'
    common = (both, "dynamic_sampling=true", "max_train_samples=24", "log_completions_steps=1",
              "max_resample_batches=2")

    def trained_answers(run):
        return [int(json.loads(x)["answer"]) for x in (run / "completions.jsonl").read_text().splitlines()]
    total = trained_answers(run_mod.train(make_cfg(tiny_model_dir, tmp_path, *common)))
    assert any(a % 2 for a in total)  # the total differs in every group: odd-answer groups are kept
    keyed = run_mod.train(make_cfg(tiny_model_dir, tmp_path, *common, "run_name=keyed",
                                   "dynamic_sampling_reward=flat_unless_even_answer"))
    answers = trained_answers(keyed)
    assert answers and all(a % 2 == 0 for a in answers)
    assert sum(r["draws"] for r in metrics(keyed)) > len(metrics(keyed))  # more prompts drawn to fill the steps


def test_overlong_penalty_enters_reward_and_metrics(tiny_model_dir, tmp_path):
    run = run_mod.train(make_cfg(tiny_model_dir, tmp_path, "max_train_samples=2", "overlong_penalty=0.5",
                                     "overlong_buffer=4", "log_completions_steps=1"))
    row = metrics(run)[0]
    assert row["reward/overlong_penalty"] == pytest.approx(-0.5)  # every completion runs to max_new_tokens
    c = json.loads((run / "completions.jsonl").read_text().splitlines()[0])
    assert c["rewards"]["overlong_penalty"] == -0.5


def test_update_metrics_report_clipping_ratio_and_entropy(tiny_model_dir, tmp_path):
    run = run_mod.train(make_cfg(tiny_model_dir, tmp_path, "max_train_samples=2", "num_iterations=2",
                                     "learning_rate=5e-2", "clip_eps=0.05",
                                     f"reward_funcs={FIXTURES / 'toy_rewards.py'}:share_of_even_ids"))
    first, second = metrics(run)
    assert first["ratio_min"] == first["ratio_max"] == 1.0 and first["clip_fraction"] == 0.0
    assert second["ratio_min"] < 1.0 < second["ratio_max"]  # the second pass sees a moved policy
    assert second["clip_fraction"] == pytest.approx(second["clip_low_fraction"] + second["clip_high_fraction"])
    assert 0 < first["entropy"] <= math.log(259) + 1e-3  # at most log V for this vocabulary


def test_zero_variance_warning_is_loud_and_logged(tiny_model_dir, tmp_path, capsys):
    """A random model never writes an integer answer: every group scores 0 under `int`. Each record
    carries the warning; the console shows it once, not at every update."""
    rows = metrics(run_mod.train(make_cfg(tiny_model_dir, tmp_path, "max_train_samples=6", "reward_funcs=int")))
    out = capsys.readouterr().out
    assert len(rows) == 3 and all(r["zero_std_fraction"] == 1.0 and "zero_std" in r["warnings"] for r in rows)
    assert out.count("zero reward variance") == 1 and "WARNING (update 1)" in out and "dynamic_sampling" in out
    ok = metrics(run_mod.train(make_cfg(tiny_model_dir, tmp_path, "run_name=ok", "max_train_samples=2",
                                            f"reward_funcs={FIXTURES / 'toy_rewards.py'}:share_of_even_ids")))
    assert ok[0]["zero_std_fraction"] == 0.0 and "zero_std" not in ok[0]["warnings"]
    # the CPU's float32 sampling agrees with the trainer: no sampler mismatch
    assert all(r["sampler_kl"] < 1e-3 and "sampler_mismatch" not in r["warnings"] for r in rows + ok)


def test_dynamic_sampling_without_any_informative_group_skips_and_ends(tiny_model_dir, tmp_path, capsys):
    run = run_mod.train(make_cfg(tiny_model_dir, tmp_path, "reward_funcs=int", "dynamic_sampling=true",
                                     "max_resample_batches=1", "log_completions_steps=1"))
    rows = metrics(run)
    assert [r["groups_trained"] for r in rows] == [0, 0] and all(r["skipped"] and r["draws"] == 2 for r in rows)
    out = capsys.readouterr().out
    assert "no completion entered the loss" in out and "ran out after 2 of 4 updates" in out
    assert "dynamic_sampling skips" not in out  # it is already on


@pytest.mark.parametrize("workers", [["reward_workers=2"], ["reward_workers=2", "reward_executor=process"]])
def test_rewards_in_workers_give_the_same_run_as_inline(tiny_model_dir, tmp_path, workers):
    """Rewards computed off the critical path (while log-prob passes and the next rollouts of an
    accumulation group run) change nothing: same metrics, same weights."""
    base = ["gradient_accumulation_steps=2", "max_train_samples=8", "save_steps=0", "log_completions_steps=1",
            f"reward_funcs={FIXTURES / 'toy_rewards.py'}:flat_unless_even_answer,int"]
    inline = run_mod.train(make_cfg(tiny_model_dir, tmp_path, "run_name=inline", *base))
    pooled = run_mod.train(make_cfg(tiny_model_dir, tmp_path, "run_name=pooled", *base, *workers))
    assert metrics(pooled) == metrics(inline)
    assert (pooled / "completions.jsonl").read_text() == (inline / "completions.jsonl").read_text()
    last = max(int(p.name.split("-")[1]) for p in inline.glob("checkpoint-*"))
    assert_same_weights(weights(inline / f"checkpoint-{last}"), weights(pooled / f"checkpoint-{last}"))
    assert all(r["time_reward_s"] >= 0 for r in json.loads("[" + ",".join(
        (pooled / "metrics.jsonl").read_text().splitlines()) + "]"))


def test_lookahead_gives_the_same_run(tiny_model_dir, tmp_path, monkeypatch):
    """rollout.lookahead reaches the trainer's engine, and its syncs reading the rows as of 3 steps before move when
    rows leave and join the running batch (stop strings end rows early: more decode steps), not what they sample:
    the same completions, the same metrics and weights up to the float32 rounding of rows batched differently."""
    from mlx_grpo.rollout.copy_decoder import CopyDecoder

    # two groups of 4 running, two more batch steps' groups waiting for 4 free slots: when a row is seen ended moves
    # their joins (with too few rows running, a group joins only once every row reaches max_new_tokens)
    base = ["rollout_engine=copy", "max_new_tokens=40", "running_rows=8", "batch_size=4", "max_train_samples=16",
            "save_steps=0", "log_completions_steps=1", "learning_rate=1e-2", "gradient_accumulation_steps=2",
            'stop=["e"]']
    assert assembly_mod.build_job(make_cfg(tiny_model_dir, tmp_path, *base, "lookahead=3")).sampling.policies.engine \
        .lookahead == 3
    steps, step = [], CopyDecoder.step
    monkeypatch.setattr(CopyDecoder, "step", lambda self, *a: steps.append(1) or step(self, *a))
    runs = {}
    for name, extra in (("at_once", []), ("ahead", ["lookahead=3"])):
        steps.clear()
        runs[name] = run_mod.train(make_cfg(tiny_model_dir, tmp_path, f"run_name={name}", *base, *extra)), len(steps)
    (at_once, at_once_steps), (ahead, ahead_steps) = runs["at_once"], runs["ahead"]
    assert ahead_steps > at_once_steps  # rows seen ended 3 steps later: the schedule moved
    got, want = metrics(ahead), metrics(at_once)
    assert [r.keys() for r in got] == [r.keys() for r in want]
    for g, w in zip(got, want):
        for k in w:
            if isinstance(w[k], float):
                assert g[k] == pytest.approx(w[k], rel=1e-3, abs=1e-5), k
            else:
                assert g[k] == w[k], k
    completions = [json.loads(line) for line in (ahead / "completions.jsonl").read_text().splitlines()]
    assert [r["completion"] for r in completions] == \
        [json.loads(line)["completion"] for line in (at_once / "completions.jsonl").read_text().splitlines()]
    last = max(int(p.name.split("-")[1]) for p in at_once.glob("checkpoint-*"))
    assert_same_weights(weights(at_once / f"checkpoint-{last}"), weights(ahead / f"checkpoint-{last}"), atol=1e-5)


@pytest.mark.parametrize("executor", ["thread", "process"])
def test_reward_workers_really_score_off_the_main_thread(tiny_model_dir, tmp_path, executor):
    rewards = f"reward_funcs={FIXTURES / 'toy_rewards.py'}:off_main"
    inline = metrics(run_mod.train(make_cfg(tiny_model_dir, tmp_path, "run_name=i", "max_train_samples=2", rewards)))
    pooled = metrics(run_mod.train(make_cfg(tiny_model_dir, tmp_path, "run_name=p", "max_train_samples=2", rewards,
                                                "reward_workers=1", f"reward_executor={executor}")))
    assert inline[0]["reward/off_main"] == 0.0 and pooled[0]["reward/off_main"] == 1.0


def test_failing_reward_in_a_worker_process_is_one_line(tiny_model_dir, tmp_path, capsys):
    args = ["train", "--set", f"model_name={tiny_model_dir}", "--set", f"output_dir={tmp_path}", "--set",
            "max_train_samples=2", "--set", "batch_size=2", "--set", "num_generations=2", "--set", "max_new_tokens=4",
            "--set", f"reward_funcs={FIXTURES / 'custom_reward.py'}:crashes", "--set", "reward_workers=1",
            "--set", "reward_executor=process"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "reward function crashes failed" in err[0]


def test_rewards_see_each_completions_own_ids(tiny_model_dir, tmp_path):
    """Not rows padded to the batch width: an id-counting reward equals each completion's length."""
    run = run_mod.train(make_cfg(tiny_model_dir, tmp_path, "max_new_tokens=24", "max_train_samples=4",
                                 f"reward_funcs={FIXTURES / 'toy_rewards.py'}:id_count", "log_completions_steps=1",
                                 "stop=a,e,i,o,u,A,E,I,O,U"))
    rows = metrics(run)
    assert all(r["reward_mean"] == pytest.approx(r["completion_length_mean"]) for r in rows)
    assert any(r["completion_length_mean"] < 24 for r in rows)  # some completions ended early: padding would show


def test_sampling_filters_are_refused_in_training(tiny_model_dir, tmp_path):
    for item in ("top_p=0.9", "top_k=5", "min_p=0.1"):
        with pytest.raises(UserError, match="off-policy"):
            make_cfg(tiny_model_dir, tmp_path, item)


def test_refilled_batch_steps_train_as_one_by_one(tiny_model_dir, tmp_path, monkeypatch):
    """gradient_accumulation_steps = 3 with the engine's copy: the update's batch steps decode together
    (refill) and the run logs exactly what drawing them one by one logs."""
    extra = ["rollout_engine=copy", "gradient_accumulation_steps=3", "max_train_samples=12", "max_new_tokens=24",
             "save_steps=0", "learning_rate=1e-2"]
    together = run_mod.train(make_cfg(tiny_model_dir, tmp_path, "run_name=together", *extra))
    calls = {"many": 0}
    original = RolloutEngine.generate_many

    def counted(self, jobs, *args, **kwargs):
        calls["many"] += len(jobs) > 1
        return original(self, jobs, *args, **kwargs)

    monkeypatch.setattr(RolloutEngine, "generate_many", counted)
    run_mod.train(make_cfg(tiny_model_dir, tmp_path, "run_name=counted", *extra))
    assert calls["many"] == 2  # 12 samples / (2 x 3) = 2 updates, each decoded together
    monkeypatch.setattr(FreshSteps, "next", lambda self: UpdateSteps(
        [self.sampling.batch_step(self.sampling.next_examples()) for _ in range(3)], self.sampling.position()))
    one_by_one = run_mod.train(make_cfg(tiny_model_dir, tmp_path, "run_name=single", *extra))
    assert metrics(together) == metrics(one_by_one)


def test_max_minutes_ends_the_run_after_the_update_that_crosses_it(tiny_model_dir, tmp_path, capsys):
    run_dir = run_mod.train(make_cfg(tiny_model_dir, tmp_path, "max_minutes=1e-6"))
    assert len(metrics(run_dir)) == 1  # of 4 planned updates
    assert [p.name for p in run_dir.glob("checkpoint-*")] == ["checkpoint-1"]
    assert "max_minutes = 1e-06 reached after 1 of 4 updates" in capsys.readouterr().out

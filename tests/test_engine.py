"""The rollout engine on tiny random models: its sampling copy (fused projections, merged adapters) gives
the training forward's log-probs and generate_rollout's tokens; dropping ended rows (compaction) leaves
every row's tokens unchanged; the copy follows the policy through updates; other models decode as before."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_map
from mlx_lm import load

from conftest import begin_widths

from mlx_grpo.models import decoder
from mlx_grpo.models.adapters import apply_adapters
from mlx_grpo.models.forward import completion_logprobs, pack
from mlx_grpo.rollout.decode import generate_rollout
from mlx_grpo.rollout.engine import RolloutEngine
from mlx_grpo.rollout.rollout_records import SamplingParams
from mlx_grpo.training.records import UpdateSteps

PROMPTS = [[17, 90], [120, 45, 203, 8, 77, 150, 33, 64, 99, 12, 250], [5, 6, 7]]


@pytest.fixture()
def tiny(tiny_model_dir):
    return load(str(tiny_model_dir))


def _training_logprobs(model, rollout, temperature=1.0) -> mx.array:
    batch = pack(rollout.row_prompts, rollout.completion_ids, rollout.mask, 0)
    return completion_logprobs(model, batch, temperature) * rollout.mask


class ManyEnds:
    """The tokenizer with one token in 12 counted as end-of-sequence, so rows end early and at
    different steps (the tiny random model never picks the real EOS on purpose)."""

    def __init__(self, tok, ends: set[int]):
        self._tok = tok
        self.eos_token_ids = ends

    def __getattr__(self, name):
        return getattr(self._tok, name)


def _many_ends(tok, vocab: int) -> ManyEnds:
    return ManyEnds(tok, set(range(3, vocab, 12)))


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_fused_copy_samples_what_generate_rollout_samples(tiny, temperature):
    model, tok = tiny
    params = SamplingParams(24, temperature)
    engine = RolloutEngine(tok, mode="copy").refresh(model)
    assert engine.uses_copy
    got = engine.generate(PROMPTS, 4, params, mx.random.key(3))
    want = generate_rollout(model, tok, PROMPTS, 4, params, mx.random.key(3))
    assert got.completion_ids.tolist() == want.completion_ids.tolist()
    np.testing.assert_allclose(np.array(got.sampler_logprobs), np.array(want.sampler_logprobs), atol=2e-5)
    if temperature > 0:  # and the training forward agrees with the copy's log-probs
        np.testing.assert_allclose(np.array(got.sampler_logprobs),
                                   np.array(_training_logprobs(model, got, temperature)), atol=2e-5)


@pytest.mark.parametrize("train_type", ["lora", "dora"])
def test_merged_adapters_give_the_adapter_models_logprobs(tiny, tiny_model_dir, train_type):
    model, tok = tiny
    apply_adapters(model, train_type, rank=4, alpha=8.0, dropout=0.0, num_layers=0, keys=[])
    # LoRA's B starts at zero (the adapter adds nothing): give it weights so merging matters
    mx.random.seed(1)
    for _, module in model.named_modules():
        if hasattr(module, "lora_b"):
            module.lora_b = mx.random.normal(module.lora_b.shape) * 0.2
    model.eval()
    engine = RolloutEngine(tok, mode="copy").refresh(model)
    assert engine.uses_copy
    rollout = engine.generate(PROMPTS, 3, SamplingParams(20, 1.0), mx.random.key(0))
    np.testing.assert_allclose(np.array(rollout.sampler_logprobs), np.array(_training_logprobs(model, rollout)),
                               atol=5e-5)
    base_model, _ = load(str(tiny_model_dir))
    differs = RolloutEngine(tok, mode="copy").refresh(base_model).generate(PROMPTS, 3, SamplingParams(20, 1.0),
                                                                           mx.random.key(0))
    assert differs.completion_ids.tolist() != rollout.completion_ids.tolist()  # the adapters were merged in


@pytest.mark.parametrize("stop", [(), ("a",)])
def test_compaction_keeps_every_rows_tokens(tiny, stop):
    model, tok = tiny
    ends = _many_ends(tok, model.args.vocab_size)
    params = SamplingParams(48, 1.0, stop=stop)
    prompts = PROMPTS * 4  # 12 prompts x 4 = 48 rows: compaction goes 48 -> ... -> 8
    compacted = RolloutEngine(ends, mode="copy", sync_every=2).refresh(model)
    full = RolloutEngine(ends, mode="copy", compact=False, sync_every=2).refresh(model)
    a = compacted.generate(prompts, 4, params, mx.random.key(7))
    b = full.generate(prompts, 4, params, mx.random.key(7))
    c = generate_rollout(model, ends, prompts, 4, params, mx.random.key(7))
    assert compacted.row_steps < full.row_steps  # rows were dropped
    lengths = a.lengths
    assert lengths.min() < 8 and lengths.max() > 24  # rows ended at different steps
    for other in (b, c):
        assert a.lengths.tolist() == other.lengths.tolist()
        width = min(a.completion_ids.shape[1], other.completion_ids.shape[1])
        assert a.completion_ids[:, :width].tolist() == other.completion_ids[:, :width].tolist()
        assert a.texts == other.texts and a.truncated.tolist() == other.truncated.tolist()
        np.testing.assert_allclose(np.array(a.sampler_logprobs[:, :width]),
                                   np.array(other.sampler_logprobs[:, :width]), atol=2e-5)


def test_refresh_follows_the_policy(tiny):
    model, tok = tiny
    engine = RolloutEngine(tok, mode="copy").refresh(model)
    before = engine.generate(PROMPTS, 2, SamplingParams(16, 1.0), mx.random.key(0))
    model.update(tree_map(lambda w: w * 1.5 if w.ndim == 2 else w, model.parameters()))
    stale = engine.generate(PROMPTS, 2, SamplingParams(16, 1.0), mx.random.key(0))
    assert stale.completion_ids.tolist() == before.completion_ids.tolist()  # a copy, not the live weights
    engine.refresh(model)
    attn = model.model.layers[1].self_attn
    qkv = mx.concatenate([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
    assert mx.array_equal(engine.weights["layers"][1]["qkv"], qkv)
    after = engine.generate(PROMPTS, 2, SamplingParams(16, 1.0), mx.random.key(0))
    np.testing.assert_allclose(np.array(after.sampler_logprobs), np.array(_training_logprobs(model, after)), atol=2e-5)


def test_the_trainers_engine_holds_the_updated_weights(tiny_model_dir, tmp_path):
    from mlx_grpo.commands.assembly import build_job
    from mlx_grpo.config import build_config, parse_set

    cfg = build_config("train", overrides=parse_set([
        f"model_name={tiny_model_dir}", f"output_dir={tmp_path}", "max_train_samples=4", "batch_size=2",
        "num_generations=2", "max_new_tokens=8", "learning_rate=1e-2", "warmup_ratio=0", "system_prompt=",
        "max_prompt_length=96", "rollout_engine=copy"]))
    job = build_job(cfg)
    step = job.sampling.batch_step(job.sampling.next_examples())
    mlp = job.model.model.layers[0].mlp
    mlp.gate_proj.weight = mlp.gate_proj.weight * 2  # a change the engine has not seen
    job.trainer.masters.adopt(dict(tree_flatten(job.model.trainable_parameters())))
    stale = job.trainer.policies.engine.weights["layers"][0]["gate_up"]
    assert not job.trainer.update(UpdateSteps([step], job.sampling.position())).skipped
    now = mx.concatenate([mlp.gate_proj.weight, mlp.up_proj.weight])
    assert not mx.array_equal(stale, now)
    assert mx.array_equal(job.trainer.policies.engine.weights["layers"][0]["gate_up"], now)


def test_quantized_models_decode_the_model_itself(tiny):
    model, tok = tiny
    nn.quantize(model, group_size=32, bits=4)
    engine = RolloutEngine(tok, mode="copy").refresh(model)
    assert not engine.uses_copy
    got = engine.generate(PROMPTS, 2, SamplingParams(12, 1.0), mx.random.key(0))
    want = generate_rollout(model, tok, PROMPTS, 2, SamplingParams(12, 1.0), mx.random.key(0))
    assert got.completion_ids.tolist() == want.completion_ids.tolist()


def _family_model(kind: str):
    from mlx_lm.models import qwen2, qwen3

    common = {"hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 96, "num_attention_heads": 4,
              "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "vocab_size": 300, "rope_theta": 1e6,
              "tie_word_embeddings": kind == "qwen2", "max_position_embeddings": 512}
    mx.random.seed(4)
    if kind == "qwen2":
        model = qwen2.Model(qwen2.ModelArgs(model_type="qwen2", **common))
        for layer in model.model.layers:  # mlx-lm starts biases at zero: make them count
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias = mx.random.normal(proj.bias.shape) * 0.5
    else:
        model = qwen3.Model(qwen3.ModelArgs(model_type="qwen3", head_dim=16, **common))
        for layer in model.model.layers:
            layer.self_attn.q_norm.weight = mx.random.uniform(0.5, 1.5, (16,))
            layer.self_attn.k_norm.weight = mx.random.uniform(0.5, 1.5, (16,))
    mx.eval(model.parameters())
    return model


@pytest.mark.parametrize("kind", ["qwen2", "qwen3"])
def test_copy_computes_the_families_forward(kind):
    """Prefill and one decode step of the copy equal mlx-lm's own forward (biases, q/k norms, untied head)."""
    model = _family_model(kind)
    assert decoder.supports(model)
    spec, weights = decoder.build(model, mx.float32)
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12]]
    width = 6
    padding = mx.array([width - len(p) for p in prompts], dtype=mx.int32)
    tokens = mx.array([[0] * (width - len(p)) + p for p in prompts])
    logits, keys, values = decoder.prefill(spec, weights, tokens, padding)
    tail = [(0, 0), (0, 0), (0, 0), (0, 2), (0, 0)]
    keys, values = mx.pad(mx.stack(keys), tail), mx.pad(mx.stack(values), tail)
    step, _, _ = decoder.decode_step(spec, weights, mx.array([20, 21]), keys, values, width - padding, padding,
                                     mx.array([width]), kernel=False)
    for i, p in enumerate(prompts):
        np.testing.assert_allclose(np.array(logits[i]), np.array(model(mx.array([p]))[0, -1]), atol=1e-4)
        np.testing.assert_allclose(np.array(step[i]), np.array(model(mx.array([p + [20 + i]]))[0, -1]), atol=1e-4)


def test_cache_attention_reference_equals_masked_softmax():
    """The attention the copy uses off CUDA (and the kernel's contract): softmax over [start, stop), its lse."""
    mx.random.seed(0)
    q, k, v = mx.random.normal((3, 4, 1, 8)), mx.random.normal((3, 2, 10, 8)), mx.random.normal((3, 2, 10, 8))
    start, stop = mx.array([0, 3, 9], dtype=mx.int32), mx.array([9], dtype=mx.int32)
    out, lse = decoder.cache_attention(q, mx.stack([k * 0, k]), mx.stack([v * 0, v]), start, stop, 0.3,
                                       kernel=False, layer=1)
    qn, kn, vn = np.array(q), np.array(k), np.array(v)
    np.testing.assert_array_equal(np.array(out[2]), 0)  # no slot in [9, 9): nothing attended
    assert np.all(np.array(lse[2]) == -np.inf)
    for r in range(2):
        for h in range(4):
            s = 0.3 * kn[r, h // 2, int(start[r]):9] @ qn[r, h, 0]
            p = np.exp(s - s.max())
            np.testing.assert_allclose(np.array(out[r, h, 0]), p @ vn[r, h // 2, int(start[r]):9] / p.sum(), atol=1e-5)
            np.testing.assert_allclose(float(lse[r, h, 0]), s.max() + np.log(p.sum()), atol=1e-5)


def test_rope_angles_are_read_off_the_models_rope():
    """The fused CUDA kernel applies RoPE as p * theta; theta comes from the module and is checked against it
    (plain and llama3-scaled RoPE); a RoPE of another layout (traditional pairs) gets none (graph path)."""
    from mlx_lm.models.rope_utils import initialize_rope

    plain = initialize_rope(16, 10000.0, False, None, 2048)
    llama3 = initialize_rope(16, 500000.0, False, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                   "high_freq_factor": 4.0,
                                                   "original_max_position_embeddings": 8192}, 131072)
    for rope in (plain, llama3):
        theta = decoder.rope_angles(rope, 16)
        assert theta is not None and theta.shape == (8,)
        x = mx.random.normal((1, 2, 1, 16))
        angle = 77 * theta
        want = mx.concatenate([x[..., :8] * mx.cos(angle) - x[..., 8:] * mx.sin(angle),
                               x[..., 8:] * mx.cos(angle) + x[..., :8] * mx.sin(angle)], axis=-1)
        np.testing.assert_allclose(np.array(rope(x, offset=77)), np.array(want), atol=1e-4)
    np.testing.assert_allclose(np.array(decoder.rope_angles(plain, 16)), 10000.0 ** (-np.arange(8) / 8), rtol=1e-5)
    assert decoder.rope_angles(initialize_rope(16, 10000.0, True, None, 2048), 16) is None


def test_bfloat16_copy_logprobs_are_the_training_forwards_within_rounding(tiny):
    """In bfloat16 the copy's fused matrices, addmm residuals and float32 attention round differently from
    the model's modules: log-probs agree to bfloat16's rounding, not bit for bit (a wrong RoPE, norm or
    merge would be off by far more)."""
    model, tok = tiny
    model.set_dtype(mx.bfloat16)
    rollout = RolloutEngine(tok, mode="copy").refresh(model).generate(PROMPTS, 4, SamplingParams(24, 1.0),
                                                                      mx.random.key(2))
    diff = np.abs(np.array(rollout.sampler_logprobs) - np.array(_training_logprobs(model, rollout)))
    mask = np.array(rollout.mask) > 0
    assert diff[mask].mean() < 0.01 and diff.max() < 0.08


def test_an_old_policy_kept_apart_is_what_the_engine_samples(tiny_model_dir, tmp_path):
    """update_every = 2: after the first update the engine still samples the old policy (the model has
    moved on); after the second it samples the refreshed one."""
    from mlx_grpo.commands.assembly import build_job
    from mlx_grpo.config import build_config, parse_set

    cfg = build_config("train", overrides=parse_set([
        f"model_name={tiny_model_dir}", f"output_dir={tmp_path}", "max_train_samples=8", "batch_size=2",
        "num_generations=2", "max_new_tokens=8", "learning_rate=1e-2", "warmup_ratio=0", "system_prompt=",
        "max_prompt_length=96", "rollout_engine=copy", "update_every=2", "max_grad_norm=0",
        "weight_decay=0.5"]))  # decay moves the weights whatever the (here often zero) gradient
    job = build_job(cfg)

    def gate_up(module):
        mlp = module.model.layers[0].mlp
        return mx.concatenate([mlp.gate_proj.weight, mlp.up_proj.weight])

    first = gate_up(job.model)
    for _ in range(2):
        step = job.sampling.batch_step(job.sampling.next_examples())
        job.trainer.update(UpdateSteps([step], job.sampling.position()))
        held = job.trainer.policies.engine.weights["layers"][0]["gate_up"]
        assert mx.array_equal(held, gate_up(job.trainer.policies.sampler))
        if job.counters.update_step == 1:
            assert mx.array_equal(held, first) and not mx.array_equal(held, gate_up(job.model))
    assert mx.array_equal(job.trainer.policies.engine.weights["layers"][0]["gate_up"], gate_up(job.model))


def test_copy_bytes_counts_the_fused_and_merged_matrices(tiny):
    model, _ = tiny
    layers = model.model.layers
    fused = sum(m.weight.size for layer in layers for m in (layer.self_attn.q_proj, layer.self_attn.k_proj,
                                                            layer.self_attn.v_proj, layer.mlp.gate_proj,
                                                            layer.mlp.up_proj))
    assert decoder.copy_bytes(model, mx.float32) == fused * 4
    spec, weights = decoder.build(model, mx.float32)
    assert weights["layers"][0]["o"] is not None and sum(w["qkv"].size + w["gate_up"].size
                                                         for w in weights["layers"]) == fused
    apply_adapters(model, "lora", rank=2, alpha=4.0, dropout=0.0, num_layers=0, keys=[])
    everything = fused + sum(layer.self_attn.o_proj.linear.weight.size + layer.mlp.down_proj.linear.weight.size
                             for layer in layers)
    assert decoder.copy_bytes(model, mx.float32) == everything * 4


@pytest.mark.parametrize("stop,ignore_eos,T", [((), False, 40), (("a",), False, 40), ((), True, 42)])
def test_a_sync_that_looks_back_decodes_the_same_rows(tiny, stop, ignore_eos, T):
    """lookahead: syncs read the rows as of 3 steps before them, so ended rows are dropped and later batch
    steps' rows admitted later (more steps), each row's tokens and log-probs unchanged (stop strings found later
    cut where they were). ignore_eos, T = 42: every row runs to T, so the waiting rows join at step 42, a sync
    past `last`, 2 steps before the next regular sync, which then reads the rows as they are (its history since
    the refill is shorter than the lookahead); nothing is seen later there (every row ends at T)."""
    model, tok = tiny
    ends = _many_ends(tok, model.args.vocab_size)
    params = SamplingParams(T, 1.0, stop=stop, ignore_eos=ignore_eos)
    jobs = [(PROMPTS * 2, mx.random.split(mx.random.key(10 + j), 24)) for j in range(3)]
    outs, steps = {}, {}
    for ahead in (0, 3):
        engine = RolloutEngine(ends, mode="copy", sync_every=4, rows=8, lookahead=ahead).refresh(model)
        outs[ahead], steps[ahead] = engine.generate_many(jobs, 4, params), engine.steps
    assert steps[3] > steps[0] or ignore_eos  # (every row ends at T: nothing to see later)
    for a, b in zip(outs[0], outs[3]):
        assert a.lengths.tolist() == b.lengths.tolist() and a.texts == b.texts
        assert a.truncated.tolist() == b.truncated.tolist()
        width = min(a.completion_ids.shape[1], b.completion_ids.shape[1])  # the widths may differ, not the rows
        assert a.completion_ids[:, :width].tolist() == b.completion_ids[:, :width].tolist()
        np.testing.assert_allclose(np.array(a.sampler_logprobs[:, :width]), np.array(b.sampler_logprobs[:, :width]),
                                   atol=2e-5)


@pytest.mark.parametrize("stop,ignore_eos,rows", [((), False, 0), (("a",), False, 0), ((), True, 0), ((), False, 8),
                                                  ((), False, 40), (("a",), False, 1000), ((), True, 1000)])
def test_refill_decodes_later_batch_steps_in_freed_slots_with_the_same_tokens(tiny, stop, ignore_eos, rows,
                                                                              monkeypatch):
    """generate_many: three batch steps decoded together give each row the tokens that generating each
    step alone gives it, in fewer row-steps, with the later steps' rows joining freed slots. rows
    (running_rows): the batch starts with that many rows (0: the first step's 24), whatever the steps."""
    model, tok = tiny
    ends = _many_ends(tok, model.args.vocab_size)
    params = SamplingParams(40, 1.0, stop=stop, ignore_eos=ignore_eos)  # ignore_eos: no slot frees early
    engine = RolloutEngine(ends, mode="copy", sync_every=2, rows=rows).refresh(model)
    began = begin_widths(monkeypatch)
    jobs = [(PROMPTS * 2, mx.random.split(mx.random.key(10 + j), 24)) for j in range(2)]
    jobs.append(([[9] * 130, [4, 5]], mx.random.split(mx.random.key(30), 8)))  # longer than any slot before it
    together = engine.generate_many(jobs, 4, params)
    together_steps = engine.steps
    assert began == [{0: 24, 8: 8, 40: 40, 1000: 56}[rows]]
    alone_steps = 0
    for (prompts, keys), got in zip(jobs, together):
        want = engine.generate(prompts, 4, params, keys)
        alone_steps += engine.steps
        assert got.lengths.tolist() == want.lengths.tolist() and got.texts == want.texts
        assert got.truncated.tolist() == want.truncated.tolist() and got.prompt_ids == want.prompt_ids
        width = min(got.completion_ids.shape[1], want.completion_ids.shape[1])
        assert got.completion_ids[:, :width].tolist() == want.completion_ids[:, :width].tolist()
        np.testing.assert_allclose(np.array(got.sampler_logprobs[:, :width]),
                                   np.array(want.sampler_logprobs[:, :width]), atol=2e-5)
    assert together_steps < alone_steps or ignore_eos
    if rows == 1000:  # every row from the first step: the 40 steps of the longest
        assert together_steps == 39
    assert [r.completion_ids.shape[1] for r in together] == [40, 40, 40] if ignore_eos else True

"""`mlx-grpo sft`: the completion-only loss against a naive NLL, the masks, the chain into `train`,
resume == uninterrupted, adapters, and bad input."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from conftest import interrupt_before_update, run_metrics
from mlx_grpo.base.errors import UserError
from mlx_grpo.commands.cli import main
from mlx_grpo.config import build_config, parse_set
from mlx_grpo.models.forward import token_logprobs
from mlx_grpo.models.model_loading import load_model
from mlx_grpo.rollout.multiturn import encode_prompts
from mlx_grpo.sft.rows import SFTRow, conversation_row, end_id, file_rows, target_ids
from mlx_grpo.sft.steps import make_grad_fn, micro_batches, nll_sums, pack_rows, sft_gradients

ROWS = [{"prompt": f"What is {i} + {i}?", "completion": f"<reasoning>\n{i} + {i} = {2 * i}\n</reasoning>\n"
         f"<answer>\n{2 * i}\n</answer>"} for i in range(10)]
CHAT = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                     {"role": "user", "content": "and two?"}, {"role": "assistant", "content": "2"}]}


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def sft_cfg(model_dir, tmp_path, *items, data=None):
    data = data or write_jsonl(tmp_path / "data.jsonl", ROWS + [CHAT, CHAT])
    return build_config("sft", overrides=parse_set([
        f"model_name={model_dir}", f"dataset_path={data}", f"output_dir={tmp_path / 'runs'}", "batch_size=4",
        "num_epochs=2", "learning_rate=1e-3", "save_steps=2", "max_grad_norm=1.0", "prefill=<reasoning>\n",
        *items]))


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load_model(str(tiny_model_dir), "float32")


def naive_mean_nll(model, rows: list[SFTRow]) -> float:
    """Written from the formula: per row, per token of the whole sequence, in numpy; a token counts only
    where the row trains it (its completion, the mask)."""
    total, count = 0.0, 0
    for r in rows:
        seq = r.prompt_ids + r.ids
        logits = np.array(model(mx.array([seq]))[0].astype(mx.float32))  # [L, V]
        logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
            - logits.max(-1, keepdims=True)
        for t in range(1, len(seq)):  # token t predicted from position t - 1
            j = t - len(r.prompt_ids)
            if j >= 0 and r.mask[j]:
                total -= logp[t - 1, seq[t]]
                count += 1
    return total / count


def test_loss_equals_naive_nll_over_completion_tokens(tiny, tmp_path):
    model, tok = tiny
    cfg = sft_cfg("x", tmp_path)
    rows, _ = file_rows(write_jsonl(tmp_path / "d.jsonl", ROWS[:3] + [CHAT]), tok, cfg, None, cfg.data.system_prompt)
    expected = naive_mean_nll(model, rows)
    grads = {}
    for size, max_tokens in ((16, 0), (1, 0), (2, 128)):  # micro-batching never changes the loss
        g, loss, tokens = sft_gradients(make_grad_fn(model), rows, tok.pad_token_id, size, max_tokens)
        assert tokens == sum(sum(r.mask) for r in rows)
        assert loss.item() == pytest.approx(expected, rel=1e-5)
        grads[size] = dict(tree_flatten(g))
    for k, v in grads[16].items():
        np.testing.assert_allclose(np.array(grads[1][k]), np.array(v), rtol=1e-4, atol=1e-6)


def test_prompt_positions_get_no_gradient(tiny, tmp_path):
    """The loss reads the logits only where a trained token is predicted: its gradient with respect to the
    logits at every prompt position (and at masked context) is exactly 0."""
    model, tok = tiny
    cfg = sft_cfg("x", tmp_path)
    (row,), _ = file_rows(write_jsonl(tmp_path / "d.jsonl", [CHAT]), tok, cfg, None, cfg.data.system_prompt)
    batch = pack_rows([row], tok.pad_token_id)
    logits = model(batch.inputs).astype(mx.float32)  # [1, L, V]

    def loss(lg):
        picked = mx.take_along_axis(lg, batch.positions[..., None], axis=1)
        return nll_sums(token_logprobs(picked, batch.targets, 1.0), batch.mask)[0]

    g = np.abs(np.array(mx.grad(loss)(logits)[0])).sum(-1)  # [L]
    P = len(row.prompt_ids)
    trained = {P - 1 + t for t, m in enumerate(row.mask) if m}
    assert all(g[p] == 0 for p in range(g.shape[0]) if p not in trained)
    assert all(g[p] > 0 for p in trained)


def test_rows_are_trains_prompts_plus_the_completion(tiny, tmp_path):
    """The prompt is exactly what `train` feeds the model (system prompt, template, prefill); the target is
    the completion after the prefill, then the end-of-turn token, every token of it trained."""
    _, tok = tiny
    cfg = sft_cfg("x", tmp_path)
    row = dict(ROWS[0], completion="<reasoning>\n" + "1 + 1 = 2\n</reasoning>\n<answer>\n2\n</answer>")
    (r,), cut = file_rows(write_jsonl(tmp_path / "d.jsonl", [row]), tok, cfg, None, cfg.data.system_prompt)
    from mlx_grpo.data.examples import Example

    assert r.prompt_ids == encode_prompts(None, tok, [Example(row["prompt"], "")], cfg)[0][0] and cut == 0
    assert tok.decode(r.prompt_ids).endswith("<|im_start|>assistant\n<reasoning>\n")
    assert r.ids == target_ids(tok, "1 + 1 = 2\n</reasoning>\n<answer>\n2\n</answer>") and r.ids[-1] == end_id(tok)
    assert r.mask == [1] * len(r.ids)


def test_chat_rows_train_on_assistant_turns_only(tiny, tmp_path):
    _, tok = tiny
    cfg = sft_cfg("x", tmp_path, "system_prompt=")
    r, _ = conversation_row(CHAT["messages"], tok, cfg, "row", "")
    trained = [i for i, m in zip(r.ids, r.mask) if m]
    assert tok.decode(trained) == "hello<|im_end|>2<|im_end|>"
    assert tok.decode(r.prompt_ids) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(r.prompt_ids + r.ids) == tok._tokenizer.apply_chat_template(CHAT["messages"], tokenize=False)


def test_micro_batches_cover_every_row_once(tiny, tmp_path):
    rows = [SFTRow([1] * p, [2] * n, [1] * n) for p, n in ((3, 70), (100, 5), (2, 2), (40, 40))]
    chunks = micro_batches(rows, 2, 256)
    assert sorted(i for c in chunks for i in c) == [0, 1, 2, 3] and all(len(c) <= 2 for c in chunks)


def _weights(path: Path) -> dict:
    return dict(mx.load(str(path / "model.safetensors")))


def test_checkpoint_loads_into_train_with_identical_weights(tiny_model_dir, tmp_path):
    """Mixed precision: train from an sft checkpoint gets its bfloat16 weights and its float32 masters."""
    from mlx_grpo.commands.assembly import build_job
    from mlx_grpo.commands.sft import run_sft
    from mlx_grpo.storage.checkpoint import load_masters

    run_dir = run_sft(sft_cfg(tiny_model_dir, tmp_path, "model_dtype=bfloat16", "num_epochs=1"))
    ckpt = run_dir / "checkpoint-3"
    train_cfg = build_config("train", overrides=parse_set([
        f"model_name={ckpt}", f"output_dir={tmp_path / 'runs'}", "run_name=grpo", "kl_coeff=0.04",
        "learning_rate=1e-5"]))
    job = build_job(train_cfg)
    saved, masters = _weights(ckpt), load_masters(ckpt)
    now = dict(tree_flatten(job.model.parameters()))
    assert set(now) == set(saved)
    for k, v in saved.items():
        assert now[k].dtype == mx.bfloat16 and mx.array_equal(now[k], v).item(), k
    assert set(job.trainer.masters.masters) == set(masters)
    for k, v in masters.items():
        assert mx.array_equal(job.trainer.masters.masters[k], v).item(), k
    # the masters carry what bfloat16 cannot hold: starting from the weights alone would lose it
    assert any(not mx.array_equal(v.astype(mx.bfloat16).astype(mx.float32), v).item() for v in masters.values())
    reference = dict(tree_flatten(job.trainer.policies.reference.parameters()))
    assert all(mx.array_equal(reference[k], v).item() for k, v in saved.items())  # the KL anchors to sft


def test_resume_equals_uninterrupted(tiny_model_dir, tmp_path, monkeypatch):
    from mlx_grpo.commands.sft import run_sft
    from mlx_grpo.sft import steps as sft_mod

    # 12 rows, 4 epochs of 3 batches of 4, two batches per update: 6 updates, checkpoints every 2
    whole = run_sft(sft_cfg(tiny_model_dir, tmp_path, "run_name=whole", "num_epochs=4", "gradient_accumulation_steps=2",
                            "micro_batch_size=2", "eval_every_updates=2", "eval_subset_size=2",
                            "eval_max_new_tokens=4"))
    cfg = sft_cfg(tiny_model_dir, tmp_path, "run_name=cut", "num_epochs=4", "gradient_accumulation_steps=2",
                  "micro_batch_size=2",
                  "eval_every_updates=2", "eval_subset_size=2", "eval_max_new_tokens=4")
    # killed before its fourth update: checkpoint-2 is the latest
    interrupt_before_update(run_sft, cfg, monkeypatch, 4, sft_mod.SFTTrainer)
    with pytest.raises(UserError, match="already holds checkpoints"):
        run_sft(cfg)
    cut = run_sft(cfg, resume="latest")
    assert (whole / "checkpoint-6").is_dir() and (cut / "checkpoint-6").is_dir()
    for name in ("model.safetensors", "optimizer.safetensors"):
        a, b = mx.load(str(whole / "checkpoint-6" / name)), mx.load(str(cut / "checkpoint-6" / name))
        assert set(a) == set(b) and all(mx.array_equal(a[k], b[k]).item() for k in a), name
    assert run_metrics(whole) == run_metrics(cut)
    assert [json.loads(x) for x in (whole / "eval.jsonl").read_text().splitlines()] == \
        [json.loads(x) for x in (cut / "eval.jsonl").read_text().splitlines()]


def test_lora_checkpoint_fuses_into_a_model_train_starts_from(tiny_model_dir, tmp_path):
    from mlx_grpo.commands.assembly import build_job
    from mlx_grpo.commands.fuse import run_fuse
    from mlx_grpo.commands.sft import run_sft

    run_dir = run_sft(sft_cfg(tiny_model_dir, tmp_path, "train_type=lora", "lora_rank=4", "num_epochs=1"))
    ckpt = run_dir / "checkpoint-3"
    assert (ckpt / "adapters.safetensors").is_file() and not (ckpt / "model.safetensors").exists()
    with pytest.raises(UserError, match="fuse"):
        build_job(build_config("train", overrides=parse_set([f"model_name={ckpt}", "kl_coeff=0"])))
    fused = run_fuse(str(ckpt), str(tmp_path / "fused"))
    merged, _ = load_model(str(ckpt), "float32")  # the base with the adapters applied
    job = build_job(build_config("train", overrides=parse_set([f"model_name={fused}", "kl_coeff=0"])))
    x = mx.array([[5, 6, 7, 8]])
    np.testing.assert_allclose(np.array(job.model(x)), np.array(merged(x)), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("rows, message", [
    ([{"prompt": "q", "completion": ""}], "completion is empty"),
    ([{"prompt": "q", "completion": "<reasoning>\n"}], "completion is empty after the prefill"),
    ([{"prompt": "q"}], "missing 'completion'"),
    ([{"text": "q"}], "missing 'prompt' and 'completion'"),
    ([{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": " "}]}], "is empty"),
    ([{"messages": [{"role": "user"}]}], "messages message 0 must be"),
    ([{"messages": [{"role": "user", "content": "q"}]}], "no assistant message"),
])
def test_bad_rows_are_one_line_exit_2_nothing_written(tiny_model_dir, tmp_path, capsys, rows, message):
    data = write_jsonl(tmp_path / "bad.jsonl", rows)
    code = main(["sft", "--model", str(tiny_model_dir), "--dataset-path", str(data), "--output-dir",
                 str(tmp_path / "runs"), "--prefill", "<reasoning>\n"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and message in err and "Traceback" not in err
    assert not (tmp_path / "runs").exists()


FIXTURES = Path(__file__).parent / "fixtures"


def test_gsm8k_rows_are_the_worked_solutions_after_the_prefill(tiny, tmp_path):
    """GSM8K-form rows: the prompt as `train` encodes it, the target the solution in the run's format."""
    from mlx_grpo.data.examples import load_file
    from mlx_grpo.data.solutions import reference_completion
    from mlx_grpo.sft.rows import load_sft_data

    _, tok = tiny
    cfg = sft_cfg("x", tmp_path, data=FIXTURES / "gsm8k_solutions.jsonl")
    rows = load_sft_data(cfg, tok, None).rows
    examples = load_file(FIXTURES / "gsm8k_solutions.jsonl")
    assert len(rows) == len(examples)
    for r, e in zip(rows, examples):
        assert r.prompt_ids == encode_prompts(None, tok, [e], cfg)[0][0]
        assert tok.decode(r.ids) == reference_completion(e)[len("<reasoning>\n"):] + "<|im_end|>"
        assert r.mask == [1] * len(r.ids)
    assert tok.decode(rows[0].ids).endswith("</reasoning>\n<answer>\n72\n</answer><|im_end|>")
    think = load_sft_data(sft_cfg("x", tmp_path, "prefill=<think>\n", data=FIXTURES / "gsm8k_solutions.jsonl"), tok,
                          None).rows  # the format follows the prefill (solutions.style_for)
    assert tok.decode(think[0].ids).endswith("</think>\n<answer>\n72\n</answer><|im_end|>")
    with pytest.raises(UserError, match="prefill"):
        load_sft_data(sft_cfg("x", tmp_path, "prefill=Step 1:", data=FIXTURES / "gsm8k_solutions.jsonl"), tok, None)


def test_arith_rows_and_max_train_samples(tiny, tmp_path):
    from mlx_grpo.sft.rows import load_sft_data

    _, tok = tiny
    cfg = build_config("sft", overrides=parse_set(["dataset=arith", "arith_max_steps=1", "max_train_samples=5",
                                                   "prefill=<reasoning>\n"]))
    data = load_sft_data(cfg, tok, None)
    rows, cut = data.rows, data.cut
    assert len(rows) == 5 and cut == 0
    text = tok.decode(rows[0].ids)
    assert "<<" not in text and text.endswith("\n</answer><|im_end|>") and "</reasoning>\n<answer>\n" in text


def test_calculator_answers_are_context_not_targets(tiny, tmp_path):
    """With the calculator the solution's computations are calls; the tool's answers are fed in (mask 0)."""
    from mlx_grpo.rollout.multiturn import multiturn_for
    from mlx_grpo.sft.rows import load_sft_data

    _, tok = tiny
    cfg = sft_cfg("x", tmp_path, "tools=calculator", data=FIXTURES / "gsm8k_solutions.jsonl")
    rows = load_sft_data(cfg, tok, multiturn_for(cfg, tok, "llama")).rows
    r = rows[0]
    trained = tok.decode([i for i, m in zip(r.ids, r.mask) if m])
    fed = tok.decode([i for i, m in zip(r.ids, r.mask) if not m])
    assert "<calc>48/2</calc>" in trained and "24" in fed and "<calc>" not in fed
    assert r.mask[-1] == 1 and 0 in r.mask


def test_train_refuses_to_resume_an_sft_checkpoint(tiny_model_dir, tmp_path):
    from mlx_grpo.commands.sft import run_sft
    from mlx_grpo.commands.train import train

    run_dir = run_sft(sft_cfg(tiny_model_dir, tmp_path, "num_epochs=1", "run_name=warm"))
    cfg = build_config("train", overrides=parse_set([f"model_name={tiny_model_dir}", f"output_dir={tmp_path / 'runs'}",
                                                     "run_name=warm", "batch_size=2", "num_generations=2",
                                                     "max_new_tokens=4"]))
    with pytest.raises(UserError, match="checkpoint of `mlx-grpo sft`.*set model_name"):
        train(cfg, resume=str(run_dir / "checkpoint-3"))


def test_sft_refuses_to_resume_a_train_checkpoint_before_comparing_settings(tiny_model_dir, tmp_path):
    """A `train` checkpoint given to `sft --resume` is named as such, not as a list of GRPO-only settings that
    "changed" (train says the same of an sft checkpoint)."""
    from mlx_grpo.commands.sft import run_sft
    from mlx_grpo.commands.train import train

    run_dir = train(build_config("train", overrides=parse_set([
        f"model_name={tiny_model_dir}", f"output_dir={tmp_path / 'runs'}", "run_name=grpo", "batch_size=2",
        "num_generations=2", "max_new_tokens=4", "max_train_samples=2", "system_prompt="])))
    with pytest.raises(UserError) as info:
        run_sft(sft_cfg(tiny_model_dir, tmp_path, "num_epochs=1", "run_name=grpo"),
                resume=str(run_dir / "checkpoint-1"))
    assert str(info.value) == (f"--resume: {run_dir / 'checkpoint-1'} is a checkpoint of `mlx-grpo train`, not of "
                               f"`sft`; to start sft from its weights, rerun without --resume, with --set "
                               f"model_name={run_dir / 'checkpoint-1'}")


def test_worked_examples_prompt_is_trains(tiny_model_dir, tmp_path):
    """With worked examples the rows carry the system prompt `train` builds for the same settings (the same
    drawn examples, left out of the rows as train leaves them out of its data)."""
    from mlx_grpo.commands.assembly import build_job
    from mlx_grpo.sft.rows import load_sft_data

    keys = [f"model_name={tiny_model_dir}", "dataset=arith", "arith_max_steps=1", "worked_examples=2",
            "max_train_samples=6", "prefill=<reasoning>\n", "eval_every_updates=3", "eval_subset_size=4",
            "max_prompt_length=2048"]
    job = build_job(build_config("train", overrides=parse_set(keys + ["kl_coeff=0"])))
    cfg = build_config("sft", overrides=parse_set(keys))
    data = load_sft_data(cfg, job.tokenizer, None)
    assert data.prompt == job.prompt and len(data.prompt.examples) == 2 and data.eval_prompt == job.eval_prompt
    assert [r.prompt_ids for r in data.rows] == [ids for ids, _ in encode_prompts(
        None, job.tokenizer, job.train_examples, cfg, job.prompt.system)]
    shown = {e.prompt for e in job.worked.examples}
    assert not shown & {e.prompt for e in job.train_examples} and len(data.evals) == 4


def test_a_warm_start_checkpoint_that_cannot_be_written_is_one_line(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """A full disk while sft saves: one line and exit 2, as train's (tests/test_checkpoint.py); the earlier
    checkpoint stays."""
    import errno

    from mlx_grpo.storage import checkpoint as ckpt

    real_save, real_write, saves = ckpt.save_checkpoint, ckpt.mx.save_safetensors, []

    def counted(*args, **kwargs):
        saves.append(1)
        return real_save(*args, **kwargs)

    def full_disk(path, *args, **kwargs):  # room for the first checkpoint only
        if len(saves) > 1:
            raise OSError(errno.ENOSPC, "No space left on device", path)
        return real_write(path, *args, **kwargs)

    monkeypatch.setattr(ckpt, "save_checkpoint", counted)
    monkeypatch.setattr(ckpt.mx, "save_safetensors", full_disk)
    data = write_jsonl(tmp_path / "data.jsonl", ROWS)
    code = main(["sft", "--model", str(tiny_model_dir), "--dataset-path", str(data), "--output-dir",
                 str(tmp_path / "runs"), "--prefill", "<reasoning>\n", "--batch-size", "2", "--set", "save_steps=2"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert "saving checkpoint-4 in " in err and "failed: No space left on device" in err
    assert f"--resume {tmp_path / 'runs' / 'sft' / 'checkpoint-2'} continues from it" in err
    assert sorted(p.name for p in (tmp_path / "runs" / "sft").iterdir() if "checkpoint" in p.name) == ["checkpoint-2"]


def test_a_failed_save_after_a_resume_elsewhere_names_the_resumed_checkpoint(tiny_model_dir, tmp_path, monkeypatch,
                                                                             capsys):
    """Resumed from another run directory, the first save fails: the line names the checkpoint resumed from, the
    only one this run has, not "a rerun starts over"."""
    import errno

    from mlx_grpo.storage import checkpoint as ckpt

    data = write_jsonl(tmp_path / "data.jsonl", ROWS)
    common = ["sft", "--model", str(tiny_model_dir), "--dataset-path", str(data), "--output-dir",
              str(tmp_path / "runs"), "--prefill", "<reasoning>\n", "--batch-size", "2", "--set", "save_steps=2"]
    assert main(common) == 0
    first = tmp_path / "runs" / "sft" / "checkpoint-2"
    capsys.readouterr()

    def full_disk(path, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", path)

    monkeypatch.setattr(ckpt.mx, "save_safetensors", full_disk)
    code = main(common + ["--resume", str(first), "--set", "run_name=again"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert f"{first} is intact: once there is room, the command with --resume {first} continues from it" in err

    monkeypatch.undo()  # room again: resuming the first run's last checkpoint elsewhere has nothing left to do
    last = max((tmp_path / "runs" / "sft").glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    assert main(common + ["--resume", str(last), "--set", "run_name=done"]) == 0
    assert f"final checkpoint: {last}" in capsys.readouterr().out

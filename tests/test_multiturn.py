"""Multi-turn rollouts (multiturn.py): tool calls inside the batched decode, loss masks by origin, environments,
and the trainer's runs with tools (resume, logs, evaluation)."""

from __future__ import annotations

import json
import re

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from caller_model import CALLER, END, Scripted, write_caller_model
from conftest import interrupt_before_update, run_metrics
from mlx_grpo.base.errors import UserError
from mlx_grpo.commands import train as run_mod
from mlx_grpo.config import build_config, parse_set
from mlx_grpo.loss import group_advantages
from mlx_grpo.models.model_loading import load_model
from mlx_grpo.rollout import turns as turns_module
from mlx_grpo.rollout.engine import RolloutEngine
from mlx_grpo.rollout.multiturn import MultiTurn, turn_keys
from mlx_grpo.rollout.rollout_records import SamplingParams
from mlx_grpo.tools.calls import NanochatFormat, PlainFormat
from mlx_grpo.tools.environments import Environment, StepResult, ToolEnvironment
from mlx_grpo.training.optimization import accumulate_gradients, loss_weights, make_grad_fn
from mlx_grpo.training.records import StepData

CALL = "<calc>2+3</calc>"
RESULT = "<result>5</result>"


def caller_script(prompt: str, completion: str) -> dict:
    """Write k filler letters ('x' or 'y', drawn), the calculator call, then a drawn letter and the tool's
    result as the answer. k comes from the prompt ("k=3"), so rows call at different steps."""
    k = int(re.search(r"k=(\d+)", prompt).group(1))
    if len(completion) < k:
        return {"x": 0.0, "y": 0.0}
    head = completion[k:]
    if len(head) < len(CALL):
        return {CALL[len(head)]: 30.0}
    fed = re.match(r"<result>([^<]*)</result>", head[len(CALL):])
    if fed is None:
        return {END: 30.0}
    written = head[len(CALL) + fed.end():]
    if not written:
        return {"x": 0.0, "y": 0.0}
    answer = f"<answer>{fed.group(1)}</answer>"
    return {answer[len(written) - 1]: 30.0} if len(written) - 1 < len(answer) else {END: 30.0}


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load_model(str(tiny_model_dir), "float32")


def _multiturn(tok, max_turns: int = 3, fmt=None) -> MultiTurn:
    fmt = fmt or PlainFormat(tok)
    return MultiTurn(ToolEnvironment(["calculator"], fmt, max_turns=max_turns), fmt, tok)


def _episodes(model, tok, ks, G, T=64, keys=None, mode="model", multiturn=None, sync_every=8):
    multiturn = multiturn or _multiturn(tok)
    rows = [{"prompt": f"k={k}", "answer": "5"} for k in ks]
    prompts = [multiturn.encode(r, "", "", 256)[0] for r in rows]
    keys = mx.random.split(mx.random.key(7), len(ks) * G) if keys is None else keys
    engine = RolloutEngine(tok, mode=mode, sync_every=sync_every).refresh(model)
    return multiturn.generate_many(engine, [(prompts, keys, rows)], G, SamplingParams(T, 1.0), "")[0], keys


def test_a_scripted_call_feeds_the_tools_output_as_context(tiny):
    _, tok = tiny
    rollout, _ = _episodes(Scripted(tok, caller_script), tok, [2, 5], G=2)
    for row in range(4):
        n = int(rollout.extents[row])
        ids, mask = rollout.completion_ids[row, :n].tolist(), rollout.mask[row, :n].tolist()
        text = rollout.texts[row]
        assert re.fullmatch(r"[xy]{%d}<calc>2\+3</calc><result>5</result>[xy]<answer>5</answer>" % (2 if row < 2 else 5),
                            text), text
        # the tool's tokens sit right after the call, with mask 0 and no sampler log-prob; the rest was sampled
        start = text.index(RESULT)
        fed = [0.0 if start <= i < start + len(RESULT) else 1.0 for i in range(len(text))] + [1.0]  # + end token
        assert mask == fed
        assert tok.decode([t for t, m in zip(ids, mask) if m == 0]) == RESULT
        lps = rollout.sampler_logprobs[row, :n].tolist()
        assert all(lp == 0 for lp, m in zip(lps, mask) if m == 0)
        # each drawn letter had probability 1/2, every other sampled token ~1
        assert sum(lps) == pytest.approx(-(3 if row < 2 else 6) * np.log(2), abs=1e-4)
        turns = [(t.origin, t.text) for t in rollout.transcripts[row].turns]
        assert turns == [("model", text[:start]), ("tool", "5"), ("model", text[start + len(RESULT):])]
    assert rollout.lengths.tolist() == [int(rollout.extents[r]) - len(RESULT) for r in range(4)]


def test_batched_rows_with_calls_at_different_steps_match_each_row_alone(tiny):
    _, tok = tiny
    model = Scripted(tok, caller_script)
    ks = [1, 6, 3, 9]
    together, keys = _episodes(model, tok, ks, G=3)
    assert len(set(together.texts)) > 4  # the drawn letters differ between rows
    for p, k in enumerate(ks):
        for g in range(3):
            r = p * 3 + g
            alone, _ = _episodes(model, tok, [k], G=1, keys=keys[r:r + 1])
            n = int(together.extents[r])
            assert alone.completion_ids[0, :n].tolist() == together.completion_ids[r, :n].tolist()
            assert alone.mask[0].tolist()[:n] == together.mask[r, :n].tolist()
            assert alone.texts[0] == together.texts[r]


def test_budget_counts_tool_tokens_and_cuts_the_episode(tiny):
    _, tok = tiny
    rollout, _ = _episodes(Scripted(tok, caller_script), tok, [4], G=1, T=4 + len(CALL) + 6)
    assert rollout.truncated.tolist() == [True]
    assert int(rollout.extents[0]) == 4 + len(CALL) + 6  # the result was cut to the budget
    assert rollout.texts[0].endswith(CALL + RESULT[:6])


def test_gradient_counts_only_the_model_tokens(tiny):
    """The update's gradient on a rollout with tool output inside equals the formula's, summed over the
    tokens the model sampled (token-mean loss, one iteration: -sum m A grad log p / sum m)."""
    model, tok = tiny
    rollout, _ = _episodes(Scripted(tok, caller_script), tok, [1, 3], G=2, T=40)
    assert float((rollout.mask[:, :int(rollout.extents.max())] == 0).sum()) > 0
    adv = group_advantages(mx.array([1.0, 0.0, 0.5, 2.0]), 2)
    cfg = build_config("train", overrides=parse_set(["model_name=x", "kl_coeff=0", "loss_type=dapo",
                                                     "max_new_tokens=40", "system_prompt="]))
    steps = [StepData(rollout, adv, None, None)]
    grads, _ = accumulate_gradients(make_grad_fn(cfg, model), steps, loss_weights(cfg, steps), 2, 0)

    def reference(m):
        total = mx.array(0.0)
        tokens = 0.0
        for r in range(4):
            n = int(rollout.extents[r])
            prompt = rollout.row_prompts[r]
            ids = prompt + rollout.completion_ids[r, :n].tolist()
            logp = nn.log_softmax(m(mx.array([ids[:-1]]))[0].astype(mx.float32) / cfg.rollout.temperature, axis=-1)
            for t in range(n):
                if rollout.mask[r, t].item():
                    total = total - adv[r] * logp[len(prompt) - 1 + t, ids[len(prompt) + t]]
                    tokens += 1
        return total / tokens

    want = nn.value_and_grad(model, reference)(model)[1]
    for (k, a), (_, b) in zip(tree_flatten(grads), tree_flatten(want)):
        np.testing.assert_allclose(np.array(a), np.array(b), rtol=2e-3, atol=2e-6, err_msg=k)
    assert any(float(mx.abs(a).max()) > 0 for _, a in tree_flatten(grads))


def test_rows_still_decoding_at_the_budget_keep_their_turn(tmp_path):
    """A model that never ends its turn: every row runs to max_new_tokens, on the copy as on the model."""
    loop = {"\n": {"x": 1.0}, "x": {"x": 0.5, "y": 0.5}, "y": {"x": 1.0}}
    model, tok = load_model(str(write_caller_model(tmp_path / "loop", loop)), "float32")
    multiturn = _multiturn(tok, fmt=NanochatFormat(tok))
    for mode in ("copy", "model"):
        out, _ = _episodes(model, tok, [0], G=2, T=16, mode=mode, multiturn=multiturn)
        assert out.extents.tolist() == [16, 16] and out.truncated.tolist() == [True, True], mode
        assert all(re.fullmatch("[xy]{16}", t) for t in out.texts), (mode, out.texts)
        assert [[t.info["ended"] for t in tr.turns] for tr in out.transcripts] == [["length"]] * 2


@pytest.mark.parametrize("T,sync_every", [(40, 8), (9, 8), (13, 4)])
def test_the_sampling_copy_runs_the_same_episodes(caller_dir, T, sync_every):
    """A llama that writes calls (nanochat's syntax): the engine's copy and the model path give the same
    episodes, also when rows are still decoding at the budget's last step."""
    model, tok = load_model(str(caller_dir), "float32")
    multiturn = _multiturn(tok, max_turns=4, fmt=NanochatFormat(tok))
    copy, keys = _episodes(model, tok, [0, 0, 0], G=4, T=T, mode="copy", multiturn=multiturn, sync_every=sync_every)
    plain, _ = _episodes(model, tok, [0, 0, 0], G=4, T=T, keys=keys, mode="model", multiturn=multiturn,
                         sync_every=sync_every)
    assert copy.texts == plain.texts and all(copy.texts)
    assert copy.mask.tolist() == plain.mask.tolist()
    assert copy.truncated.tolist() == plain.truncated.tolist()
    calls = [sum(t.origin == "tool" for t in tr.turns) for tr in copy.transcripts]
    assert sum(calls) >= 4 and len(set(calls)) >= 2  # rows call the tool, a different number of times


def _caller_episodes(caller_dir, seed: int, T: int, settings: list[dict]):
    """The tiny caller's 3 prompts x 4 rows (up to 4 turns) decoded on the sampling copy once per engine setting
    (RolloutEngine keywords). -> ([(episodes, engine)] in that order, the tokenizer)."""
    model, tok = load_model(str(caller_dir), "float32")
    multiturn = _multiturn(tok, max_turns=4, fmt=NanochatFormat(tok))
    rows = [{"prompt": "k=0", "answer": "5"}] * 3
    prompts = [multiturn.encode(r, "", "", 256)[0] for r in rows]
    keys = mx.random.split(mx.random.key(seed), 12)
    runs = []
    for setting in settings:
        engine = RolloutEngine(tok, mode="copy", **setting).refresh(model)
        runs.append((multiturn.generate_many(engine, [(prompts, keys, rows)], 4, SamplingParams(T, 1.0), "")[0],
                     engine))
    return runs, tok


def _assert_same_episodes(a, b) -> None:
    assert a.texts == b.texts and a.mask.tolist() == b.mask.tolist()
    assert a.completion_ids.tolist() == b.completion_ids.tolist() and a.truncated.tolist() == b.truncated.tolist()
    assert np.allclose(np.array(a.sampler_logprobs), np.array(b.sampler_logprobs), atol=1e-5)
    assert sum(sum(t.origin == "tool" for t in tr.turns) for tr in b.transcripts) >= 4


def test_when_next_turns_join_changes_admissions_not_episodes(caller_dir):
    """turn_wait (next turns join once 1/turn_wait of the batch is free) moves the copy's admissions, never a
    row's tokens: each row samples with its own key per step whatever slot and batch it decodes in."""
    # 12 rows: 1 admits next turns only into an empty batch, 8 at every freed row
    ((one, one_engine), (eight, eight_engine)), tok = _caller_episodes(
        caller_dir, 7, 40, [{"sync_every": 2, "turn_wait": wait} for wait in (1, 8)])
    _assert_same_episodes(one, eight)
    assert one_engine.row_steps != eight_engine.row_steps  # the admissions did move
    with pytest.raises(ValueError, match="at least 1"):
        RolloutEngine(tok, mode="copy", turn_wait=0)


@pytest.mark.parametrize("T,seed", [(40, 7), (14, 6)])
def test_a_sync_that_looks_back_changes_admissions_not_episodes(caller_dir, T, seed, monkeypatch):
    """lookahead (a sync reads the rows as of a few steps before it, its host work beside the last steps) finds
    ended turns later and so moves admissions, never a row's tokens or log-probs (T = 14: rows run out of budget
    inside a turn, which a sync must see as of the step it reads)."""
    waits, init = [], turns_module.TurnRows.__init__

    def spy(self, *args, **kwargs):
        init(self, *args, **kwargs)
        waits.append(self.wait)

    monkeypatch.setattr(turns_module.TurnRows, "__init__", spy)
    ((now, now_engine), (back, back_engine)), tok = _caller_episodes(
        caller_dir, seed, T, [{"sync_every": 4, "turn_wait": 1, "lookahead": ahead} for ahead in (0, 3)])
    _assert_same_episodes(now, back)
    assert back_engine.steps > now_engine.steps  # ended turns were seen later
    assert waits == [True, False]  # with lookahead the turns' gathers are queued, not waited for
    for bad in (-1, 4):
        with pytest.raises(ValueError, match="lookahead"):
            RolloutEngine(tok, mode="copy", sync_every=4, lookahead=bad)


class Guess(Environment):
    """A guessing game: the secret is the row's answer; the model guesses by its digits."""

    max_turns = 3

    def reset(self, row):
        return [{"role": "user", "content": f"Guess (k={row['k']})"}]

    def step(self, transcript):
        guess = re.findall(r"\d", transcript.last_model_turn)
        if guess and guess[-1] == transcript.row["answer"]:
            return StepResult(done=True, reward=1.0)
        return StepResult(observation="no", reward=0.0)


def test_an_environment_answers_after_each_turn(tiny):
    _, tok = tiny

    def guesser(prompt: str, completion: str) -> dict:  # guesses 1, then 2, ... one digit per turn
        # Scripted splits at the last assistant turn: earlier turns and answers are in `prompt`
        return {str(prompt.count("no") + 1): 30.0} if not completion else {END: 30.0}

    fmt = PlainFormat(tok)
    multiturn = MultiTurn(Guess(), fmt, tok)
    rows = [{"prompt": "", "answer": "2", "k": 0}, {"prompt": "", "answer": "7", "k": 1}]
    prompts = [multiturn.encode(r, "", "", 256)[0] for r in rows]
    engine = RolloutEngine(tok, mode="model").refresh(Scripted(tok, guesser))
    out = multiturn.generate_many(engine, [(prompts, mx.random.split(mx.random.key(0), 2), rows)], 1,
                                  SamplingParams(64, 1.0))[0]
    first, second = out.transcripts
    assert [t.text for t in first.turns] == ["1", "no", "2"] and first.reward == 1.0
    # three turns, then the episode ends; its last answer is kept for rewards, not fed to the model
    assert [t.origin for t in second.turns] == ["model", "environment"] * 3
    assert second.done and second.reward == 0.0 and second.turns[-1].info["max_turns"]
    assert tok.decode(out.completion_ids[1, :int(out.extents[1])].tolist()).count("no") == 2
    # the environment's text follows the end token the model sampled, in the chat template's user turn
    assert "<|im_end|>\n<|im_start|>user\nno<|im_end|>\n<|im_start|>assistant\n" in tok.decode(
        out.completion_ids[0].tolist())


class Broken(Guess):
    def step(self, transcript):
        raise KeyError("secret")


def test_an_environment_that_fails_is_one_line(tiny):
    _, tok = tiny
    multiturn = MultiTurn(Broken(), PlainFormat(tok), tok)
    rows = [{"prompt": "", "answer": "2", "k": 0}]
    engine = RolloutEngine(tok, mode="model").refresh(Scripted(tok, lambda p, c: {"1": 30.0} if not c else {END: 30.0}))
    with pytest.raises(UserError, match=r"environment Broken.step failed: KeyError: 'secret'"):
        multiturn.generate_many(engine, [([multiturn.encode(rows[0], "", "", 256)[0]], mx.random.split(mx.random.key(0), 1),
                                          rows)], 1, SamplingParams(16, 1.0))


@pytest.mark.parametrize("mode", ["copy", "model"])
def test_later_turns_join_the_running_batch_and_match_each_row_alone(tmp_path, mode):
    """Two batch steps of a llama that calls the calculator a varying number of times: on the copy, rows'
    next turns join the running batch (refill); on the model, they decode in waves. Either way each row
    gets the tokens it gets decoded alone."""
    model, tok = load_model(str(write_caller_model(tmp_path / "caller", CALLER)), "float32")
    multiturn = _multiturn(tok, max_turns=4, fmt=NanochatFormat(tok))
    engine = RolloutEngine(tok, mode=mode, sync_every=2).refresh(model)
    rows = [{"prompt": f"q{i}", "answer": "5"} for i in range(4)]
    prompts = [multiturn.encode(r, "", "", 256)[0] for r in rows]
    keys = mx.random.split(mx.random.key(3), 16)
    params = SamplingParams(40, 1.0)
    together = multiturn.generate_many(engine, [(prompts[:2], keys[:8], rows[:2]), (prompts[2:], keys[8:], rows[2:])],
                                       4, params)
    calls = [sum(t.origin == "tool" for t in tr.turns) for r in together for tr in r.transcripts]
    assert len(set(calls)) >= 3 and engine.uses_copy == (mode == "copy")
    for j, out in enumerate(together):
        for r in range(8):
            p, k = j * 2 + r // 4, j * 8 + r
            alone = multiturn.generate_many(engine, [([prompts[p]], keys[k:k + 1], [rows[p]])], 1, params)[0]
            n = int(out.extents[r])
            assert int(alone.extents[0]) == n
            assert alone.completion_ids[0, :n].tolist() == out.completion_ids[r, :n].tolist()
            assert alone.mask[0, :n].tolist() == out.mask[r, :n].tolist()
            assert alone.texts[0] == out.texts[r] and alone.truncated[0] == out.truncated[r]


def _cfg(model_dir, out, *items):
    base = [f"model_name={model_dir}", f"output_dir={out}", "batch_size=2", "num_generations=4",
            "max_new_tokens=40", "max_train_samples=8", "learning_rate=1e-2", "warmup_ratio=0",
            "log_completions_steps=1", "max_prompt_length=256", "system_prompt=", "tools=[\"calculator\"]",
            f"reward_funcs=[\"{_reward_file(out)}:calls\",\"{_reward_file(out)}:sees_tool_output\"]"]
    return build_config("train", overrides=parse_set(base + list(items)))


def _reward_file(out) -> str:
    """A reward that reads the episodes: the number of tool calls each made."""
    path = out / "calls_reward.py"
    path.write_text("def calls(prompts, completions, completion_ids, transcripts, **columns):\n"
                    "    return [sum(t.origin == 'tool' for t in tr.turns) for tr in transcripts]\n\n\n"
                    "def sees_tool_output(prompts, completions, completion_ids, **columns):\n"
                    "    return [float('<|output_start|>' in c) for c in completions]\n")
    return str(path)


@pytest.fixture(scope="module")
def caller_dir(tmp_path_factory):
    return write_caller_model(tmp_path_factory.mktemp("caller") / "model", CALLER)


@pytest.mark.parametrize("engine", ["model", "copy"])
def test_tool_run_logs_turns_and_resumes_exactly(caller_dir, tmp_path, monkeypatch, engine):
    """Waves on the model, turns inside the running batch on the copy: either resumes exactly."""
    full = run_mod.train(_cfg(caller_dir, tmp_path, "run_name=full", "save_steps=2", f"rollout_engine={engine}"))
    records = [json.loads(line) for line in (full / "completions.jsonl").read_text().splitlines()]
    tool_turns = [t for r in records for t in r["turns"] if t["origin"] == "tool"]
    assert tool_turns and all(t["info"]["tool"] == "calculator" for t in tool_turns)
    assert any(t["text"] == "5" for t in tool_turns)
    assert any(r["rewards"]["calls"] > 0 for r in records) and any(r["rewards"]["calls"] == 0 for r in records)
    # rewards score what the model wrote; the logged completion shows everything, tool output included
    assert all(r["rewards"]["sees_tool_output"] == 0 for r in records)
    assert any("<|output_start|>" in r["completion"] for r in records)
    cfg = _cfg(caller_dir, tmp_path, "run_name=cut", "save_steps=2", f"rollout_engine={engine}")
    interrupt_before_update(run_mod.train, cfg, monkeypatch, 3)
    resumed = run_mod.train(cfg, resume="latest")
    assert run_metrics(resumed) == run_metrics(full)
    assert (resumed / "completions.jsonl").read_text() == (full / "completions.jsonl").read_text()


@pytest.mark.parametrize("extra", [["train_type=lora", "rollout_engine=copy", "gradient_accumulation_steps=2"],
                                   ["dynamic_sampling=true"],
                                   ["reward_workers=2", "reward_executor=process"]])
def test_tools_run_with_lora_refill_dynamic_sampling_and_workers(caller_dir, tmp_path, extra):
    run_dir = run_mod.train(_cfg(caller_dir, tmp_path, "eval_every_updates=1", "eval_subset_size=4", *extra))
    evals = [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines()]
    assert all(0 <= e["tool_call_rate"] <= 1 for e in evals)
    records = [json.loads(line) for line in (run_dir / "completions.jsonl").read_text().splitlines()]
    assert any(t["origin"] == "tool" for r in records for t in r["turns"])


def test_bad_tool_settings_are_one_line(caller_dir, tmp_path):
    with pytest.raises(UserError, match="not both"):
        _cfg(caller_dir, tmp_path, "environment=env.py:Env")
    with pytest.raises(UserError, match="tool_format"):
        _cfg(caller_dir, tmp_path, "tool_format=xml")
    with pytest.raises(UserError, match="no_such_tool"):
        run_mod.train(_cfg(caller_dir, tmp_path, "tools=[\"no_such_tool\"]"))


def test_metrics_report_tool_use(caller_dir, tmp_path):
    run_dir = run_mod.train(_cfg(caller_dir, tmp_path))
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(0 < r["tool_call_rate"] <= 1 and r["tool_calls_mean"] >= r["tool_call_rate"] for r in rows)
    assert all(r["tool_error_fraction"] == 0.0 for r in rows)  # 2+3, 2+3+3, ... all evaluate


def test_an_environment_with_tools_gets_the_models_syntax(tmp_path, tiny):
    _, tok = tiny
    (tmp_path / "calc_env.py").write_text(
        "from mlx_grpo.tools.environments import ToolEnvironment\n\n\n"
        "class Calc(ToolEnvironment):\n"
        "    def __init__(self, fmt):\n"
        "        super().__init__(['calculator'], fmt, max_turns=2)\n")
    cfg = build_config("train", overrides=parse_set(["model_name=x", f"environment={tmp_path / 'calc_env.py'}:Calc"]))
    from mlx_grpo.rollout.multiturn import multiturn_for

    multiturn = multiturn_for(cfg, tok, "llama")
    assert multiturn.env.fmt is multiturn.fmt and multiturn.stop_strings == ("</calc>", "</tool>")
    assert "<calc>expression</calc>" in multiturn.prompt_text({"prompt": "2+2?"}, "")


def test_turn_keys_are_each_row_keys_split_as_the_formula_says():
    """Turn w of row r samples with split(key_r, w + 1)[w], rows in any order and turns mixed; taken one vmapped
    split per distinct turn."""
    keys = mx.random.split(mx.random.key(3), 6)
    rows, turns = [4, 0, 4, 2, 5, 1], [1, 3, 2, 1, 3, 7]
    got = turn_keys(keys, rows, turns)
    want = mx.stack([mx.random.split(keys[r], w + 1)[w] for r, w in zip(rows, turns)])
    assert np.array_equal(np.array(got), np.array(want))
    assert not np.array_equal(np.array(got), np.array(mx.stack([mx.random.split(keys[r], w + 1)[0]
                                                                 for r, w in zip(rows, turns)])))
    with pytest.raises(AssertionError, match="first turn"):
        turn_keys(keys, [0], [0])

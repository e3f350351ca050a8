"""Multi-turn rollouts: tool calls and environments inside the batched decode.

Owns `MultiTurn`, which runs one episode per row over the rollout engine and returns ordinary Rollout
records whose mask says where each token came from: 1 for tokens the model sampled, 0 for tool output
and environment text, which the model reads as context but is never trained on.

A turn ends at the end-of-turn token, a stop string, the stop string that closes a tool call, or the
completion's budget (max_new_tokens counts every token of every turn, tool output included). The
environment answers each ended turn on a thread pool, off the decode loop (a tool's output right after
the call, an environment's message after the end token); the answer is rendered in the model's syntax
(tools/calls.py), tokenized and appended to the row, and the row's next turn decodes:
- on the engine's sampling copy, inside the running batch: the engine hands each row that ended to
  `ended` at the loop's next sync, the answer computes while the other rows decode, and at the sync
  after that (at the same sync when the environment answers in microseconds: answers_at_once, the
  calculator) the row's next turn takes a freed slot (engine refill), ahead of prompts still waiting, with
  only the answer (and the turn's last token) prefilled on the row's kept cache (rollout/turns.py);
- on the model itself (decode.generate_rollout: other families, quantized weights, nanochat, CPUs by
  default), in waves: turn w of every row decodes in batch w, its whole context prefilled in one chunk, and
  a tool call starts as soon as the loop sees its row stopped.

A row's tokens depend only on its context and its keys (turn w samples with split(row key, w + 1)[w],
split into max_new_tokens step keys; the first turn with the row key itself), and the schedule waits for
answers at fixed syncs, never on the clock: which rows share a batch, and how long a tool takes, never
change them, so a multi-turn run is as reproducible, and resumes as exactly, as a single-turn one
(provided the tools are deterministic; on a GPU in bfloat16 the batch around a row can move a near-tie,
as engine.py says).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace

import mlx.core as mx
import numpy as np

from mlx_grpo.base.errors import UserError
from mlx_grpo.tools.environments import (Environment, Episode, StepResult, ToolEnvironment, observation_text,
                                         prompt_messages)
from mlx_grpo.base.user_files import import_file
from mlx_grpo.rollout.rollout_records import Rollout, SamplingParams, select_groups
from mlx_grpo.rollout.sampler import completion_end, end_ids, text_decoder, text_encoder
from mlx_grpo.rollout.decode import encode_chat_prompt
from mlx_grpo.tools.calls import ToolFormat, tool_format_for

# Environment.step calls at once: tools are mostly waiting (subprocesses, HTTP), not computing.
TOOL_THREADS = 8


@dataclass(frozen=True)
class _Ends:
    """Where a turn ends: after an end token (eos) or a stop string; budget: a completion's tokens. closing:
    sampler.closing_tokens' table for the stop strings, or None."""

    eos: frozenset
    stops: tuple[str, ...]
    budget: int
    closing: np.ndarray | None = field(default=None, compare=False)  # an array: not in == or hash


@dataclass
class _Row:
    """One episode's tokens so far: the completion is every turn's tokens, sampled or forced. Its key is the
    rollout's row key at its index among the rows (turn_keys)."""

    prompt: list[int]
    episode: Episode
    ids: list[int] = field(default_factory=list)
    mask: list[float] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    entropies: list[float] = field(default_factory=list)
    turn: int = 0  # model turns decoded
    done: bool = False
    truncated: bool = False
    answer: Future | None = None  # the environment's step on the last turn, running on the pool
    answered_ids: list[int] | None = None  # the turn's tokens `answer` was started for, cut after the stop string

    def add(self, ids, mask: float, logprobs=None, entropies=None) -> None:
        self.ids += list(ids)
        self.mask += [mask] * len(ids)
        self.logprobs += list(logprobs) if logprobs is not None else [0.0] * len(ids)
        self.entropies += list(entropies) if entropies is not None else [0.0] * len(ids)


class MultiTurn:
    """Episodes of `env` over the rollout engine. fmt: the model's tool-call syntax (tools/calls.py), which
    renders observations; tokenizer: the model's."""

    def __init__(self, env: Environment, fmt: ToolFormat, tokenizer):
        self.env, self.fmt, self.tokenizer = env, fmt, tokenizer
        self.decode, self.encode_text = text_decoder(tokenizer), text_encoder(tokenizer)
        # A tool call ends at the stop string that closes it; other environments end turns at end-of-turn.
        self.stop_strings = tuple(fmt.stop_strings) if isinstance(env, ToolEnvironment) else ()

    # ------------------------------------------------------------------ prompts
    def prompt_text(self, row: Mapping, system_prompt: str) -> str:
        """The first messages of a data row's episode, rendered (with the tools, for tool environments)."""
        messages = self.env.reset(row)
        if system_prompt and not any(m.get("role") == "system" for m in messages):
            messages = [{"role": "system", "content": system_prompt}, *messages]
        if isinstance(self.env, ToolEnvironment):
            return self.env.prompt_text(messages)
        return self.fmt.render_prompt(messages, {})

    def encode(self, row: Mapping, system_prompt: str, prefill: str, max_prompt_length: int) -> tuple[list[int], bool]:
        """The prompt ids of a data row (the prefill appended; the last max_prompt_length kept). -> (ids, cut)."""
        text = self.prompt_text(row, system_prompt) + prefill
        # as rollout.encode_chat_prompt: a template writes its own special tokens, plain text gets the BOS
        templated = getattr(self.tokenizer, "chat_template", None) is not None
        ids = list(self.tokenizer.encode(text, add_special_tokens=False) if templated else self.tokenizer.encode(text))
        if len(ids) > max_prompt_length:
            return ids[-max_prompt_length:], True
        return ids, False

    # ------------------------------------------------------------------ rollouts
    def generate_many(self, engine, jobs: list[tuple[list[list[int]], mx.array, list[Mapping]]], group_size: int,
                      params: SamplingParams, prefill_text: str = "") -> list[Rollout]:
        """The episodes of several batch steps, jobs = [(prompts, row keys [B*G, 2], data rows [B])]: one
        Rollout per job, as engine.generate_many returns them, with `transcripts` and `ends` set."""
        G, T = group_size, params.max_new_tokens
        rows = [_Row(prompts[i // G], Episode(self.env, data[i // G]))
                for prompts, _, data in jobs for i in range(len(prompts) * G)]
        keys = jobs[0][1] if len(jobs) == 1 else mx.concatenate([k for _, k, _ in jobs])  # rows' keys [rows, 2]
        # every turn splits its row key into T step keys, whatever its budget: a row's tokens never depend
        # on the other rows of its batch
        turn_params = replace(params, stop=tuple(params.stop) + self.stop_strings)
        ends = _Ends(frozenset(end_ids(self.tokenizer, params)[0]), turn_params.stop, T,
                     engine.closing_tokens(turn_params.stop))
        pool = ThreadPoolExecutor(TOOL_THREADS, thread_name_prefix="mlx-grpo-tool")
        try:
            if engine.uses_copy:  # later turns join the running batch in freed slots
                engine.generate_many([(p, k) for p, k, _ in jobs], G, turn_params, prefill_text,
                                     turns=_Turns(self, rows, keys, ends, pool))
            else:
                self._waves(engine, jobs, rows, keys, G, turn_params, prefill_text, ends, pool)
        except BaseException:  # Ctrl-C or an error: do not wait for tools still running
            pool.shutdown(wait=False, cancel_futures=True)
            raise
        pool.shutdown()
        return self._records(jobs, rows, G, params, prefill_text)

    def _waves(self, engine, jobs, rows: list[_Row], keys: mx.array, G: int, params: SamplingParams,
               prefill_text: str, ends: "_Ends", pool) -> None:
        """The model path (decode.generate_rollout): every row's turn w decodes in batch w; the rows that go
        on are prefilled with their contexts for the next batch."""
        T = params.max_new_tokens
        live = list(range(len(rows)))
        while live:
            if rows[live[0]].turn == 0:  # the first turn: the prompts' groups share their prefill
                outs = engine.generate_many([(p, k) for p, k, _ in jobs], G, params, prefill_text,
                                            on_stop=self._watcher(rows, live, pool, ends))
                out = select_groups(outs, [(i, g) for i, o in enumerate(outs) for g in range(len(o.prompt_ids))],
                                    end_ids(self.tokenizer, params)[1])
            else:
                nxt = [self._next_turn(rows[r], T) for r in live]
                live = [r for r, n in zip(live, nxt) if n is not None]
                if not live:
                    break
                nxt = [n for n in nxt if n is not None]
                watch = self._watcher(rows, live, pool, ends)
                out = engine.generate([c for c, _ in nxt], 1, params,
                                      turn_keys(keys, live, [rows[r].turn for r in live]), on_stop=watch,
                                      limits=np.array([b for _, b in nxt]))
            ids, lps, ents = out.completion_ids.tolist(), out.sampler_logprobs.tolist(), out.entropies.tolist()
            for slot, r in enumerate(live):
                n = int(out.lengths[slot])
                self._end_turn(rows[r], ids[slot][:n], lps[slot][:n], ents[slot][:n], ends, pool)
            live = [r for r in live if not rows[r].done]

    def _watcher(self, rows: list[_Row], live: list[int], pool, ends: "_Ends"):
        """generate_rollout's on_stop: start the environment on a row's turn as soon as the decode loop sees
        it stopped by a stop string (a tool call's end), while the other rows decode. It sees the turn that
        _end_turn will take (the same cut; a turn with an end token or past the budget is left to it)."""
        def on_stop(slot: int, ids: list[int]) -> None:
            row = rows[live[slot]]
            if row.answer is None and not (set(ids) & ends.eos) and len(row.ids) + len(ids) <= ends.budget:
                row.answer = pool.submit(row.episode.step, self.decode(ids), ended="stop")
                row.answered_ids = list(ids)
        return on_stop

    def _end_turn(self, row: _Row, ids: list[int], lps: list[float], ents: list[float], ends: "_Ends", pool) -> None:
        """Take a row's turn from the tokens it wrote (cut after its end token or stop string, as
        rollout.finish_rollout cuts, and at its budget) and start the environment's answer to it."""
        if row.answer is not None:  # seen stopped while decoding (_watcher): its cut and text are known already
            n = len(row.answered_ids)
            if ids[:n] != row.answered_ids:  # the step has recorded its turn already: it cannot be redone
                raise RuntimeError(f"a turn seen stopped as {self.decode(row.answered_ids)!r} ended as "
                                   f"{self.decode(ids[:n])!r}")
            row.add(ids[:n], 1.0, lps[:n], ents[:n])
            row.turn += 1
            return
        eos, room = ends.eos, ends.budget - len(row.ids)
        end = completion_end(self.tokenizer, ids, eos, ends.stops, ends.closing)
        if end is None or end > room:  # the budget ran out inside the turn
            n, how = min(len(ids), room), "length"
        else:
            n, how = end, "eos" if ids[end - 1] in eos else "stop"
        row.add(ids[:n], 1.0, lps[:n], ents[:n])
        row.turn += 1
        text = self.decode(ids[:n - 1] if how == "eos" else ids[:n])
        if how == "length":  # the episode ends unanswered
            row.episode.transcript.add("model", text, ended="length")
            row.episode.transcript.done = True
            row.done = row.truncated = True
        else:
            row.answer = pool.submit(row.episode.step, text, ended=how)

    def _next_turn(self, row: _Row, T: int) -> tuple[list[int], int] | None:
        """Wait for the environment's answer to a row's last turn and feed it in. -> (the row's context, its
        next turn's budget), or None when the episode has ended; the next turn's key is turn_keys'."""
        try:
            result = row.answer.result()
        except Exception as e:  # the environment's own code (a tool's errors come back as text instead)
            raise UserError(f"environment {type(self.env).__name__}.step failed: {type(e).__name__}: "
                            f"{' '.join(str(e).split())}") from e
        row.answer = row.answered_ids = None
        if result.done:
            row.done = True
            return None
        if not isinstance(result, StepResult) or not isinstance(result.observation, str):
            raise UserError(f"environment {type(self.env).__name__}.step returned {result!r:.120}: a StepResult "
                            "with done=True or an observation string")
        after_end = row.episode.transcript.turns[-2].info.get("ended") == "eos"  # [-1] is the observation
        forced = self.encode_text(observation_text(self.fmt, result, after_end))
        room = T - len(row.ids)
        row.add(forced[:room], 0.0)
        if len(forced) >= room:  # no room left for the model's next turn
            row.episode.transcript.turns[-1].info["fed_tokens"] = room  # of len(forced): cut at the budget
            row.episode.transcript.done = True
            row.done = row.truncated = True
            return None
        return row.prompt + row.ids, T - len(row.ids)

    def _records(self, jobs, rows: list[_Row], G: int, params: SamplingParams, prefill_text: str) -> list[Rollout]:
        eos_ids, pad_id = end_ids(self.tokenizer, params)
        out, start = [], 0
        for prompts, _, _ in jobs:
            mine = rows[start:start + len(prompts) * G]
            start += len(mine)
            width = max(1, max(len(r.ids) for r in mine))

            def padded(name: str, fill) -> mx.array:
                return mx.array([getattr(r, name) + [fill] * (width - len(r.ids)) for r in mine])

            texts = [prefill_text + self.decode(r.ids[:-1] if r.ids and r.ids[-1] in eos_ids
                                                          and r.mask[-1] else r.ids) for r in mine]
            out.append(Rollout(prompt_ids=[list(p) for p in prompts],
                               completion_ids=padded("ids", pad_id).astype(mx.int32),
                               mask=padded("mask", 0.0).astype(mx.float32),
                               sampler_logprobs=padded("logprobs", 0.0).astype(mx.float32),
                               truncated=np.array([r.truncated for r in mine]), texts=texts, group_size=G,
                               entropies=padded("entropies", 0.0).astype(mx.float32),
                               transcripts=[r.episode.transcript for r in mine],
                               ends=np.array([len(r.ids) for r in mine], dtype=np.int64)))
        return out


class _Turns:
    """The engine's turns hooks (engine.generate_many): engine row -> episode, and the engine rows waiting for
    their environment's answer."""

    def __init__(self, multiturn: MultiTurn, rows: list[_Row], keys: mx.array, ends: "_Ends", pool):
        self.multiturn, self.rows, self.keys, self.ends, self.pool = multiturn, rows, keys, ends, pool
        self.episode = list(range(len(rows)))  # engine row -> index in rows
        self.waiting: list[int] = []
        # take the answers at the sync that started them (an environment that is no Environment subclass: never)
        self.at_once = bool(getattr(multiturn.env, "answers_at_once", False))

    def ended(self, row: int, ids: list[int], logprobs: list[float], entropies: list[float]) -> int | None:
        """-> how many of ids the episode kept (the turn's cut), or None when no turn will follow (the episode has
        ended, or will once its environment answers)."""
        episode = self.rows[self.episode[row]]
        before = len(episode.ids)
        self.multiturn._end_turn(episode, ids, logprobs, entropies, self.ends, self.pool)
        if episode.done:
            return None
        self.waiting.append(row)
        if isinstance(self.multiturn.env, ToolEnvironment) and episode.ids[-1] in self.ends.eos:
            return None  # a tool episode ends at its end token (ToolEnvironment.step): no turn will resume here
        return len(episode.ids) - before

    def pending(self) -> bool:
        return bool(self.waiting)

    def take(self, first_row: int) -> tuple[list[tuple[list[int], int, int]], mx.array | None]:
        """-> the next turns of the rows waiting: [(context, budget, the engine row it continues)], and their
        keys [turns, 2] (None when there are none)."""
        assert first_row == len(self.episode)
        out, episodes = [], []
        for row in self.waiting:
            nxt = self.multiturn._next_turn(self.rows[self.episode[row]], self.ends.budget)
            if nxt is not None:
                episodes.append(self.episode[row])
                out.append((*nxt, row))
        self.episode += episodes
        self.waiting = []
        if not out:
            return out, None
        return out, turn_keys(self.keys, episodes, [self.rows[e].turn for e in episodes])


def turn_keys(keys: mx.array, rows: list[int], turns: list[int]) -> mx.array:
    """The key of turn w = turns[i] of row rows[i] (keys [rows, 2]: the rows' keys): the row key split w + 1
    ways, entry w (w >= 1; the first turn samples with the row key itself). -> [len(rows), 2]. One vmapped
    split per distinct turn, where splitting row by row dispatched two operations per row at every sync."""
    rows, turns = np.asarray(rows), np.asarray(turns)
    assert turns.min() >= 1, "a first turn samples with its row key"
    parts, order = [], []
    for w in np.unique(turns).tolist():
        at = np.flatnonzero(turns == w)
        parts.append(mx.vmap(lambda k, n=w + 1: mx.random.split(k, n))(keys[mx.array(rows[at])])[:, w])
        order.append(at)
    if len(parts) == 1:
        return parts[0]
    return mx.concatenate(parts)[mx.array(np.argsort(np.concatenate(order)))]


def load_environment(spec: str, fmt: ToolFormat | None = None) -> Environment:
    """An Environment from "path/to/file.py:ClassName", built with no arguments, or with fmt= (the model's
    call syntax) when its constructor takes `fmt` (a ToolEnvironment subclass)."""
    from pathlib import Path

    file_part, sep, name = spec.rpartition(":")
    if not sep or not file_part.endswith(".py") or not name:
        raise UserError(f"environment {spec!r}: expected path/to/file.py:ClassName")
    path = Path(file_part).expanduser().resolve()
    if not path.is_file():
        raise UserError(f"environment file not found: {path}")
    cls = getattr(import_file(path), name, None)
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise UserError(f"environment {spec!r}: {name} is not a subclass of mlx_grpo.tools.environments.Environment")
    try:
        return cls(fmt=fmt) if "fmt" in inspect.signature(cls).parameters else cls()
    except Exception as e:
        raise UserError(f"environment {spec!r}: {name}() failed: {type(e).__name__}: {e}") from None


def multiturn_for(cfg, tokenizer, model_type: str | None = None) -> MultiTurn | None:
    """The run's MultiTurn: tools (a ToolEnvironment) or a custom environment; None for single-turn runs."""
    if not cfg.rollout.tools and not cfg.rollout.environment:
        return None
    fmt = tool_format_for(tokenizer, model_type, cfg.rollout.tool_format)
    if cfg.rollout.environment:
        env = load_environment(cfg.rollout.environment, fmt)
        if isinstance(env, ToolEnvironment):  # its calls are found in its own syntax: render in it too
            fmt = env.fmt
    else:
        # max_tool_turns calls, each answered, then one more turn to give the answer
        env = ToolEnvironment(cfg.rollout.tools, fmt, max_turns=cfg.rollout.max_tool_turns + 1)
    return MultiTurn(env, fmt, tokenizer)


def tool_use(transcripts: list) -> tuple[np.ndarray, np.ndarray]:
    """Per episode: the tool calls it made, and how many of them came back as errors."""
    calls = [[t for t in tr.turns if t.origin == "tool"] for tr in transcripts]
    return (np.array([len(c) for c in calls], dtype=np.int64),
            np.array([sum(bool(t.info.get("error")) for t in c) for c in calls], dtype=np.int64))


def encode_prompts(multiturn: MultiTurn | None, tokenizer, examples: list, cfg,
                   system_prompt: str | None = None) -> list[tuple[list[int], bool]]:
    """Each example's prompt ids and whether they were cut: its episode's first messages (with the tools) in
    multi-turn runs, else its prompt through the chat template. system_prompt: the run's (prompts.RunPrompt,
    with its worked examples); default cfg.data.system_prompt."""
    d = cfg.data
    system = d.system_prompt if system_prompt is None else system_prompt
    if multiturn is None:
        return [encode_chat_prompt(tokenizer, e.prompt, system, d.prefill, d.max_prompt_length) for e in examples]
    return [multiturn.encode(data_row(e), system, d.prefill, d.max_prompt_length) for e in examples]


def rollouts(engine, multiturn: MultiTurn | None, jobs: list[tuple[list[list[int]], mx.array, list]], group_size: int,
             params: SamplingParams, prefill_text: str = "", on_done=None) -> list[Rollout]:
    """The rollouts of batch steps jobs = [(prompts, row keys [B*G, 2], examples [B])], decoded together:
    episodes with tools or an environment, else plain completions (engine.generate_many, which calls on_done
    with the rows ended so far; episodes do not: a row that ended a turn may go on)."""
    if multiturn is None:
        return engine.generate_many([(p, k) for p, k, _ in jobs], group_size, params, prefill_text, on_done=on_done)
    return multiturn.generate_many(engine, [(p, k, [data_row(e) for e in examples]) for p, k, examples in jobs],
                                   group_size, params, prefill_text)


def model_texts(rollout: Rollout, prefill_text: str) -> list[str]:
    """What the model wrote in each completion, as rewards and evaluation score it: its turns joined after the
    prefill (a tool's output is not its answer); the rollout's texts for single-turn ones."""
    if rollout.transcripts is None:
        return list(rollout.texts)
    return [prefill_text + t.completion for t in rollout.transcripts]


def data_row(example) -> dict:
    """The data row an environment's reset and step see: prompt, answer and every other column."""
    return {"prompt": example.prompt, "answer": example.answer, **example.columns}


__all__ = ["MultiTurn", "data_row", "encode_prompts", "load_environment", "model_texts", "multiturn_for",
           "prompt_messages", "rollouts", "tool_use"]

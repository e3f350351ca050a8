"""Evaluation: exact-match accuracy (greedy) or pass@k (sampled) of a model on a data set.

An answer counts when the text inside the last <answer> tags equals the gold answer (the
`correctness` reward); `lenient` also accepts the last number in the text, which is how untrained
models that ignore the tag format are usually scored.
"""

from __future__ import annotations

import json
import re
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np
from tqdm import tqdm

from mlx_grpo.base.errors import UserError
from mlx_grpo.config import Config, command_default, save_json
from mlx_grpo.data.examples import Example, subset
from mlx_grpo.data.prompts import WorkedExamples, build_run_prompts, question_text, select_worked_examples
from mlx_grpo.data.sources import run_examples
from mlx_grpo.rewards.builtin import answers_match, extract_answer
from mlx_grpo.rollout.engine import RolloutEngine, check_rollout_model
from mlx_grpo.rollout.multiturn import MultiTurn, encode_prompts, model_texts, multiturn_for, rollouts, tool_use
from mlx_grpo.rollout.rollout_records import SamplingParams

_LAST_NUMBER = re.compile(r"-?[\d,]*\.?\d+")


@dataclass
class EvalResult:
    accuracy: float
    lenient_accuracy: float
    format_rate: float
    records: list[dict]
    tool_call_rate: float | None = None  # with tools: share of first answers that made at least one call


def lenient_match(text: str, gold: str) -> bool:
    """The tagged answer matches, or else the last number in the text does."""
    tagged = extract_answer(text)
    if tagged is not None and answers_match(tagged, gold):
        return True
    numbers = _LAST_NUMBER.findall(text)
    return bool(numbers) and answers_match(numbers[-1], gold)


def answer_records(model, tokenizer, examples: list[Example], cfg: Config, *, max_new_tokens: int,
                   num_samples: int = 1, temperature: float = 0.0, seed: int | None = None,
                   progress: bool = False, engine: RolloutEngine | None = None,
                   multiturn: MultiTurn | None = None, system_prompt: str | None = None,
                   lines: bool = False) -> list[dict]:
    """One record per example: its completions and whether they are right (greedy when num_samples == 1;
    an example passes if any sample is right). seed (default cfg.run.seed) keys sampled evaluations.
    progress: show a progress bar over the examples (on a terminal only; an example counts once all its samples
    have ended, as the decode loop sees them every few tokens; with tools, per batch). engine: one already
    sampling from `model` (the trainer's), so evaluation builds no second copy of the weights. multiturn: the
    run's tools or environment (default: built from cfg); answers are then scored on the model's own turns.
    system_prompt: the run's, with its worked examples (prompts.RunPrompt.system; default cfg.data.system_prompt).
    lines: where progress shows no bar (not a terminal), print a line to stderr after each batch of
    eval_batch_size."""
    sampling = cfg.rollout
    params = SamplingParams(max_new_tokens, temperature if num_samples > 1 else 0.0, sampling.top_p, sampling.top_k,
                            sampling.min_p, tuple(sampling.stop))
    records = []
    engine = engine or RolloutEngine(tokenizer, mode=cfg.rollout.rollout_engine).refresh(model)
    if multiturn is None:
        multiturn = multiturn_for(cfg, tokenizer, getattr(getattr(model, "args", None), "model_type", None))
    key = mx.random.key(cfg.run.seed if seed is None else seed)
    # lines: the eval command's own bar stays on screen when done; a training run's disappears under its own
    bar = tqdm(total=len(examples), desc="eval", unit="example", leave=lines, disable=None if progress else True)
    started = time.perf_counter()
    with _ticking(bar):
        for start in range(0, len(examples), cfg.eval.eval_batch_size):
            chunk = examples[start:start + cfg.eval.eval_batch_size]
            key, sub = mx.random.split(key)
            prompts = [ids for ids, _ in encode_prompts(multiturn, tokenizer, chunk, cfg, system_prompt)]
            keys = mx.random.split(sub, len(prompts) * num_samples)
            follow = None if bar.disable else _follow(bar, start, len(chunk), num_samples)
            rollout = rollouts(engine, multiturn, [(prompts, keys, chunk)], num_samples, params, cfg.data.prefill,
                               on_done=follow)[0]
            written = model_texts(rollout, cfg.data.prefill)  # with tools: what the model wrote, not the tools' output
            calls = None if rollout.transcripts is None else tool_use(rollout.transcripts)[0]
            for i, example in enumerate(chunk):
                texts = rollout.texts[i * num_samples:(i + 1) * num_samples]
                scored = written[i * num_samples:(i + 1) * num_samples]
                correct = [answers_match(extract_answer(t), example.answer) for t in scored]
                record = {"prompt": example.prompt, "answer": example.answer, "completions": texts,
                          "correct": any(correct), "lenient": any(lenient_match(t, example.answer) for t in scored),
                          "formatted": extract_answer(scored[0]) is not None}
                if calls is not None:
                    record["tool_calls"] = int(calls[i * num_samples])
                records.append(record)
            bar.update(start + len(chunk) - bar.n)
            if lines and progress and bar.disable:
                print(f"[mlx-grpo] eval: {len(records)}/{len(examples)} examples, "
                      f"{sum(r['correct'] for r in records)} correct, {time.perf_counter() - started:.0f}s",
                      file=sys.stderr, flush=True)
    bar.close()
    return records


def _follow(bar: tqdm, start: int, examples: int, num_samples: int):
    """The decode loop's on_done for a batch of `examples` whose first is example `start`: the bar moves to the
    examples whose every sample has ended."""
    ended = np.zeros(examples * num_samples, dtype=bool)

    def advance(first: int, done: np.ndarray) -> None:
        ended[first:first + len(done)] = done
        bar.update(max(0, start + int(ended.reshape(examples, num_samples).all(axis=1).sum()) - bar.n))
    return advance


@contextmanager
def _ticking(bar: tqdm, every: float = 1.0):
    """Redraw the bar every `every` seconds while inside: its count moves as the decode loop sees answers end
    (every few tokens; with tools once per batch), and in between the elapsed time shows the work goes on."""
    stop = threading.Event()

    def tick() -> None:
        while not stop.wait(every):
            bar.refresh()

    thread = threading.Thread(target=tick, name="mlx-grpo-eval-bar", daemon=True)
    if not bar.disable:
        thread.start()
    try:
        yield
    finally:
        stop.set()
        if thread.is_alive():
            thread.join()


def summarize(records: list[dict]) -> EvalResult:
    """Accuracy, lenient accuracy and format rate of answer_records' records."""
    n = max(len(records), 1)
    calls = None if not records or "tool_calls" not in records[0] else sum(r["tool_calls"] > 0 for r in records) / n
    return EvalResult(sum(r["correct"] for r in records) / n, sum(r["lenient"] for r in records) / n,
                      sum(r["formatted"] for r in records) / n, records, calls)


def evaluate_model(model, tokenizer, examples: list[Example], cfg: Config, *, max_new_tokens: int,
                   num_samples: int = 1, temperature: float = 0.0, progress: bool = False,
                   system_prompt: str | None = None, lines: bool = False) -> EvalResult:
    """Answer every example (greedy when num_samples == 1); an example passes if any sample is right."""
    return summarize(answer_records(model, tokenizer, examples, cfg, max_new_tokens=max_new_tokens,
                                    num_samples=num_samples, temperature=temperature, progress=progress,
                                    system_prompt=system_prompt, lines=lines))


def eval_worked(cfg: Config, split: str, pool: list[Example]) -> WorkedExamples:
    """The run's drawn worked examples, drawn as training drew them (the whole training split, the test
    split's questions excluded), so that evaluation sees the prompt training saw."""
    if not cfg.eval.eval_worked_examples or not (cfg.data.worked_examples or cfg.data.worked_examples_text):
        return WorkedExamples()
    train = run_examples(cfg, "train")
    test = pool if split == "test" else run_examples(cfg, "test")
    worked = select_worked_examples(cfg, train, test, trains=False)[0]  # eval trains on nothing: all may be shown
    shown = {question_text(e.prompt).strip() for e in worked.examples}
    if any(question_text(e.prompt).strip() in shown for e in pool):
        raise UserError(f"the {split} split holds the worked examples' questions: evaluate it with "
                        "eval_worked_examples = false")
    return worked


def data_label(cfg: Config) -> str:
    """The data set `eval` answers, as a file-name part: the eval file's or the `dataset`'s name ('gsm8k' of
    'openai/gsm8k', 'test' of 'data/test.jsonl'), with only the characters a file name keeps everywhere."""
    source = cfg.data.eval_dataset_path or cfg.data.dataset
    name = Path(source.rstrip("/")).stem if Path(source).suffix in (".jsonl", ".json", ".parquet") else \
        Path(source.rstrip("/")).name
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name) or "data"


def default_output(cfg: Config, split: str, shown: int, total: int) -> tuple[Path, str]:
    """Where `eval` writes without --output, and why there: a checkpoint's results go into its run directory,
    any other model's into <output_dir>/eval/ (the directory that holds the run directories), never loose in
    the current directory. The name carries what was answered, so that another data set, subset size or k
    writes beside earlier results instead of over them:
    eval-<checkpoint>-<data set>-<split>[-<shown>of<total>][-pass<k>].jsonl."""
    model = Path(cfg.model.model_name)
    name = f"eval-{model.name}-{data_label(cfg)}-{split}" + (f"-{shown}of{total}" if shown < total else "") + (
        f"-pass{cfg.eval.eval_num_samples}" if cfg.eval.eval_num_samples > 1 else "") + ".jsonl"
    if (model / "trainer_state.json").is_file():  # a checkpoint: its parent is the run that wrote it
        return model.parent / name, "the checkpoint's run directory"
    runs = Path(command_default("train", "output_dir"))
    return runs / "eval" / name, "not a checkpoint of a run"


@dataclass
class EvalJob:
    """What `eval` answers and where it writes (prepare_eval), checked before the model loads."""

    split: str
    examples: list[Example]
    worked: WorkedExamples
    out: Path
    where: str | None  # why the default output is there (None: --output given)


def _check_writable(out: Path, where: str | None) -> None:
    """Open the output file and the config file beside it for writing (created files and directories removed
    again: an eval that fails later leaves nothing behind), so that an output that cannot be written stops
    `eval` before the model loads, not after every question."""
    named = f"--output {out}" if where is None else f"the default output {out} ({where}; --output FILE to choose)"
    try:  # is_dir raises for a name the system refuses (too long)
        if out.is_dir():
            raise UserError(f"{named} is a directory: give a file name")
    except OSError:
        pass  # said below, where the file is opened
    made = [d for d in (out.parent, *out.parent.parents) if not d.exists()]  # the ones mkdir creates
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"{named}: cannot create {out.parent}: {exc.strerror or exc}") from None
    try:
        for path in (out, Path(f"{out}.config.json")):
            try:
                existed = path.exists()
                with open(path, "a"):  # "a": an existing file is not emptied by the check
                    pass
                if not existed:
                    path.unlink()
            except OSError as exc:
                raise UserError(f"{named}: cannot write {path.name}: {exc.strerror or exc}") from None
    finally:
        for directory in made:  # innermost first; finish_eval makes them again
            try:
                directory.rmdir()
            except OSError:  # something else wrote there meanwhile: not ours to remove
                break


def prepare_eval(cfg: Config, split: str = "test", output: str | None = None) -> EvalJob:
    """The fixed seeded subset of the split, the run's worked examples, and a writable output path."""
    pool = run_examples(cfg, split, cfg.data.eval_dataset_path, path_key="eval_dataset_path")
    worked = eval_worked(cfg, split, pool)
    examples = subset(pool, cfg.eval.eval_subset_size, cfg.run.seed)
    where = None
    if output is None:
        out, where = default_output(cfg, split, len(examples), len(pool))
    else:
        out = Path(output)
    # Checked before the (slow) evaluation; the write itself can still fail (a full disk): one line then.
    _check_writable(out, where)
    return EvalJob(split, examples, worked, out, where)


def finish_eval(cfg: Config, job: EvalJob, result: EvalResult, prompt_record: dict) -> EvalResult:
    """Write the records (and the config beside them) and print the summary line."""
    out = job.out
    try:
        out.parent.mkdir(parents=True, exist_ok=True)  # prepare_eval's check left no directory behind
        out.write_text("".join(json.dumps(r) + "\n" for r in result.records))
        save_json(cfg, f"{out}.config.json", {"split": job.split, "prompt": prompt_record})
    except OSError as exc:
        raise UserError(f"--output {out}: cannot write the results: {exc.strerror or exc}") from None
    metric = "accuracy" if cfg.eval.eval_num_samples == 1 else f"pass@{cfg.eval.eval_num_samples}"
    print(f"{metric}: {result.accuracy:.4f} ({sum(r['correct'] for r in result.records)}/{len(result.records)})"
          f"  lenient: {result.lenient_accuracy:.4f}  formatted: {result.format_rate:.4f}"
          + ("" if result.tool_call_rate is None else f"  tool calls: {result.tool_call_rate:.4f}"))
    print(f"wrote {len(result.records)} record{'s' * (len(result.records) != 1)} to {out}"
          + ("" if job.where is None else f" ({job.where}; --output FILE to choose)"), file=sys.stderr)
    return result


def run_eval(cfg: Config, split: str = "test", output: str | None = None) -> EvalResult:
    """`mlx-grpo eval`: accuracy (or pass@k) on a fixed seeded subset; per-example JSONL written.
    (Image data sets: commands/vision_eval.py's run_vision_eval.)"""
    from mlx_grpo.models.model_loading import load_model

    job = prepare_eval(cfg, split, output)
    model, tokenizer = load_model(cfg.model.model_name, cfg.model.model_dtype)
    engine_warning = check_rollout_model(cfg.rollout.rollout_engine, model)
    if engine_warning:
        print(f"[mlx-grpo] warning: {engine_warning}", file=sys.stderr)
    multiturn = multiturn_for(cfg, tokenizer, getattr(getattr(model, "args", None), "model_type", None))
    prompt = build_run_prompts(cfg, tokenizer, multiturn, job.worked, job.examples, lambda line: None)[1]
    print(f"[mlx-grpo] evaluating with {prompt.describe()}", file=sys.stderr)
    result = summarize(answer_records(model, tokenizer, job.examples, cfg, max_new_tokens=cfg.eval.eval_max_new_tokens,
                                      num_samples=cfg.eval.eval_num_samples, temperature=cfg.rollout.temperature,
                                      progress=True, multiturn=multiturn, system_prompt=prompt.system, lines=True))
    return finish_eval(cfg, job, result, prompt.record())

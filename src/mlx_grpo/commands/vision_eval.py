"""Evaluation on image + text prompts: the answers of a GRPO run's in-run evaluation on images
(vlm/image_prompts.ImagePrompts) and `mlx-grpo eval` of a vision-language model or checkpoint on a data set with an image column. Records and
the summary line are commands/evaluate.py's, each record naming its images; prompts are built as training builds them
(vlm/image_rollout.py), answered greedily (or sampled for pass@k) through the same rollout."""

from __future__ import annotations

import sys
from pathlib import Path

import mlx.core as mx
from tqdm import tqdm

from mlx_grpo.commands.evaluate import EvalResult, finish_eval, lenient_match, prepare_eval, summarize
from mlx_grpo.config import Config
from mlx_grpo.data.examples import Example
from mlx_grpo.data.prompts import build_run_prompts
from mlx_grpo.rewards.builtin import answers_match, extract_answer
from mlx_grpo.rollout.multiturn import multiturn_for
from mlx_grpo.rollout.rollout_records import SamplingParams
from mlx_grpo.rollout.sampler import pad_token_id
from mlx_grpo.vlm.families import check_grpo_family, eos_ids, read_config
from mlx_grpo.vlm.image_rollout import encode_vision_prompt, vision_rollout
from mlx_grpo.vlm.policy_model import VisionPolicy


def vision_answer_records(model: VisionPolicy, processor, tokenizer, examples: list[Example], cfg: Config, *,
                          max_new_tokens: int, eos: set[int], pad_id: int, num_samples: int = 1,
                          temperature: float = 0.0, seed: int | None = None, system_prompt: str | None = None,
                          progress: bool = False) -> list[dict]:
    """One record per example (evaluate.answer_records' fields plus `images`): greedy when num_samples == 1,
    else num_samples samples at `temperature` (an example passes if any is right). Each batch of
    eval_batch_size prompts registers its images in the model's feature table (encoded once each)."""
    r = cfg.rollout
    params = SamplingParams(max_new_tokens, temperature if num_samples > 1 else 0.0, r.top_p, r.top_k, r.min_p)
    system = cfg.data.system_prompt if system_prompt is None else system_prompt
    key = mx.random.key(cfg.run.seed if seed is None else seed)
    records = []
    bar = tqdm(total=len(examples), desc="eval", unit="example", disable=None if progress else True)
    for start in range(0, len(examples), cfg.eval.eval_batch_size):
        chunk = examples[start:start + cfg.eval.eval_batch_size]
        key, sub = mx.random.split(key)
        prompts = [encode_vision_prompt(processor, e, cfg.data.image_column, system, Path.cwd(),
                                        cfg.data.max_prompt_length) for e in chunk]
        ids = [model.register(p.ids, p.pixel_values, p.grid_thw) for p in prompts]
        keys = mx.random.split(sub, len(chunk) * num_samples)
        rollout = vision_rollout(model, ids, keys, num_samples, params, eos, pad_id, tokenizer)
        for i, (example, prompt) in enumerate(zip(chunk, prompts)):
            texts = rollout.texts[i * num_samples:(i + 1) * num_samples]
            records.append({"prompt": example.prompt, "images": prompt.images, "answer": example.answer,
                            "completions": texts,
                            "correct": any(answers_match(extract_answer(t), example.answer) for t in texts),
                            "lenient": any(lenient_match(t, example.answer) for t in texts),
                            "formatted": extract_answer(texts[0]) is not None})
        bar.update(len(chunk))
    bar.close()
    return records


def load_eval_model(model_name: str, model_dtype: str):
    """(VisionPolicy in its compute dtype, eval mode; processor; tokenizer with the model's eos ids; pad id)
    of a converted VLM directory or a checkpoint of a GRPO run on images (full or lora/dora)."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    from mlx_grpo.models.precision import cast_floats, compute_dtype
    from mlx_grpo.commands.vision_inference import load_vlm

    check_grpo_family(read_config(Path(model_name).expanduser()).get("model_type", ""), model_name)
    vlm, processor = load_vlm(model_name)
    model = VisionPolicy(vlm)
    model.eval()
    cast_floats(model, compute_dtype(model_name, model_dtype, model))
    tokenizer = TokenizerWrapper(processor.tokenizer, eos_token_ids=eos_ids(model_name, processor.tokenizer))
    return model, processor, tokenizer, pad_token_id(tokenizer)


def run_vision_eval(cfg: Config, split: str = "test", output: str | None = None) -> EvalResult:
    """`mlx-grpo eval` of a vision-language model on an image data set: evaluate.run_eval's subset, prompt
    (the run's evaluation prompt), records and summary line."""
    job = prepare_eval(cfg, split, output)
    model, processor, tokenizer, pad_id = load_eval_model(cfg.model.model_name, cfg.model.model_dtype)
    prompt = build_run_prompts(cfg, tokenizer, multiturn_for(cfg, tokenizer), job.worked, job.examples,
                               lambda line: None)[1]
    print(f"[mlx-grpo] evaluating images ({cfg.data.image_column!r}) with {prompt.describe()}", file=sys.stderr)
    records = vision_answer_records(model, processor, tokenizer, job.examples, cfg,
                                    max_new_tokens=cfg.eval.eval_max_new_tokens, eos=set(tokenizer.eos_token_ids),
                                    pad_id=pad_id, num_samples=cfg.eval.eval_num_samples,
                                    temperature=cfg.rollout.temperature, system_prompt=prompt.system, progress=True)
    return finish_eval(cfg, job, summarize(records), prompt.record())

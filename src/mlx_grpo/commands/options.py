"""The command line's surface beyond the config fields: short flag aliases for the most used fields and
the per-invocation options of each command (what to do, not how: --resume, --prompt, --output-dir, ...).
The config package declares every field, default and help text; commands/cli.py builds the parsers from both."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Short flags for the most used fields, besides the automatic --field-name form.
FLAG_ALIASES: dict[str, list[str]] = {
    "model_name": ["--model"],
    "max_new_tokens": ["--max-tokens"],
    "system_prompt": ["--system"],
    "eval_subset_size": ["--samples"],
    "eval_num_samples": ["--num-samples"],
}
# Per-command aliases that win over FLAG_ALIASES: eval's answers are as long as eval_max_new_tokens.
COMMAND_FLAG_ALIASES: dict[str, dict[str, list[str]]] = {"eval": {"eval_max_new_tokens": ["--max-tokens"]}}


@dataclass(frozen=True)
class Option:
    """A per-invocation command-line option that is not a config field (what to do, not how)."""

    flags: tuple[str, ...]
    help: str
    kind: str = "str"  # str | int | flag | choice | optional | positional | append (repeatable str)
    default: Any = None
    choices: tuple[str, ...] = ()


COMMAND_OPTIONS: dict[str, list[Option]] = {
    "convert": [
        Option(("--hf-path",), "Hugging Face model to convert: a hub id or a local directory."),
        Option(("--gguf",), "GGUF file to convert (llama-family architectures)."),
        Option(("--nanochat",), "nanochat checkpoint directory to convert: model_<step>.pt, meta_<step>.json "
               "and tokenizer.pkl (reading .pt needs the `nanochat` extra, PyTorch)."),
        Option(("--step",), "With --nanochat: the checkpoint step to convert (default: the latest).", kind="int"),
        Option(("--output-dir",), "Directory to write the MLX model into (must not exist)."),
        Option(("--quantize", "-q"), "Quantize the weights.", kind="flag", default=False),
        Option(("--bits",), "Bits per weight when quantizing.", kind="choice", default="4",
               choices=("2", "3", "4", "6", "8")),
        Option(("--group-size",), "Quantization group size.", kind="int", default=64),
        Option(("--dtype",), "Dtype of the unquantized weights (default: the source's; bfloat16 for GGUF; "
               "for nanochat the widest type stored, float32 for its training checkpoints).",
               kind="choice", choices=("float16", "bfloat16", "float32")),
        Option(("--trust-remote-code",), "Allow custom code from the hub repository.", kind="flag",
               default=False),
    ],
    "generate": [
        Option(("--prompt", "-p"), "Prompt text (use - to read it from stdin)."),
        Option(("--prompts-file",), "File of prompts: one per line, or JSONL with a 'prompt' field; "
               "generated in batches."),
        Option(("--output", "-o"), "JSONL file for --prompts-file results (default: stdout)."),
        Option(("--batch-size",), "Prompts per batch with --prompts-file.", kind="int", default=32),
        Option(("--stream",), "Print tokens as they are generated.", kind="flag", default=False),
        Option(("--raw",), "Send the prompt as raw text, without the chat template.", kind="flag",
               default=False),
        Option(("--image",), "Image file for a vision-language model (repeatable; with --prompt).",
               kind="append"),
        Option(("--verbose", "-v"), "Print prompt/generation tokens per second and peak memory.",
               kind="flag", default=False),
    ],
    "chat": [
        Option(("--image",), "Image file the conversation is about, for a vision-language model (repeatable).",
               kind="append"),
        Option(("--verbose", "-v"), "Print tokens per second and peak memory after each answer.",
               kind="flag", default=False),
    ],
    "train": [
        Option(("--resume",), "Resume from the latest checkpoint of the run directory, or from the "
               "checkpoint directory given.", kind="optional"),
    ],
    "sft": [
        Option(("--resume",), "Resume from the latest checkpoint of the run directory, or from the "
               "checkpoint directory given.", kind="optional"),
    ],
    "fuse": [
        Option(("--checkpoint",), "Checkpoint directory of a lora/dora run (adapters.safetensors + "
               "adapter_config.json)."),
        Option(("--output-dir",), "Directory to write the merged MLX model into (must not exist)."),
        Option(("--dequantize",), "With a quantized (QLoRA) base: write float weights instead of re-quantizing "
               "the merged ones.", kind="flag", default=False),
    ],
    "plot": [
        Option(("run_dir",), "Run directory of `mlx-grpo train` (holds metrics.jsonl, and eval.jsonl if it "
               "evaluated).", kind="positional"),
        Option(("--output", "-o"), "PNG file to write (default: RUN_DIR/curves.png)."),
    ],
    "eval": [
        Option(("--split",), "Data split to evaluate.", default="test"),
        Option(("--output", "-o"), "JSONL file of per-example results (default: a checkpoint's run directory, "
                                   "RUN/eval-<checkpoint>-<dataset>-<split>[-<n>of<total>][-pass<k>].jsonl; any "
                                   "other model: runs/eval/eval-<model>-<dataset>-<split>...jsonl)."),
    ],
}

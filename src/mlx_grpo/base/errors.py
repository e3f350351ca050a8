"""The errors the CLI shows as one line and exit 2: UserError (bad input) and a failed device allocation."""

import re
import traceback
from pathlib import Path


class UserError(Exception):
    """A problem the user can fix (bad config, missing file, malformed row); shown without a traceback."""


# How MLX's backends word a failed allocation, on the message's first line (CUDA; Metal; both allocators'
# "[malloc] Unable to allocate"; a C++ bad_alloc reaches Python as MemoryError): matched exactly, so that
# another error quoting the words (a completion's text, say) keeps its traceback
_OOM_FORMS = re.compile(r"^(cuda\w*\(.*\) failed: out of memory|\[(metal|cuda|malloc)(::malloc)?\] "
                        r"(unable to allocate|attempting to allocate|resource limit)|\[metal\] command buffer "
                        r"execution failed: insufficient memory|(std::)?bad_alloc)", re.IGNORECASE)
# Where the allocation failed (the first entry any of our traceback's files matches): the phase, the settings
# that bound its memory, and whether --resume accepts them changed. Evaluation decodes through rollout/ too.
_TRAINING_PASS_FIX = "lower micro_batch_size or micro_batch_tokens, or set grad_checkpoint = true"
_OOM_PHASES = (
    (("/commands/evaluate.py", "/commands/vision_eval.py"), "while evaluating",
     "lower eval_batch_size or eval_max_new_tokens", True),
    (("/rollout/", "/vlm/image_rollout.py"), "while sampling rollouts",
     "lower batch_size x num_generations, max_new_tokens or max_prompt_length", False),
    (("/training/", "/sft/steps.py"), "in the training pass", _TRAINING_PASS_FIX, True),
)
_NO_PHASE = ("/training/distributed.py",)  # the ranks' collectives: the frames of their callers tell the phase


def out_of_memory(exc: BaseException, command: str, checkpoint: Path | None = None,
                  new_run: str | None = None) -> str | None:
    """The one line for a failed allocation (None for any other error): where it happened, the first line of
    the backend's message, and what to lower. `checkpoint`: the one to resume from (train/sft, as
    checkpoint.resume_point picks it), and whether --resume takes the fix or it needs a new run from there
    (new_run: how one starts from the checkpoint, sft/steps.start_from's words; an adapter checkpoint is merged
    first). A traceback would hide that the fix is a setting."""
    text = str(exc).strip()
    first = text.splitlines()[0] if text else type(exc).__name__
    if not isinstance(exc, MemoryError) and not _OOM_FORMS.match(first):
        return None
    files = (frame.f_code.co_filename.replace("\\", "/") for frame, _ in traceback.walk_tb(exc.__traceback__))
    ours = [f for f in files if "mlx_grpo" in f and not f.endswith(_NO_PHASE)]
    where, advice, resumes = "", "lower batch_size, num_generations or max_new_tokens", False
    for parts, phase, fix, takes in _OOM_PHASES:
        if any(part in f for part in parts for f in ours):
            where, advice, resumes = f" {phase}", fix, takes
            break
    if command == "generate":
        advice = "lower --batch-size or max_new_tokens"
    elif command == "chat":
        advice = "lower max_new_tokens"
    elif command == "sft" and not where:
        advice = _TRAINING_PASS_FIX
    elif command == "eval":
        advice = "lower eval_batch_size or eval_max_new_tokens"
    kind = "memory" if isinstance(exc, MemoryError) else "device memory"  # MemoryError: perhaps the host's
    line = f"out of {kind}{where} ({first}): {advice}, or stop other processes using the GPU."
    if command in ("train", "sft") and checkpoint is not None:
        line += f" {checkpoint.name} is intact: --resume {checkpoint} continues from it" + (
            " with those changed." if resumes else
            " with the same settings; lowering those needs a new run from it (fresh optimizer, schedule and data "
            "order): " + (new_run or f"rerun with --set model_name={checkpoint}")
            # another run directory: this one holds checkpoints, which a run without --resume refuses
            + f" --set run_name={checkpoint.parent.name}-from-{checkpoint.name}.")
    return line

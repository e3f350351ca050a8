"""The errors the CLI shows as one line and exit 2: UserError (bad input) and a failed device allocation."""


class UserError(Exception):
    """A problem the user can fix (bad config, missing file, malformed row); shown without a traceback."""


# How MLX's backends word a failed allocation (CUDA, Metal, the CPU's std::bad_alloc)
_OOM_WORDS = ("out of memory", "unable to allocate", "failed to allocate", "bad_alloc", "[metal::malloc]",
              "insufficient memory")
# Where the allocation failed (a file of the traceback) -> the settings that bound that phase's memory
_OOM_PHASES = (  # the first that any of our frames matches: evaluation samples through rollout/ too
    ("/evaluate.py", "while evaluating", "lower eval_batch_size or eval_max_new_tokens"),
    ("/rollout/", "while sampling rollouts", "lower batch_size x num_generations, max_new_tokens or "
                                              "max_prompt_length"),
    ("/training/", "in the training pass", "lower micro_batch_size or micro_batch_tokens, or set "
                                           "grad_checkpoint = true"),
    ("/sft.py", "in the training pass", "lower micro_batch_size or micro_batch_tokens, or set "
                                        "grad_checkpoint = true"),
)


def out_of_memory(exc: BaseException, command: str) -> str | None:
    """The one line for a failed device allocation (None for any other error): where it happened, the first
    line of the backend's message, and what to lower. A traceback would hide that the fix is a setting."""
    text = str(exc)
    if not isinstance(exc, MemoryError) and not any(word in text.lower() for word in _OOM_WORDS):
        return None
    files = []
    tb = exc.__traceback__
    while tb is not None:
        files.append(tb.tb_frame.f_code.co_filename.replace("\\", "/"))
        tb = tb.tb_next
    where, advice = "", "lower batch_size, num_generations, max_new_tokens or micro_batch_size"
    for part, phase, fix in _OOM_PHASES:
        if any(part in f and "mlx_grpo" in f for f in files):
            where, advice = f" {phase}", fix
            break
    resume = " Checkpoints already written are intact: --resume continues from the latest." \
        if command in ("train", "sft") else ""
    first = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    return (f"out of device memory{where} ({first}): {advice}, or stop other processes using the GPU."
            + resume)

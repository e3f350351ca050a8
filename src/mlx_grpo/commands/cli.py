"""The `mlx-grpo` command line: argument parsing only; each subcommand calls one public function.

Every config field of a command is a flag (`--field-name VALUE`), equivalent to `--set field_name=VALUE`
or `--set group.field_name=VALUE`; --help lists them by group, with the help, choices, range and default that
their declarations in the config package give.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from pathlib import Path

from mlx_grpo import __version__
from mlx_grpo.base.blas import use_optimized_blas
from mlx_grpo.base.cache import keep_compiled_kernels
from mlx_grpo.base.errors import UserError, out_of_memory
from mlx_grpo.base.interrupt import exit_on_interrupt
from mlx_grpo.commands.options import COMMAND_FLAG_ALIASES, COMMAND_OPTIONS, FLAG_ALIASES, Option
from mlx_grpo.config import FIELD_GROUP, FIELDS, GROUPS, build_config, command_default, fields_for, parse_set
from mlx_grpo.config.reference import field_help

DESCRIPTIONS = {
    "convert": "Convert a Hugging Face model, a GGUF file or a nanochat checkpoint to an MLX model directory.",
    "generate": "Generate text from a prompt (or a file of prompts) with a model.",
    "chat": "Chat with a model in the terminal (also works from a pipe); Ctrl-C stops an answer, Ctrl-D or /exit "
            "ends the chat.",
    "train": "Fine-tune a model with GRPO.",
    "sft": "Supervised warm start before GRPO: train on worked solutions or prompt/completion data, loss on the "
           "completion tokens only.",
    "eval": "Measure exact-match accuracy (or pass@k) of a model on a data set.",
    "fuse": "Merge a lora/dora checkpoint's adapters into its base: a plain MLX model directory.",
    "plot": "Draw a training run's curves (reward, eval accuracy, KL, entropy, length, time) into one PNG.",
}


def _add_option(parser: argparse.ArgumentParser, opt: Option) -> None:
    dest = opt.flags[0].lstrip("-").replace("-", "_")
    if opt.kind == "positional":
        parser.add_argument(dest, metavar=dest.upper(), help=opt.help)
    elif opt.kind == "flag":
        parser.add_argument(*opt.flags, dest=dest, action="store_true", help=opt.help)
    elif opt.kind == "append":
        parser.add_argument(*opt.flags, dest=dest, action="append", default=None, help=opt.help)
    elif opt.kind == "optional":
        parser.add_argument(*opt.flags, dest=dest, nargs="?", const="latest", default=None, help=opt.help)
    elif opt.kind == "choice":
        parser.add_argument(*opt.flags, dest=dest, choices=opt.choices, default=opt.default,
                            help=opt.help + (f" (default: {opt.default})" if opt.default else ""))
    else:
        parser.add_argument(*opt.flags, dest=dest, type=int if opt.kind == "int" else str,
                            default=opt.default,
                            help=opt.help + (f" (default: {opt.default})" if opt.default is not None else ""))


def _add_config_fields(parser: argparse.ArgumentParser, command: str) -> None:
    parser.add_argument("--config", metavar="FILE.toml", help="TOML file of config keys (flat, in group tables "
                        "such as [rollout], or either under [mlx_grpo]), or a run's stored config "
                        "(RUN/checkpoint-N/config.resolved.json); a missing file is an error.")
    parser.add_argument("--set", dest="set_items", action="append", default=[], metavar="KEY=VALUE",
                        help="Override a config key (field or group.field); repeatable; wins over --config and "
                        "flags.")
    aliases = {**FLAG_ALIASES, **COMMAND_FLAG_ALIASES.get(command, {})}
    names = fields_for(command)
    for group, cls in GROUPS.items():
        mine = [name for name in names if FIELD_GROUP[name] == group]
        if not mine:
            continue
        section = parser.add_argument_group(f"{group} settings (cfg.{group}; TOML [{group}])",
                                            (cls.__doc__ or "").strip())
        for name in mine:
            flags = [f"--{name.replace('_', '-')}"] + aliases.get(name, [])
            action = section.add_argument(*flags, dest=f"field__{name}", default=None, metavar="VALUE",
                                          help=f"(default: {command_default(command, name)!r})".replace("%", "%%"))
            action.config_field = name  # the rest of its help is written when shown (_FieldHelp)


class _FieldHelp(argparse.HelpFormatter):
    """Writes a config field's help (text, choices, range) only when --help shows it: loss_type's choices
    come from loss.py, which imports mlx.core, and `plot` or a run before its BLAS is chosen must not."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        name = getattr(action, "config_field", None)
        if name is None:
            return super()._get_help_string(action)
        return field_help(FIELDS[name]).replace("%", "%%") + " " + action.help  # argparse %-formats help


def build_parser() -> argparse.ArgumentParser:
    # allow_abbrev=False: `--learning-rat` must be an error, not silently --learning-rate.
    parser = argparse.ArgumentParser(prog="mlx-grpo", description="GRPO fine-tuning on MLX.", allow_abbrev=False)
    parser.add_argument("--version", action="version", version=f"mlx-grpo {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command, description in DESCRIPTIONS.items():
        sub = subparsers.add_parser(command, help=description, description=description, allow_abbrev=False,
                                    formatter_class=_FieldHelp)
        for opt in COMMAND_OPTIONS.get(command, []):
            _add_option(sub, opt)
        if fields_for(command):
            _add_config_fields(sub, command)
    return parser


def _config_from_args(command: str, args: argparse.Namespace):
    overrides = [(key[len("field__"):], value) for key, value in vars(args).items()
                 if key.startswith("field__") and value is not None]
    overrides += parse_set(args.set_items)
    return build_config(command, args.config, overrides)


def _dispatch(args: argparse.Namespace) -> None:
    command = args.command
    if command == "convert":
        from mlx_grpo.commands.convert import run_convert

        out = run_convert(hf_path=args.hf_path, gguf=args.gguf, output_dir=args.output_dir,
                          quantize=args.quantize, bits=int(args.bits), group_size=args.group_size,
                          dtype=args.dtype, trust_remote_code=args.trust_remote_code, nanochat=args.nanochat,
                          step=args.step)
        print(f"wrote MLX model to {out}")
        return
    if command == "plot":
        from mlx_grpo.reporting.plot import plot_run

        print(f"wrote {plot_run(args.run_dir, args.output)}")
        return
    if command == "fuse":
        from mlx_grpo.commands.fuse import run_fuse

        if not args.checkpoint or not args.output_dir:
            raise UserError("fuse needs --checkpoint and --output-dir")
        print(f"wrote merged model to {run_fuse(args.checkpoint, args.output_dir, dequantize=args.dequantize)}")
        return
    cfg = _config_from_args(command, args)
    args.built_config = cfg  # a crash line names this config's run directory, not the file's as edited since
    if command in ("generate", "chat") and args.image:  # vision-language models (vlm/)
        from mlx_grpo.commands.vision_inference import run_chat_images, run_generate_images

        if command == "generate":
            run_generate_images(cfg, args.prompt, args.image, stream=args.stream, verbose=args.verbose)
        else:
            run_chat_images(cfg, args.image, verbose=args.verbose)
    elif command == "generate":
        from mlx_grpo.commands.inference import run_generate

        run_generate(cfg, prompt=args.prompt, prompts_file=args.prompts_file, output=args.output,
                     batch_size=args.batch_size, stream=args.stream, raw=args.raw, verbose=args.verbose)
    elif command == "chat":
        from mlx_grpo.commands.inference import run_chat

        run_chat(cfg, verbose=args.verbose)
    elif command == "train":
        from mlx_grpo.commands.train import train

        train(cfg, resume=args.resume)
    elif command == "sft":
        from mlx_grpo.commands.sft import run_sft

        run_sft(cfg, resume=args.resume)
    elif command == "eval":
        from mlx_grpo.vlm.families import image_eval

        if image_eval(cfg.model.model_name, cfg.data.image_column):  # image prompts: commands/vision_eval.py
            from mlx_grpo.commands.vision_eval import run_vision_eval as run_eval
        else:
            from mlx_grpo.commands.evaluate import run_eval
        run_eval(cfg, split=args.split, output=args.output)


def _checkpoint(args: argparse.Namespace):
    """(the run's config, the checkpoint a resume continues from or None, whether the run directory could be
    listed), or None when the crash came before the config was built or the reading failed otherwise: the
    line then goes without. The checkpoint is checkpoint.resume_point's, as the failed-save line names it:
    after a resume from another directory, the resumed one unless this run saved a later one (not an older
    run's newest)."""
    from mlx_grpo.storage.checkpoint import resume_point_after_crash

    cfg = getattr(args, "built_config", None)
    if cfg is None:
        return None
    try:
        return cfg, resume_point_after_crash(Path(cfg.run.output_dir) / cfg.run.run_name, args.resume), True
    except OSError:  # the mount is gone: the directory cannot even be listed
        return cfg, None, False
    except Exception:  # noqa: BLE001 -- the line goes without the checkpoint
        return None


def _memory_line(exc: BaseException, args: argparse.Namespace) -> str | None:
    """The out-of-memory line (None: another error), naming the checkpoint to resume from for train/sft."""
    command = args.command
    line = out_of_memory(exc, command)
    if line is None or command not in ("train", "sft") or not (run := _checkpoint(args)) or run[1] is None:
        return line
    from mlx_grpo.sft.steps import start_from

    return out_of_memory(exc, command, run[1], start_from(run[1], instead_of_resume=args.resume is not None))


def _what_survives(args: argparse.Namespace) -> str | None:
    """For a train/sft run that ends early (a crash, Ctrl-C): where it continues from, or that a rerun starts
    over; None for other commands, other ranks, or before the config was built."""
    from mlx_grpo.training.distributed import launched_rank

    # Rank 0 owns the run directory; other ranks (perhaps on other hosts) would name none or repeat it
    if args.command not in ("train", "sft") or launched_rank() != 0 or not (run := _checkpoint(args)):
        return None
    cfg, point, listed = run
    if point is not None:  # named: a plain --resume of a command that resumed from an older path would go back
        return f"{point} is intact: the command with --resume {point} continues from it"
    if not listed:  # as a failed save's line says it
        return ("the run directory cannot be read now: once it can, the command with --resume latest continues "
                "from its newest checkpoint")
    if args.resume not in (None, "latest"):
        return f"no checkpoint was written since {args.resume}: the same command resumes from it again"
    return (f"no checkpoint of this run was written (save_steps = {cfg.run.save_steps}"
            + (": only at the end" if not cfg.run.save_steps else "") + "): a rerun starts over")


def _crashed(args: argparse.Namespace) -> int:
    """A crash that is no user error (a GPU fault, a bug): its traceback, then for train/sft what survives it,
    so that a run that died after an hour says where it continues from. Exit 1, as an uncaught error."""
    traceback.print_exc()
    if said := _what_survives(args):
        print(f"mlx-grpo {args.command}: crashed (the traceback above says where); {said}.", file=sys.stderr)
    return 1


def _interrupted(args: argparse.Namespace) -> str | None:
    """What Ctrl-C's line adds for train/sft (_what_survives, read when the signal comes): a run stopped before
    its first checkpoint (save_steps = 0 writes one only at the end) is otherwise lost without a word."""
    said = _what_survives(args)
    return None if said is None else f"{said}."


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        # Before any subcommand imports mlx.core: this module and the config package must not import it at the top.
        use_optimized_blas(on_slow=lambda line: print(line, file=sys.stderr))
        keep_compiled_kernels()  # CUDA: compiled kernels kept beside the converted models, not in /tmp
        # Ctrl-C ends the command within a moment even inside a long native call (base/interrupt.py)
        with exit_on_interrupt(f"mlx-grpo {args.command}: interrupted", lambda: _interrupted(args)):
            _dispatch(args)
    except UserError as exc:
        print(f"mlx-grpo {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except (RuntimeError, MemoryError) as exc:  # a failed device allocation: one line saying what to lower
        line = _memory_line(exc, args)
        if line is None:
            return _crashed(args)
        print(f"mlx-grpo {args.command}: error: {line}", file=sys.stderr)
        return 2
    except Exception:  # noqa: BLE001 -- reported, not swallowed: the traceback, then where the run resumes
        return _crashed(args)
    except KeyboardInterrupt:  # raised in-process (a caller outside the main thread): the same ending
        try:
            said = _interrupted(args)
        except Exception:  # noqa: BLE001 -- the line goes without what survives
            said = None
        print(f"mlx-grpo {args.command}: interrupted" + (f"; {said}" if said else ""), file=sys.stderr)
        # Leave now: a reward still running in a worker thread (a hung scorer) would otherwise hold the exit
        # (Python joins worker threads at exit). Checkpoints are written atomically; nothing is lost.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(130)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The reader of tests/test_docs_commands.py: the pages' shell commands, parsed in order, and a working
directory that runs them as written on stand-ins. What it changes, and only that:
- the embedded default model is a tiny random llama (write_default_standin; the test puts it where
  MLX_GRPO_CACHE keeps the converted default), and so are the hub models the pages name (HUB_MODELS); GSM8K
  is a few rows in its form;
- settings a command leaves to its preset get small limits (TINY): 2 updates of 2 prompts x 2 samples, 4 new
  tokens, a checkpoint each update; a checkpoint a page names by number is the tiny run's (the last for the
  preset's last, else the first);
- `/tmp/` paths go under the working directory, `~` is a home there, `$D` a folder of GSM8K-form files, and
  the files a reader brings (USER_FILES) are written there on first use; a path that another page's command
  writes (nanochat.md's conversion, for tools-and-environments.md) is written by running that command first."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from mlx_grpo.commands.cli import DESCRIPTIONS, build_parser, main
from mlx_grpo.config import build_config, fields_for, to_dict
from mlx_grpo.data import examples as data_mod
from test_readme import overrides, preset_runs

ROOT = Path(__file__).resolve().parents[1]
HISTORY = ROOT / "docs/benchmarks-history.md"
PAGES = [ROOT / "README.md", *(p for p in sorted((ROOT / "docs").glob("*.md")) if p != HISTORY)]
BLOCK = re.compile(r"^[ \t]*```(\w*)\n(.*?)^[ \t]*```", re.S | re.M)  # a fenced block: its language, its text
# Small limits for what a command leaves to its preset (a command's own setting is kept).
TINY = {"max_train_samples": "4", "batch_size": "2", "num_generations": "2", "gradient_accumulation_steps": "1",
        "num_epochs": "1", "max_new_tokens": "4", "eval_subset_size": "2", "eval_max_new_tokens": "4",
        "save_steps": "1", "max_updates_without_signal": "0"}  # a random model earns no reward: train on
HUB_MODELS = {"Qwen/Qwen2.5-0.5B-Instruct": "llama", "HuggingFaceTB/SmolLM2-360M-Instruct": "llama",
              "Qwen/Qwen2-VL-2B-Instruct": "vlm"}
QUESTIONS = [("Tom has 5 apples and buys 3 more. How many apples does he have?", "8"),
             ("A box holds 4 pens. How many pens are in 3 boxes?", "12"),
             ("Ann had 10 coins and spent 4. How many are left?", "6"),
             ("There are 7 birds and 2 fly away. How many remain?", "5")]


def gsm8k_rows() -> list[dict]:
    return [{"question": q, "answer": f"We work it out.\n#### {a}"} for q, a in QUESTIONS]


def jsonl(rows: list[dict]) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


def write_default_standin(path: Path) -> Path:
    """The embedded default's stand-in: models/tiny.py's llama with a BPE tokenizer of 4,096 tokens trained on the
    pages and on arith's problems, so that the presets' prompts (worked examples, tool descriptions) fit their
    max_prompt_length as with the real tokenizer. The other tests' byte-level tokenizer makes them ~4x longer:
    over max_prompt_length, and their training passes several times slower."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from mlx_grpo.models.tiny import SPECIAL, write_tiny_model

    write_tiny_model(path)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [p.read_text() for p in PAGES] + [f"{e.prompt}\n{e.solution}" for e in data_mod.make_arith(300, 0)]
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=4096, special_tokens=SPECIAL,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.add_special_tokens(SPECIAL)
    assert [tok.token_to_id(t) for t in SPECIAL] == [0, 1, 2]  # the ids tokenizer_config.json and config.json name
    tok.save(str(path / "tokenizer.json"))
    config = {**json.loads((path / "config.json").read_text()), "vocab_size": tok.get_vocab_size()}
    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (path / "config.json").write_text(json.dumps(config))
    return path


def _write_images(w: Path) -> None:
    from PIL import Image

    Image.new("RGB", (32, 32), (200, 30, 30)).save(w / "a.png")
    Image.new("RGB", (32, 32), (30, 30, 200)).save(w / "b.jpg")


def _write_nanochat(directory: Path) -> None:
    from nanochat_fixture import CONFIG, make_encoding, random_state_dict, write_checkpoint

    encoding = make_encoding(n_merges=60)
    write_checkpoint(directory, random_state_dict({**CONFIG, "vocab_size": encoding.n_vocab}, 448),
                     {**CONFIG, "vocab_size": encoding.n_vocab}, 10, encoding)


def _write_home_nanochat(w: Path) -> None:
    """nanochat's own layout: the checkpoint directory without its tokenizer, which sits in tokenizer/."""
    base = w / "home/.cache/nanochat"
    if base.exists():
        return
    _write_nanochat(base / "chatsft_checkpoints/d20")
    (base / "tokenizer").mkdir(parents=True)
    (base / "chatsft_checkpoints/d20/tokenizer.pkl").rename(base / "tokenizer/tokenizer.pkl")


def _write_gguf(w: Path) -> None:
    import test_gguf

    test_gguf._write_gguf(w / "model.Q4_1.gguf", test_gguf._tiny_model(tied=True))


# The files a reader brings, written the first time a command names them: path -> writer(workdir).
USER_FILES = {
    "train.jsonl": lambda w: (w / "train.jsonl").write_text(jsonl(
        [{"question": q, "answer": a, "gold": a} for q, a in QUESTIONS])),
    "test.jsonl": lambda w: (w / "test.jsonl").write_text(jsonl([{"question": q, "answer": a} for q, a in QUESTIONS])),
    "d.jsonl": lambda w: (w / "d.jsonl").write_text(jsonl([{"text": q, "gold": a} for q, a in QUESTIONS])),
    "prompts.jsonl": lambda w: (w / "prompts.jsonl").write_text(jsonl([{"prompt": q} for q, _ in QUESTIONS])),
    "a.png": _write_images, "b.jpg": _write_images,
    "pictures.jsonl": lambda w: (_write_images(w), (w / "pictures.jsonl").write_text(jsonl(
        [{"question": "What colour is it?", "answer": "red", "picture": "a.png"}] * 2))),
    "model.Q4_1.gguf": _write_gguf,
    "nanochat-d32": lambda w: _write_nanochat(w / "nanochat-d32"),
    "~/.cache/nanochat/tokenizer/tokenizer.pkl": _write_home_nanochat,
    "~/.cache/nanochat/chatsft_checkpoints/d20": _write_home_nanochat,
}


@dataclass
class Command:
    page: str
    tokens: list[str]
    expect: list[str]  # lines the page shows as its output (its last command's), else []

    @property
    def text(self) -> str:
        return " ".join(self.tokens)

    @property
    def argv(self) -> list[str] | None:
        """The mlx-grpo arguments (after `mlx-grpo` or `-m mlx_grpo`), None for another program."""
        for i, tok in enumerate(self.tokens):
            start = i + 1 if tok.endswith("mlx-grpo") else i + 2 if self.tokens[i:i + 2] == ["-m", "mlx_grpo"] else None
            if start is not None and start < len(self.tokens) and self.tokens[start] in DESCRIPTIONS:
                return self.tokens[start:]
        return None


def page_commands(page: Path) -> list[Command]:
    """The page's shell commands in order: each line of a bash block (continuations joined, comments dropped),
    split at `&&`; `[--flag]` (an optional flag) gives the command without it, then with it."""
    text, out, end, name = page.read_text(), [], -1, page.relative_to(ROOT).as_posix()
    for block in BLOCK.finditer(text):
        lang, body = block[1], block[2]
        if lang == "text" and out and not text[end:block.start()].strip():
            out[-1].expect = [line.strip() for line in body.splitlines() if line.strip()]
        end = block.end()
        if lang not in ("bash", "sh"):
            continue
        for line in body.replace("\\\n", " ").splitlines():
            tokens = shlex.split(line, comments=True)
            while tokens:
                cut = tokens.index("&&") if "&&" in tokens else len(tokens)
                part, tokens = tokens[:cut], tokens[cut + 1:]
                optional = [t for t in part if re.fullmatch(r"\[-[^]]+\]", t)]
                if optional:
                    out.append(Command(name, [t for t in part if t not in optional], []))
                out.append(Command(name, [t.strip("[]") if t in optional else t for t in part], []))
    return out


class Workdir:
    """A page's working directory (configs/ and examples/ as in the repository, README command 1's run done,
    as every page assumes) and the commands run there so far: a command runs first the documented command
    that writes a path it names."""

    def __init__(self, path: Path, shared: Path, fixture, commands: list[Command]):
        self.path, self.shared, self.fixture, self.commands, self.done = path, shared, fixture, commands, {}
        path.mkdir()
        for name in ("configs", "examples", ".venv"):
            (path / name).symlink_to(ROOT / name)

    @contextlib.contextmanager
    def here(self):
        with pytest.MonkeyPatch.context() as mp:
            mp.chdir(self.path)
            yield mp

    def word(self, tok: str) -> str:
        """A word as the shell and the stand-ins make it: `$D`, `~`, /tmp/ and hub model ids."""
        tok = re.sub(r"(^|=)/tmp/", lambda m: f"{m[1]}{self.path}/tmp/", tok)
        tok = re.sub(r"\$(\w+)", lambda m: str(self.shared / "gsm8k") if m[1] == "D" else m[0], tok)
        tok = re.sub(r"(^|=)~/", lambda m: f"{m[1]}{self.path}/home/", tok)
        for hub, kind in HUB_MODELS.items():
            if hub in tok:
                tok = tok.replace(hub, str(self.fixture("tiny_model_dir" if kind == "llama" else "tiny_vlm_hf_dir")))
        return tok

    def config(self, argv: list[str]):
        """The config a command runs with (None for a command without one)."""
        if not fields_for(argv[0]) or "--help" in argv:
            return None
        args = build_parser().parse_args(argv)
        with self.here():
            return build_config(argv[0], args.config, overrides(args))

    def run_dir(self, argv: list[str]) -> str | None:
        """Where a train or sft command writes its run."""
        cfg = self.config(argv) if argv[0] in ("train", "sft") else None
        return None if cfg is None else str(Path(cfg.run.output_dir) / cfg.run.run_name)

    def prepare(self, cmd: Command) -> list[str]:
        """Run what the command needs first (the user files it names, the documented command writing a
        path it names); -> its words, expanded, with a named checkpoint the tiny run has."""
        words = [self.word(t) for t in cmd.tokens]
        for name, write in USER_FILES.items():
            named = any(w == self.word(name) or w.endswith("=" + name) for w in words)
            if named and not (self.path / self.word(name)).exists():
                write(self.path)
        argv = [self.word(a) for a in cmd.argv or []]
        cfg = self.config(argv) if argv else None
        settings = [v for v in to_dict(cfg).values() if isinstance(v, str)] if cfg else []  # teacher_model, ...
        named = " ".join(words + settings)
        needed = set(re.findall(r"(?<![\w./-])((?:runs|models)/[\w.-]+(?:/fused)?)", named))
        writes = {argv[argv.index("--output-dir") + 1]} if "--output-dir" in argv else set()
        if argv[:1] in (["train"], ["sft"]):
            own = str(Path(cfg.run.output_dir) / cfg.run.run_name)
            (needed if "--resume" in argv else writes).add(own)
        for path in sorted(needed - writes):
            if not (self.path / path).exists():
                self.produce(path, cmd)
        return [self.checkpoint(w) for w in words]

    def produce(self, path: str, user: Command) -> None:
        for cmd in self.commands:
            argv = [self.word(a) for a in cmd.argv or []]
            if cmd is user or not argv or "--resume" in argv:
                continue
            out_dir = argv[argv.index("--output-dir") + 1] if "--output-dir" in argv else None
            if out_dir == path or (out_dir is None and self.run_dir(argv) == path):
                for prior in self.commands[:self.commands.index(cmd)]:
                    if prior.page == cmd.page and prior.argv is None:  # its page's shell steps (nanochat.md's cp)
                        self.run(prior)
                code, out = self.run(cmd)
                assert code == 0, (f"{cmd.page}: `{cmd.text}`, run for {user.text}", out[-3000:])
                return
        raise AssertionError(f"{user.page}: `{user.text}` names {path}, which no documented command writes")

    def checkpoint(self, word: str) -> str:
        """runs/X/checkpoint-N that the tiny run did not write: its last if N is the preset's last, else its first."""
        def mapped(m: re.Match) -> str:
            run, n = m[1], int(m[2])
            have = sorted(int(p.name.split("-")[1]) for p in (self.path / run).glob("checkpoint-*"))
            if (self.path / run / f"checkpoint-{n}").exists() or not have:
                return m[0]
            last = max(preset_runs().get(run, {n}))
            return f"{run}/checkpoint-{have[-1] if n >= last else have[0]}"

        return re.sub(r"(?<![\w./-])(runs/[\w.-]+)/checkpoint-(\d+)", mapped, word)

    def run(self, cmd: Command) -> tuple[int, str]:
        if cmd.text in self.done:
            return self.done[cmd.text]
        words, argv = self.prepare(cmd), cmd.argv
        stdin = ""
        if "|" in words:
            left = words[:words.index("|")]
            stdin = subprocess.run(left, capture_output=True, text=True, check=True, cwd=self.path).stdout
        elif argv and argv[0] == "chat":
            stdin = "2+2?\n/exit\n"  # a question, then the page's way out
        if words[0].endswith("mlx.launch"):
            result = self.launch(words)
        elif argv:
            result = self.main(words[len(words) - len(argv):], stdin)
        else:
            proc = subprocess.run(words, capture_output=True, text=True, cwd=self.path)
            result = proc.returncode, proc.stdout + proc.stderr
        self.done[cmd.text] = result
        return result

    def tiny(self, argv: list[str]) -> list[str]:
        """argv with TINY's limits for the settings it leaves to its preset."""
        own = {k.rpartition(".")[2] for k, _ in overrides(build_parser().parse_args(argv))}
        valid = set(fields_for(argv[0]))
        return argv + [a for k, v in TINY.items() if k in valid and k not in own for a in ("--set", f"{k}={v}")]

    def main(self, argv: list[str], stdin: str) -> tuple[int, str]:
        argv = self.tiny(argv)
        out = io.StringIO()
        with self.here() as mp:
            mp.setattr(sys, "stdin", io.StringIO(stdin))
            mp.setattr(sys, "stdout", out)
            mp.setattr(sys, "stderr", out)
            code = main(argv)
        return code, f"$ mlx-grpo {shlex.join(argv)}\n{out.getvalue()}"

    def launch(self, words: list[str]) -> tuple[int, str]:
        """mlx.launch on a free port (concurrent test runs), the ranks' command with TINY's limits."""
        from test_distributed import free_port

        cut = words.index("--")
        command = words[cut + 1:]
        command = command[:1] + self.tiny(command[1:])
        proc = subprocess.run([*words[:cut], "-p", str(free_port()), "--", *command], capture_output=True,
                              text=True, timeout=300, cwd=self.path, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        out = proc.stdout + proc.stderr
        # mlx.launch exits 0 even when a rank fails (docs/distributed.md): the run's own last line says it ended
        return (proc.returncode if "[mlx-grpo] done:" in out else 1), out


def matches(expected: str, line: str) -> bool:
    parts = re.split(r"<[^<>]+>", expected)
    return re.fullmatch(r"\S+".join(re.escape(p) for p in parts), line.strip()) is not None



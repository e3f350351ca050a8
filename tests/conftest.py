"""Shared fixtures: tiny random-weight llama models with a byte-level tokenizer and a chat template."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def write_tokenizer(path: Path, extra_specials: tuple[str, ...] = ()) -> int:
    """A byte-level BPE tokenizer without merges (one token per byte) plus ChatML specials (and
    extra_specials, given ids after the bytes)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {tok: i for i, tok in enumerate(SPECIAL)}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):  # alphabet() order varies per process
        vocab[ch] = len(vocab)
    for special in extra_specials:
        vocab[special] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL + list(extra_specials))
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": CHATML,
        "clean_up_tokenization_spaces": False, "model_max_length": 2048}))
    return len(vocab)


def write_tiny_model(path: Path, seed: int = 0, hidden: int = 32, layers: int = 2) -> Path:
    from mlx_lm.models import llama

    path.mkdir(parents=True, exist_ok=True)
    vocab_size = write_tokenizer(path)
    config = {"model_type": "llama", "hidden_size": hidden, "num_hidden_layers": layers,
              "intermediate_size": 2 * hidden, "num_attention_heads": 2, "num_key_value_heads": 1,
              "rms_norm_eps": 1e-5, "vocab_size": vocab_size, "rope_theta": 10000.0,
              "tie_word_embeddings": True, "max_position_embeddings": 2048, "eos_token_id": 2}
    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (path / "config.json").write_text(json.dumps(config))
    return path


# metrics.jsonl figures that measure the machine, not the run: left out when two runs are compared
TIMING = {"rollout_tokens_per_s", "train_tokens_per_s", "time_rollout_s", "time_reward_s", "time_logprob_s",
          "time_train_s", "time_step_s", "peak_memory_gb"}


def run_metrics(run_dir) -> list[dict]:
    """A run's metrics.jsonl records without the TIMING figures."""
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in TIMING} for r in rows]


def interrupt_before_update(train, cfg, monkeypatch, update: int) -> None:
    """Run train(cfg) and stop it with a KeyboardInterrupt just before `update` (what Ctrl-C leaves behind:
    the checkpoints written so far)."""
    from mlx_grpo import trainer as trainer_mod

    original = trainer_mod.Trainer.update

    def crashing(self, steps):
        if self.counters.update_step + 1 == update:
            raise KeyboardInterrupt
        return original(self, steps)

    monkeypatch.setattr(trainer_mod.Trainer, "update", crashing)
    with pytest.raises(KeyboardInterrupt):
        train(cfg)
    monkeypatch.setattr(trainer_mod.Trainer, "update", original)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def pytest_configure(config):
    config.addinivalue_line("markers", "curves: the test's training runs draw curves.png at their end")


@pytest.fixture(autouse=True)
def _no_end_of_run_curves(request, monkeypatch):
    """Drawing curves.png at the end of a run costs ~0.3 s of matplotlib per tiny run: only tests marked
    `curves` (tests/test_plot.py) draw them; the other runs print their summary without the PNG."""
    if request.node.get_closest_marker("curves") is None:
        from mlx_grpo import run

        monkeypatch.setattr(run, "_curves", lambda run_dir: None)

"""async_rollouts = 1 (training/prefetch.py): the run equals a plain sequential loop that samples batch k+1
from a snapshot of the weights update k starts from and trains update k on batch k, with the rollout
correction's importance weights; its staleness is logged; resume is exact; evaluations and tools work."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_map

from caller_model import CALLER, write_caller_model
from conftest import ctrl_c_while_scoring_hangs, interrupt_before_update, run_metrics
from mlx_grpo.commands import train as run_mod
from mlx_grpo.commands.assembly import build_job
from mlx_grpo.config import build_config, parse_set
from mlx_grpo.rollout.engine import RolloutEngine
from mlx_grpo.rollout.multiturn import rollouts
from mlx_grpo.rollout.process import RolloutProcess
from mlx_grpo.training.records import UpdateSteps
from mlx_grpo.training.trainer import Trainer

TOY = Path(__file__).parent / "fixtures" / "toy_rewards.py"
ASYNC = ["async_rollouts=1", "rollout_correction=token_truncate"]
# LoRA on the sampling copy, two batch steps per update decoded together (refill), a KL term
LORA = ["train_type=lora", "lora_rank=4", "rollout_engine=copy", "gradient_accumulation_steps=2",
        "max_train_samples=16", "kl_coeff=0.05"]
# the figures compared between a run and the reference
FIGURES = ("lr", "loss", "grad_norm", "kl", "ratio_mean", "sampler_kl", "sampler_diff_max", "is_weight_mean",
           "is_capped_fraction", "loss_tokens")


@pytest.fixture(scope="module")
def caller_dir(tmp_path_factory) -> Path:
    """A tiny model that calls the calculator (tests/caller_model.py)."""
    return write_caller_model(tmp_path_factory.mktemp("caller") / "model", CALLER)


def tools_items(out: Path) -> list[str]:
    """A calculator run rewarded by its tool calls (test_invariance's tools case)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "calls.py").write_text("def calls(prompts, completions, completion_ids, transcripts, **columns):\n"
                                  "    return [sum(t.origin == 'tool' for t in tr.turns) for tr in transcripts]\n")
    return ["max_new_tokens=40", "max_prompt_length=256", "tools=[\"calculator\"]", f"reward_funcs={out}/calls.py:calls"]


def make_cfg(model_dir, out, *items):
    base = [f"model_name={model_dir}", f"output_dir={out}", "batch_size=2", "num_generations=4",
            "max_new_tokens=8", "max_train_samples=8", "learning_rate=1e-2", "warmup_ratio=0",
            "log_completions_steps=0", "max_prompt_length=96", "system_prompt=", "kl_coeff=0",
            f"reward_funcs={TOY}:share_of_even_ids"]
    return build_config("train", overrides=parse_set(base + list(items)))


def checkpoint_weights(path: Path) -> dict:
    name = "adapters.safetensors" if (path / "adapters.safetensors").is_file() else "model.safetensors"
    return mx.load(str(path / name))


def naive_reference(cfg) -> tuple[list[dict], dict]:
    """The async schedule written out plainly, without threads: update k trains on batch k, which was
    sampled from a copy of the weights update k-1 started from (batch 1 from the initial weights).
    -> (per-update figures, the trained tensors as a checkpoint holds them)."""
    job = build_job(cfg)  # the same config: its own pipeline stays unused here
    G, A = cfg.rollout.num_generations, cfg.training.gradient_accumulation_steps

    def sample_from(params):
        model = copy.deepcopy(job.model)
        model.update(params)
        engine = RolloutEngine(job.tokenizer, mode=cfg.rollout.rollout_engine).refresh(model)
        encoded = [job.sampling.encode(job.sampling.next_examples()) for _ in range(A)]
        out = rollouts(engine, job.sampling.prompts.multiturn, encoded, G, job.sampling.params, cfg.data.prefill)
        return [job.sampling.submit_rewards(mine, r, 0.0) for (_, _, mine), r in zip(encoded, out)]

    figures = []
    draws = sample_from(job.model.parameters())
    for k in range(1, job.trainer.total_updates + 1):
        before = job.model.parameters()  # arrays: the update replaces them, these stay
        m = job.trainer.update(UpdateSteps([job.sampling.logprob_passes([d]) for d in draws], job.sampling.position()))
        figures.append({f: getattr(m, f) for f in FIGURES})
        draws = sample_from(before) if k < job.trainer.total_updates else None  # batch k+1 from the weights k started from
    job.sampling.reward_runner.close()
    trained = dict(tree_flatten(job.model.trainable_parameters()))
    return figures, trained


@pytest.mark.parametrize("case", ["full", "lora-copy-accum", "tools", "process", "process-lora-copy-accum"])
def test_async_run_equals_the_naive_reference(tiny_model_dir, caller_dir, tmp_path, monkeypatch, case):
    """In the rollout thread or the rollout process (rollout_worker, rollout/process.py)."""
    jobs = []  # the rollout process's jobs, counted where they are sent
    sample = RolloutProcess.sample
    monkeypatch.setattr(RolloutProcess, "sample", lambda self, *a: jobs.append(a) or sample(self, *a))
    model = caller_dir if case == "tools" else tiny_model_dir
    extra = {"full": [], "lora-copy-accum": LORA, "tools": tools_items(tmp_path)}[case.removeprefix("process-")
                                                                                   .replace("process", "full")]
    where = [f"rollout_worker={'process' if case.startswith('process') else 'thread'}"]
    run = run_mod.train(make_cfg(model, tmp_path, "run_name=async", *ASYNC, *extra, *where))
    records = run_metrics(run)
    assert len(jobs) == (len(records) if case.startswith("process") else 0)
    assert [r["rollout_staleness"] for r in records] == [0] + [1] * (len(records) - 1)
    # the staleness is real: batch 2 was sampled by other weights than those it trains
    assert records[1]["sampler_kl"] > 1e-6 and records[0]["sampler_kl"] < 1e-6
    if case == "tools":  # episodes decoded in the rollout thread called the tool
        assert records[1]["tool_call_rate"] > 0
    figures, trained = naive_reference(make_cfg(model, tmp_path, "run_name=ref", *ASYNC, *extra))
    assert len(figures) == len(records) == 4
    # bit for bit where measured (a CPU, float32); 1e-6 leaves room for another machine's BLAS threading
    for got, want in zip(records, figures):
        for f in FIGURES:
            assert got[f] == pytest.approx(want[f], rel=1e-6, abs=1e-7), (got["update_step"], f)
    saved = checkpoint_weights(run / f"checkpoint-{len(records)}")
    assert saved.keys() == trained.keys()
    for k in saved:
        np.testing.assert_allclose(np.array(saved[k]), np.array(trained[k]), rtol=1e-6, atol=1e-7, err_msg=k)


@pytest.mark.parametrize("skip", ["empty", "non-finite"])
def test_staleness_after_a_skipped_update_is_zero(tiny_model_dir, tmp_path, monkeypatch, skip):
    """Update 2 is skipped (no completion enters the loss, or its gradient is not finite): its weights stay
    those that sampled update 3's batch, so update 3 trains on-policy (staleness 0, no sampler divergence);
    update 4 is one update stale again."""
    gradients = Trainer.gradients

    def skipping(self, steps):
        if self.counters.update_step != 2:
            return gradients(self, steps)
        if skip == "empty":
            return None, None
        grads, sums = gradients(self, steps)
        return tree_map(lambda g: g * float("nan"), grads), sums

    monkeypatch.setattr(Trainer, "gradients", skipping)
    records = run_metrics(run_mod.train(make_cfg(tiny_model_dir, tmp_path, "run_name=skip", *ASYNC)))
    assert [r["rollout_staleness"] for r in records] == [0, 1, 0, 1]
    assert records[2]["sampler_kl"] < 1e-6 < records[3]["sampler_kl"]


def test_async_off_is_the_synchronous_run(tiny_model_dir, tmp_path):
    """async_rollouts = 0 writes no staleness and samples every batch from the weights it trains."""
    run = run_mod.train(make_cfg(tiny_model_dir, tmp_path, "run_name=sync", "rollout_correction=token_truncate"))
    records = run_metrics(run)
    assert all("rollout_staleness" not in r for r in records)
    assert all(r["sampler_kl"] < 1e-6 for r in records)


def test_async_schedule_and_positions_follow_the_batch_trained(tiny_model_dir, tmp_path):
    """The next batch is drawn before the update trains: the learning rate (warmup, decay), the epoch and
    prompts_cut still follow the batch the update trains, as in the synchronous run."""
    items = ["num_epochs=2", "warmup_ratio=0.3", "lr_scheduler_type=cosine", "max_prompt_length=150"]
    sync = run_metrics(run_mod.train(make_cfg(tiny_model_dir, tmp_path, "run_name=sync",
                                              "rollout_correction=token_truncate", *items)))
    ahead = run_metrics(run_mod.train(make_cfg(tiny_model_dir, tmp_path, "run_name=async", *ASYNC, *items)))
    assert len(sync) == len(ahead) == 8 and {r["epoch"] for r in sync} == {0, 1}
    assert len({r["lr"] for r in sync}) > 4 and sync[-1]["prompts_cut"] > 0
    for f in ("lr", "epoch", "prompts_cut", "batch_step"):
        assert [r[f] for r in ahead] == [r[f] for r in sync], f


@pytest.mark.parametrize("extra", [[], LORA, ["model_dtype=bfloat16", "learning_rate=1e-4", "use_compile=true",
                                          "compile_update=true"], ["rollout_worker=process", *LORA],
                                   ["rollout_worker=process", "model_dtype=bfloat16", "learning_rate=1e-4"]],
                         ids=["full", "lora-copy-accum", "bf16-masters-compiled", "process-lora",
                              "process-bf16-masters"])
def test_async_resume_equals_uninterrupted(tiny_model_dir, tmp_path, monkeypatch, extra):
    full = run_mod.train(make_cfg(tiny_model_dir, tmp_path, "run_name=full", "save_steps=2", *ASYNC, *extra))
    cfg = make_cfg(tiny_model_dir, tmp_path, "run_name=cut", "save_steps=2", *ASYNC, *extra)
    interrupt_before_update(run_mod.train, cfg, monkeypatch, 3)
    cut = Path(cfg.run.output_dir) / "cut"
    assert (cut / "checkpoint-2").is_dir() and not (cut / "checkpoint-3").exists()
    # the checkpoint holds the weights batch 3 is sampled from (update 1's result) and the position before it
    state = json.loads((cut / "checkpoint-2" / "trainer_state.json").read_text())
    assert state["rollouts_applied_at"] == 1 and state["counters"]["draws"] == state["counters"]["batch_step"]
    assert any((cut / "checkpoint-2" / f).is_file() for f in ("old_model.safetensors", "old_adapters.safetensors"))
    resumed = run_mod.train(cfg, resume="latest")
    assert run_metrics(resumed) == run_metrics(full)
    a, b = checkpoint_weights(full / "checkpoint-4"), checkpoint_weights(resumed / "checkpoint-4")
    assert a.keys() == b.keys()
    for k in a:
        assert mx.array_equal(a[k], b[k]), k


def test_async_with_evaluations(tiny_model_dir, tmp_path):
    """Evaluations during training (both triggers) run while a rollout is pending (they wait for it) and
    leave the run as it is without them."""
    evals = ["eval_every_updates=2", "eval_steps=3", "eval_subset_size=2", "eval_max_new_tokens=4"]
    with_evals = run_mod.train(make_cfg(tiny_model_dir, tmp_path, "run_name=evals", *ASYNC, *evals))
    without = run_mod.train(make_cfg(tiny_model_dir, tmp_path, "run_name=plain", *ASYNC))
    assert run_metrics(with_evals) == run_metrics(without)
    triggers = [json.loads(line)["trigger"] for line in (with_evals / "eval.jsonl").read_text().splitlines()]
    assert sorted(triggers) == ["eval_every_updates", "eval_every_updates", "eval_steps"]


def test_async_data_parallel_run_and_resume(tiny_model_dir, tmp_path):
    """Two ranks pipeline each on their own (the rollout thread calls no collective): the run reports
    what one process does for the same prompts and row keys, and resumes exactly from checkpoint-2."""
    from test_distributed import assert_same_metrics, base_items, launch, train_command

    items = base_items(tiny_model_dir, tmp_path, "save_steps=2", "kl_coeff=0.05", *ASYNC)
    single = launch(1, train_command(items + ["run_name=single"]))
    assert single.returncode == 0, single.stderr
    full = launch(2, train_command(items + ["run_name=full"]))
    assert full.returncode == 0, full.stdout + full.stderr
    run = tmp_path / "full"
    assert [r["rollout_staleness"] for r in run_metrics(run)] == [0, 1, 1, 1]
    # float sums over two ranks round differently; the rollout-correction weights are such sums here
    for one, two in zip(run_metrics(tmp_path / "single"), run_metrics(run)):
        for k in ("is_weight_mean", "is_capped_fraction"):
            assert two.pop(k) == pytest.approx(one.pop(k), rel=1e-4, abs=1e-6), k
        assert_same_metrics([one], [two], rel=1e-4)
    cut = tmp_path / "cut"
    shutil.copytree(run, cut)
    shutil.rmtree(cut / "checkpoint-4")
    resumed = launch(2, train_command(items + ["run_name=cut"], "--resume", "latest"))
    assert "at update 2" in resumed.stdout, resumed.stdout + resumed.stderr
    assert_same_metrics(run_metrics(run), run_metrics(cut))
    a, b = checkpoint_weights(run / "checkpoint-4"), checkpoint_weights(cut / "checkpoint-4")
    for k in a:
        assert mx.array_equal(a[k], b[k]), k


def test_async_bench_runs_both_modes_on_a_tiny_model(tiny_model_dir, tmp_path):
    """bench/async_bench.py end to end (its figures come from the GPU): the three runs, the table, the record."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run([sys.executable, str(root / "bench" / "async_bench.py"), "--model", str(tiny_model_dir),
                           "--dtype", "float32", "--dataset", "arith", "--batch", "2", "--group", "4",
                           "--max-new-tokens", "6", "--updates", "3", "--set", "max_prompt_length=96",
                           "--set", "system_prompt=", "--modes", "0,1,1p", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "async_rollouts = 1 vs 0:" in proc.stdout
    record = json.loads(next(tmp_path.glob("*/async_bench.json")).read_text())
    assert "async_rollouts = 1p vs 0:" in proc.stdout
    assert record["modes"]["0"]["staleness"] == [None] * 3
    assert record["modes"]["1"]["staleness"] == record["modes"]["1p"]["staleness"] == [0, 1, 1]
    assert all(record["modes"][m]["updates_per_minute"] > 0 for m in ("0", "1", "1p"))


def test_ctrl_c_ends_a_run_whose_rollout_thread_hangs(tiny_model_dir, tmp_path):
    """A scorer that never returns, called inline in the rollout thread while the update waits for it:
    Ctrl-C ends the run at once (exit 130), not waiting for the thread."""
    code, err = ctrl_c_while_scoring_hangs(tiny_model_dir, tmp_path, *ASYNC)
    assert code == 130 and "interrupted" in err and "Traceback" not in err

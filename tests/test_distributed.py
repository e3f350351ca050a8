"""Data-parallel training: 2 processes on this CPU over MLX's ring backend on 127.0.0.1, started with
mlx.launch as the README says. Two ranks of B/2 prompts give one rank's gradient for B prompts; a
2-rank run logs the figures of the whole batch, checkpoints and resumes exactly; a wrong world size,
an indivisible batch, a dead or a hung rank each end with one line that says what happened."""

import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlx_grpo.base.errors import UserError
from mlx_grpo.training.distributed import World, init_world

from conftest import run_metrics

HERE = Path(__file__).parent
TOY = HERE / "fixtures" / "toy_rewards.py"
LAUNCH = Path(sys.executable).parent / "mlx.launch"
# Figures that are float sums over the rows: their order of summation differs between 1 and 2 ranks.
FLOAT_SUMS = {"loss", "grad_norm", "kl", "entropy", "ratio_mean", "ratio_min", "ratio_max", "reward_std",
              "sampler_kl", "sampler_diff_max", "is_weight_mean"}

pytestmark = pytest.mark.skipif(not mx.distributed.is_available() or not LAUNCH.is_file(),
                                reason="MLX without a distributed backend or mlx.launch")


def free_port() -> int:
    """A port the ring backend can listen on; it takes this one and the next."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
                return port
            except OSError:
                continue


def base_items(model_dir, out, *extra) -> list[str]:
    return [f"model_name={model_dir}", f"output_dir={out}", "batch_size=4", "num_generations=4",
            "max_new_tokens=8", "max_train_samples=16", "learning_rate=1e-3", "warmup_ratio=0",
            "max_prompt_length=96", "system_prompt=", f"reward_funcs={TOY}:share_of_even_ids", *extra]


def launch(n: int, command: list[str], timeout: int = 300, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """`mlx.launch -n N --backend ring -- command` (a single process when n == 1, without the launcher)."""
    env = {**os.environ, "TQDM_DISABLE": "1", "PYTHONUNBUFFERED": "1"}
    if n > 1:
        command = [str(LAUNCH), "-n", str(n), "--backend", "ring", "-p", str(free_port()), "--", *command]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)


def train_command(items: list[str], *args: str) -> list[str]:
    sets = [a for item in items for a in ("--set", item)]
    return [sys.executable, "-m", "mlx_grpo", "train", *sets, *args]


metrics = run_metrics


def assert_same_metrics(a: list[dict], b: list[dict], rel: float = 0.0, abs_: float = 1e-6) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for k in x:
            if rel and k in FLOAT_SUMS and x[k] is not None:
                assert y[k] == pytest.approx(x[k], rel=rel, abs=abs_), k
            else:
                assert x[k] == y[k], k


def model_weights(checkpoint: Path) -> dict:
    """The trained tensors: the whole model, or a LoRA checkpoint's adapters."""
    name = "adapters.safetensors" if (checkpoint / "adapters.safetensors").is_file() else "model.safetensors"
    return {k: np.array(v) for k, v in mx.load(str(checkpoint / name)).items()}


@pytest.mark.parametrize("extra", [
    ["loss_type=dapo", "kl_coeff=0.1"],
    # unequal shares: dynamic sampling drops the flat groups, whichever rank holds them
    ["loss_type=bnpo", "scale_rewards=batch", "dynamic_sampling=true", "max_resample_batches=2",
     f"reward_funcs={TOY}:flat_unless_even_answer"],
    # the second batch step trains a group the first left (carry_surplus), from a draw split over the ranks
    ["loss_type=bnpo", "dynamic_sampling=true", "carry_surplus=true", "rollout_correction=token_truncate",
     "draws_per_pass=4", "max_resample_batches=2", "gradient_accumulation_steps=2", "max_train_samples=64",
     f"reward_funcs={TOY}:flat_unless_even_answer"],
    # adapters only in the gradient, over two accumulated batch steps
    ["train_type=lora", "lora_rank=4", "gradient_accumulation_steps=2", "kl_coeff=0.1", "loss_type=grpo"],
], ids=["dapo-kl", "bnpo-batch-dynamic", "dynamic-carry", "lora-accumulation"])
def test_two_ranks_of_half_the_prompts_give_the_one_rank_gradient(tiny_model_dir, tmp_path, extra):
    items = base_items(tiny_model_dir, tmp_path, *extra)
    worker = [sys.executable, str(HERE / "dist_worker.py")]
    for n in (1, 2):
        done = launch(n, worker + [str(tmp_path / f"{n}.npz")] + items)
        assert (tmp_path / f"{n}.npz").is_file(), done.stdout + done.stderr
    one, two = np.load(tmp_path / "1.npz"), np.load(tmp_path / "2.npz")
    assert int(one["world_size"]) == 1 and int(two["world_size"]) == 2
    assert set(one.files) == set(two.files)
    grads = [k for k in one.files if k.startswith("grad/")]
    assert grads and max(np.abs(one[k]).max() for k in grads) > 1e-3  # a real gradient, not zeros
    for k in set(one.files) - {"world_size"}:
        np.testing.assert_allclose(two[k], one[k], atol=1e-5, rtol=0, err_msg=k)
    assert float(one["sum/tokens"]) > 0


def test_two_rank_run_reports_the_whole_batch_checkpoints_and_resumes(tiny_model_dir, tmp_path):
    items = base_items(tiny_model_dir, tmp_path, "save_steps=2", "log_completions_steps=1", "kl_coeff=0.05",
                       "eval_every_updates=2", "eval_subset_size=6")
    single = launch(1, train_command(items + ["run_name=single"]))
    assert single.returncode == 0, single.stderr
    full = launch(2, train_command(items + ["run_name=full"]))
    run = tmp_path / "full"
    assert "data-parallel over 2 ranks: 2 of 4 prompts" in full.stdout, full.stdout + full.stderr
    assert full.stdout.count("done: 4 updates") == 1  # rank 0 alone prints
    # The figures of the whole batch, as one process gets them for the same prompts and row keys.
    assert_same_metrics(metrics(tmp_path / "single"), metrics(run), rel=1e-4)
    assert [r["groups_trained"] for r in metrics(run)] == [4] * 4
    assert len((run / "completions.jsonl").read_text().splitlines()) == 4 * 4 * 4
    evals = [json.loads(line) for line in (run / "eval.jsonl").read_text().splitlines()]
    assert [e["num_examples"] for e in evals] == [6, 6]
    a, b = model_weights(tmp_path / "single" / "checkpoint-4"), model_weights(run / "checkpoint-4")
    for k in a:
        np.testing.assert_allclose(b[k], a[k], atol=1e-4, rtol=0, err_msg=k)

    # An interrupted run leaves checkpoint-2 behind: resuming it with 2 ranks finishes the same run.
    cut = tmp_path / "cut"
    shutil.copytree(run, cut)
    shutil.rmtree(cut / "checkpoint-4")
    resumed = launch(2, train_command(items + ["run_name=cut"], "--resume", "latest"))
    assert "resumed from" in resumed.stdout and "at update 2" in resumed.stdout, resumed.stdout + resumed.stderr
    assert_same_metrics(metrics(run), metrics(cut))
    a, b = model_weights(run / "checkpoint-4"), model_weights(cut / "checkpoint-4")
    for k in a:
        np.testing.assert_array_equal(b[k], a[k], err_msg=k)

    # Another world size would not continue the run exactly: refused, with what to do.
    shutil.rmtree(cut / "checkpoint-4")
    alone = launch(1, train_command(items + ["run_name=cut"], "--resume", "latest"))
    assert alone.returncode == 2
    assert "written by a run of 2 process(es)" in alone.stderr and "mlx.launch -n 2" in alone.stderr
    assert "Traceback" not in alone.stderr


def test_two_ranks_carry_the_same_groups_as_one(tiny_model_dir, tmp_path):
    """carry_surplus over two ranks: each rank carries its share of the groups every rank chose, and the logs of
    the whole batch (groups carried included, counted once) are those of one process."""
    items = base_items(tiny_model_dir, tmp_path, "dynamic_sampling=true", "carry_surplus=true",
                       "rollout_correction=token_truncate", "draws_per_pass=4", "max_resample_batches=2",
                       "gradient_accumulation_steps=2", "max_train_samples=64", "save_steps=0",
                       f"reward_funcs={TOY}:flat_unless_even_answer")
    for n in (1, 2):
        done = launch(n, train_command(items + [f"run_name=r{n}"]))
        assert done.returncode == 0, done.stdout + done.stderr
    one, two = metrics(tmp_path / "r1"), metrics(tmp_path / "r2")
    assert_same_metrics(one, two, rel=1e-4)
    assert sum(r["groups_carried"] for r in one) > 0


@pytest.mark.parametrize("extra", [[], ["train_type=lora", "lora_rank=4", "update_every=2"]], ids=["full", "lora-lagging-old"])
def test_resume_needs_the_checkpoint_on_rank_0_only(tiny_model_dir, tmp_path, extra):
    """As on two hosts without a shared file system: rank 1 works in an empty directory; rank 0 reads the
    checkpoint (with a lagging old policy: its old adapters too) and sends it over, and the resumed run
    ends as the uninterrupted one did."""
    host0, host1 = tmp_path / "host0", tmp_path / "host1"
    host0.mkdir()
    host1.mkdir()
    items = base_items(tiny_model_dir, "runs", "save_steps=2", *extra)  # output_dir: relative to each rank's directory
    full = launch(2, train_command(items + ["run_name=full"]), cwd=host0)
    run = host0 / "runs" / "full"
    assert (run / "checkpoint-4").is_dir(), full.stdout + full.stderr
    cut = host0 / "runs" / "cut"
    shutil.copytree(run, cut)
    shutil.rmtree(cut / "checkpoint-4")
    rank0, rank1 = _start_ranks(tmp_path, items + ["run_name=cut", "distributed_timeout=120"],
                                args=("--resume", "latest"), cwds=(host0, host1))
    out, err = rank0.communicate(timeout=300)
    rank1.communicate(timeout=60)
    assert rank0.returncode == 0 and rank1.returncode == 0, err
    assert "at update 2" in out
    assert_same_metrics(metrics(run), metrics(cut))
    a, b = model_weights(run / "checkpoint-4"), model_weights(cut / "checkpoint-4")
    for k in a:
        np.testing.assert_array_equal(b[k], a[k], err_msg=k)
    assert not any(host1.iterdir())  # rank 1 had nothing on disk and wrote nothing


def test_batch_that_does_not_divide_among_ranks_is_refused(tiny_model_dir, tmp_path):
    done = launch(2, train_command(base_items(tiny_model_dir, tmp_path, "batch_size=3")))
    out = done.stdout + done.stderr
    assert "batch_size = 3 prompts do not divide among 2 ranks" in out and "multiple of 2 (e.g. 4)" in out
    assert out.count("do not divide") == 1 and "Traceback" not in out
    assert not (tmp_path / "grpo").exists()


def _start_ranks(tmp_path: Path, items: list[str], rank1_extra: tuple[str, ...] = (), args: tuple[str, ...] = (),
                 cwds: tuple[Path | None, Path | None] = (None, None)) -> list[subprocess.Popen]:
    """Two ranks started by hand, as on hosts whose launcher cannot stop the survivors (or on two hosts:
    each rank may have its own working directory); rank 1 may get settings of its own."""
    port = free_port()
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{port}"], [f"127.0.0.1:{port + 1}"]]))
    procs = []
    for rank in range(2):
        env = {**os.environ, "MLX_RANK": str(rank), "MLX_HOSTFILE": str(hostfile), "TQDM_DISABLE": "1"}
        command = train_command(items + list(rank1_extra if rank else ()), *args)
        procs.append(subprocess.Popen(command, env=env, text=True, cwd=cwds[rank], stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE))
    return procs


REWARDS = textwrap.dedent("""
    import os, time

    def dies_on_rank_1(prompts, completions, completion_ids, **columns):
        if os.environ.get("MLX_RANK") == "1":
            os._exit(3)
        return [0.5] * len(completions)

    def hangs_on_rank_1(prompts, completions, completion_ids, **columns):
        if os.environ.get("MLX_RANK") == "1":
            time.sleep(120)
        return [0.5] * len(completions)
""")


@pytest.mark.parametrize("reward,expect,code", [
    ("dies_on_rank_1", "most likely rank 1 stopped", 2),
    ("hangs_on_rank_1", "no answer from rank 1 for 3 s", 1),
], ids=["dead", "hung"])
def test_a_rank_that_dies_or_hangs_stops_the_others_with_its_name(tiny_model_dir, tmp_path, reward, expect, code):
    (tmp_path / "rewards.py").write_text(REWARDS)
    items = base_items(tiny_model_dir, tmp_path, f"reward_funcs={tmp_path / 'rewards.py'}:{reward}",
                       "distributed_timeout=3")
    rank0, rank1 = _start_ranks(tmp_path, items)
    try:
        _, err = rank0.communicate(timeout=120)
    finally:
        rank1.kill()
        rank1.communicate()
    assert rank0.returncode == code, err
    assert expect in err and "rank 0 of 2" in err and "Traceback" not in err


def test_a_process_started_alone_trains_by_itself():
    world = init_world("any", 0)
    assert (world.rank, world.size, world.is_main) == (0, 1, True)
    assert world.gather({"a": 1}, "x") == [{"a": 1}]
    assert world.share(8) == slice(0, 8) and world.seed(7) == 7
    assert World(None, 1, 2).share(8) == slice(4, 8) and World(None, 1, 2).seed(7) != 7


def test_a_named_backend_without_the_launcher_says_how_to_launch(monkeypatch):
    monkeypatch.delenv("MLX_HOSTFILE", raising=False)
    monkeypatch.delenv("MLX_RANK", raising=False)
    with pytest.raises(UserError, match="mlx.launch -n 2"):
        init_world("ring", 0)


def test_ranks_that_would_train_different_things_are_refused(tiny_model_dir, tmp_path):
    """Another config (or data, or model) on one host: refused at start-up, before any collective of
    training could pair up wrongly."""
    items = base_items(tiny_model_dir, tmp_path, "distributed_timeout=60")
    rank0, rank1 = _start_ranks(tmp_path, items, rank1_extra=("max_new_tokens=6",))
    try:
        _, err = rank0.communicate(timeout=120)
    finally:
        rank1.kill()
        rank1.communicate()
    assert rank0.returncode == 2, err
    assert "the ranks do not run the same job: settings of rank 1 differ from rank 0's" in err
    assert "Traceback" not in err and not (tmp_path / "grpo").exists()


def test_launched_ranks_that_mlx_cannot_join_are_refused(monkeypatch):
    """MLX falls back to a world of one when the launcher's backend is missing from this build: N
    copies would each train alone into one run directory."""
    monkeypatch.setenv("MLX_WORLD_SIZE", "2")
    monkeypatch.setenv("MLX_RANK", "1")
    with pytest.raises(UserError, match="mlx.launch started 2 processes, but this MLX build cannot join them"):
        init_world("any", 0)


def test_two_ranks_with_tools_report_what_one_rank_does(tmp_path):
    """Multi-turn rollouts with the calculator: each rank runs its share's episodes; the merged metrics (tool
    use included) and the logged turns are the one-process run's."""
    from caller_model import CALLER, write_caller_model

    model = write_caller_model(tmp_path / "caller", CALLER)
    items = base_items(model, tmp_path, 'tools=["calculator"]', "max_new_tokens=24", "log_completions_steps=1",
                       "max_train_samples=8", "learning_rate=1e-4")
    single = launch(1, train_command(items + ["run_name=single"]))
    assert single.returncode == 0, single.stderr
    two = launch(2, train_command(items + ["run_name=two"]))
    assert two.returncode == 0, two.stdout + two.stderr
    one_rank, two_ranks = metrics(tmp_path / "single"), metrics(tmp_path / "two")
    # the bigram's -30 logits make large gradients: float sums in another order differ by up to ~5e-3
    # relative (the loss, a near-zero sum of cancelling terms, by ~2e-6 absolute)
    assert_same_metrics(one_rank, two_ranks, rel=1e-2, abs_=1e-5)
    assert any(r["tool_call_rate"] > 0 for r in two_ranks)

    def turns(run):
        return [json.loads(line)["turns"] for line in (tmp_path / run / "completions.jsonl").read_text().splitlines()]

    assert turns("two") == turns("single")

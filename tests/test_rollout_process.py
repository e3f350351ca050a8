"""rollout_worker = process (rollout/process.py): the worker samples what the engine samples in this
process, reports its failures and its death as errors, stops when asked, is killed mid-rollout, ends when
the training process ends however it ends, and leaves no weights file behind."""

from __future__ import annotations

import errno
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_map

from conftest import ctrl_c_while_scoring_hangs
from mlx_grpo.base import errors
from mlx_grpo.base.errors import UserError
from mlx_grpo.models.model_loading import load_model
from mlx_grpo.rollout import process as process_mod
from mlx_grpo.rollout.engine import RolloutEngine
from mlx_grpo.rollout.process import RolloutProcess, raise_worker_error
from mlx_grpo.rollout.rollout_records import SamplingParams

PARAMS = SamplingParams(max_new_tokens=6, temperature=1.0)


@pytest.fixture(params=["float32"])
def worker(tiny_model_dir, request):
    model, tokenizer = load_model(str(tiny_model_dir), request.param)
    model.eval()
    process = RolloutProcess(model, tokenizer, "model", False)
    yield model, tokenizer, process
    process.stop(busy=True)
    process.release()
    assert not Path(process.path).exists()  # removed by the worker once mapped, or by stop() if it never was


def jobs(n: int = 2) -> list:
    return [([[1, 5, 7], [1, 9]], mx.random.split(mx.random.key(n), 4))]


@pytest.mark.parametrize("worker", ["float32", "bfloat16"], indirect=True)
def test_worker_samples_what_this_process_samples_from_the_weights_sent(worker):
    model, tokenizer, process = worker
    start = model.parameters()
    changed = tree_map(lambda w: w * 1.5, start)  # weights other than those it started with
    engine = RolloutEngine(tokenizer, mode="model")
    texts = []
    for weights in (start, changed, start):
        (got,), seconds = process.sample(weights, jobs(), 2, PARAMS, "")
        model.update(weights)
        (want,) = engine.refresh(model).generate_many(jobs(), 2, PARAMS, "")
        assert mx.array_equal(got.completion_ids, want.completion_ids) and got.texts == want.texts
        assert mx.array_equal(got.sampler_logprobs, want.sampler_logprobs)
        texts.append(got.texts)
    assert texts[0] == texts[2] != texts[1]  # the weights sent are those sampled from


def test_an_error_in_the_worker_is_raised_here_and_the_worker_goes_on(worker):
    model, _, process = worker
    with pytest.raises(RuntimeError, match=r"^1 row keys for 2 rows: one key per row\n\nthe rollout process "
                                           r"\(rollout_worker = process\) failed with ValueError; its traceback:\n"):
        process.sample(model.parameters(), [([[1, 5]], mx.zeros((1, 2), mx.uint32))], 2, PARAMS, "")  # 1 key, 2 rows
    (out,), _ = process.sample(model.parameters(), jobs(), 2, PARAMS, "")
    assert out.completion_ids.shape[0] == 4


def test_a_dead_worker_is_an_error_with_its_exit_code(worker):
    model, _, process = worker
    process.sample(model.parameters(), jobs(), 2, PARAMS, "")
    os.kill(process.process.pid, signal.SIGKILL)
    with pytest.raises(RuntimeError, match=r"the rollout process \(rollout_worker = process\) ended with exit code -9"):
        process.sample(model.parameters(), jobs(), 2, PARAMS, "")


@pytest.mark.parametrize("started", [False, True])
def test_an_idle_worker_stops_when_asked(worker, started):
    model, _, process = worker
    if started:
        process.sample(model.parameters(), jobs(), 2, PARAMS, "")
    process.stop(busy=False)
    assert process.process.exitcode == 0


def test_a_model_that_does_not_pickle_is_one_line(worker):
    model, tokenizer, _ = worker
    model.unpicklable = lambda: None  # a lambda does not pickle
    with pytest.raises(UserError, match=r"cannot pickle it .*: set rollout_worker = thread"):
        RolloutProcess(model, tokenizer, "model", False)


def test_a_worker_that_fails_at_start_up_reports_its_error_even_to_a_large_job(worker):
    """The worker replies with its start-up failure and exits (3); a job larger than the pipe's buffer meets the
    closed pipe first, and the reply waiting there is still what the run says."""
    model, _, process = worker
    process.payload = pickle.dumps(("not", "the model"))  # what unpickling in the worker cannot unpack
    big = [([list(range(1, 200))] * 500, mx.random.split(mx.random.key(0), 1000))]
    with pytest.raises(RuntimeError, match=r"^not enough values to unpack .*\n\nthe rollout process \(rollout_worker "
                                           r"= process\) failed with ValueError"):
        process.sample(model.parameters(), big, 2, PARAMS, "")
    process.process.join(10)
    assert process.process.exitcode == 3


@pytest.mark.skipif(not (hasattr(os, "posix_fallocate") and Path("/dev/shm").is_dir() and Path("/proc").is_dir()),
                    reason="Linux: posix_fallocate, /dev/shm and /proc")
def test_no_room_in_dev_shm_falls_back_to_the_temp_folder_then_says_so(monkeypatch, tmp_path):
    """A sparse file on a full tmpfs would kill the trainer with SIGBUS at the first write: the blocks are
    allocated up front, elsewhere when /dev/shm has no room, and a line names both when neither has."""
    allocate, seen = os.posix_fallocate, []

    def full_shm(fd, offset, size):
        seen.append(os.readlink(f"/proc/self/fd/{fd}"))
        if seen[-1].startswith("/dev/shm/") or len(seen) > 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        allocate(fd, offset, size)

    monkeypatch.setattr(os, "posix_fallocate", full_shm)
    monkeypatch.setattr(process_mod.tempfile, "gettempdir", lambda: str(tmp_path))
    path = process_mod.weights_file(1000)
    assert Path(path).parent == tmp_path and Path(path).stat().st_size == 1000 and seen[0].startswith("/dev/shm/")
    Path(path).unlink()
    with pytest.raises(UserError, match=r"trainable weights \(0 MB\) .* none could be made: /dev/shm \(No space left "
                                        r"on device\); .* \(in Docker: --shm-size\): free some room, or set "
                                        r"rollout_worker = thread"):
        process_mod.weights_file(1000)
    assert not list(tmp_path.iterdir()) and not [p for p in seen if Path(p).exists()]


def test_an_out_of_memory_in_the_worker_is_the_run_s_out_of_memory_line():
    """The worker's failed allocation reaches errors.out_of_memory with its message first and the rollout phase."""
    with pytest.raises(RuntimeError) as caught:
        raise_worker_error("RuntimeError", "[cuda::malloc] Unable to allocate 1024 bytes", "Traceback ...")
    line = errors.out_of_memory(caught.value, "train")
    assert line.startswith("out of device memory while sampling rollouts ([cuda::malloc] Unable to allocate 1024 "
                           "bytes): lower batch_size x num_generations"), line
    with pytest.raises(RuntimeError, match=r"^bad row\n\nthe rollout process \(rollout_worker = process\) failed "
                                           r"with ValueError; its traceback:\nTraceback"):
        raise_worker_error("ValueError", "bad row", "Traceback ...")


ORPHAN = """
import os, sys, threading, time
import mlx.core as mx
from mlx_grpo.models.model_loading import load_model
from mlx_grpo.rollout.process import RolloutProcess
from mlx_grpo.rollout.rollout_records import SamplingParams

if __name__ == "__main__":  # spawn imports this file again in the worker
    model, tokenizer = load_model(sys.argv[1], "float32")
    process = RolloutProcess(model, tokenizer, "model", False)
    job = [([[1, 5]], mx.random.split(mx.random.key(0), 2))]
    if sys.argv[2] == "job":
        process.sample(model.parameters(), job, 2, SamplingParams(max_new_tokens=4, temperature=1.0), "")
    elif sys.argv[2] == "mid-job":  # a rollout of minutes: only the watch on this process can end the worker
        long = SamplingParams(max_new_tokens=50_000, temperature=1.0, ignore_eos=True)
        mx.eval(job[0][1])  # as prefetch.py does: a lazy array cannot be evaluated (pickled) on another thread
        threading.Thread(target=process.sample, args=(model.parameters(), job, 2, long, ""), daemon=True).start()
        time.sleep(5)  # the worker starts (MLX imported, the model unpickled) and decodes
    print(process.process.pid, process.path, flush=True)
    os._exit(130)  # as Ctrl-C leaves (base/interrupt.py): no clean-up runs; the worker may still be starting
"""


def gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split()[0] in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):
        return True


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc")
@pytest.mark.parametrize("when", ["job", "mid-job", "starting"])
def test_the_worker_ends_when_the_training_process_is_gone(tiny_model_dir, tmp_path, when):
    script = tmp_path / "orphan.py"
    script.write_text(ORPHAN)
    done = subprocess.run([sys.executable, str(script), str(tiny_model_dir), when],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.returncode == 130, done.stderr
    pid, path = done.stdout.split()
    deadline = time.monotonic() + 15
    while not (gone(int(pid)) and not Path(path).exists()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert gone(int(pid)) and not Path(path).exists()


def test_ctrl_c_ends_a_run_with_a_rollout_process(tiny_model_dir, tmp_path):
    """Ctrl-C while the update waits for a scorer that never returns: the run ends at once (exit 130),
    the worker (which ignores SIGINT) is ended with it, and nothing prints a traceback."""
    code, err = ctrl_c_while_scoring_hangs(tiny_model_dir, tmp_path, "async_rollouts=1",
                                           "rollout_correction=token_truncate", "rollout_worker=process")
    assert code == 130 and "interrupted" in err and "Traceback" not in err


def test_data_parallel_runs_are_refused(tiny_model_dir, tmp_path):
    from test_distributed import base_items, launch, train_command

    items = base_items(tiny_model_dir, tmp_path, "async_rollouts=1", "rollout_correction=token_truncate",
                       "rollout_worker=process")
    proc = launch(2, train_command(items + ["run_name=dp"]))
    assert "rank 0 exited with code 2" in proc.stderr
    assert "rollout_worker = process runs one rollout process beside one training process" in proc.stderr

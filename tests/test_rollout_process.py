"""rollout_worker = process (training/rollout_process.py): the worker samples what the engine samples in this
process, reports its failures and its death as errors, stops when asked, and is killed mid-rollout."""

from __future__ import annotations

import os
import signal

import mlx.core as mx
import pytest
from mlx.utils import tree_map

from conftest import ctrl_c_while_scoring_hangs
from mlx_grpo.models.loading import load_model
from mlx_grpo.rollout.engine import RolloutEngine
from mlx_grpo.rollout.records import SamplingParams
from mlx_grpo.training.rollout_process import RolloutProcess

PARAMS = SamplingParams(max_new_tokens=6, temperature=1.0)


@pytest.fixture(params=["float32"])
def worker(tiny_model_dir, request):
    model, tokenizer = load_model(str(tiny_model_dir), request.param)
    model.eval()
    process = RolloutProcess(model, tokenizer, "model", False)
    yield model, tokenizer, process
    process.stop(busy=True)


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
        assert seconds > 0
        assert mx.array_equal(got.completion_ids, want.completion_ids) and got.texts == want.texts
        assert mx.array_equal(got.sampler_logprobs, want.sampler_logprobs)
        texts.append(got.texts)
    assert texts[0] == texts[2] != texts[1]  # the weights sent are those sampled from


def test_an_error_in_the_worker_is_raised_here_and_the_worker_goes_on(worker):
    model, _, process = worker
    with pytest.raises(RuntimeError, match=r"the rollout process \(rollout_worker = process\) failed:\n(.|\n)*Error"):
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
    with pytest.raises(Exception, match=r"cannot pickle it .*: set rollout_worker = thread"):
        RolloutProcess(model, tokenizer, "model", False)


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

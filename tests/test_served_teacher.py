"""On-policy distillation from a served teacher (teacher_url) against a stub OpenAI-compatible completions server
on 127.0.0.1 that scores the received token ids with a tiny MLX model (mlx-lm): its log-probs of a real rollout
equal the local teacher's (teacher_model = the same model) in both answer shapes, multi-turn context columns
included; a pure distillation run through the server completes; and what people get wrong is one line."""

from __future__ import annotations

import json
import socket
import threading
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import mlx.core as mx
import numpy as np
import pytest

from conftest import run_metrics
from mlx_grpo.base.errors import UserError
from mlx_grpo.commands import train as run_mod
from mlx_grpo.commands.assembly import build_job, load_teacher
from mlx_grpo.config import build_config, parse_set
from mlx_grpo.models.model_loading import load_model
from mlx_grpo.models.tiny import write_tiny_model
from mlx_grpo.training.served_teacher import ServedTeacher

SERVED_NAME = "tiny-teacher"


class TeacherServer:
    """vLLM's endpoints as the client uses them: GET /v1/models, POST /tokenize and POST /v1/completions, which
    scores the prompt's token ids with the model (one forward at a time: MLX graphs are built per thread) and
    answers in `shape`: "classic" (logprobs.token_logprobs) or "prompt_logprobs" (vLLM's extension)."""

    def __init__(self, model_dir):
        from mlx_lm import load

        self.model, self.tokenizer = load(str(model_dir))
        self.shape, self.has_tokenize, self.reply, self.token_offset = "classic", True, None, 0
        self.requests, self.lock = [], threading.Lock()
        self.max_logprobs = None  # vLLM's --max-logprobs: fewer top tokens than asked for (None: as asked)
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                if self.path == "/v1/models":
                    return self.answer(200, {"object": "list", "data": [{"id": SERVED_NAME, "object": "model"}]})
                self.answer(404, {"error": "not found"})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path == "/tokenize" and owner.has_tokenize:
                    tokens = [t + owner.token_offset for t in owner.tokenizer.encode(body["prompt"])]
                    return self.answer(200, {"tokens": tokens, "count": len(tokens)})
                if self.path != "/v1/completions":
                    return self.answer(404, {"error": "not found"})
                owner.requests.append(body)
                if owner.reply is not None:
                    return self.answer(200, owner.reply)
                k = body.get("prompt_logprobs") or body["logprobs"]
                self.answer(200, owner.complete(body["prompt"], min(k, owner.max_logprobs or k)))

            def answer(self, status, reply):
                data = reply if isinstance(reply, bytes) else json.dumps(reply).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1/completions"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def complete(self, ids: list[int], k: int = 1) -> dict:
        """The echoed prompt's log-probs with each position's k most likely tokens (the request's logprobs or
        prompt_logprobs), then one greedy token (max_tokens = 1), in the OpenAI format."""
        with self.lock:
            logits = self.model(mx.array(ids)[None])[0].astype(mx.float32)  # [L, V]
            lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            picked = mx.take_along_axis(lp[:-1], mx.array(ids[1:])[:, None], axis=-1)[:, 0].tolist()
            order = mx.argsort(-lp, axis=-1)[:, :k]  # each position's top k tokens: vLLM's top entries
            best, best_lp = order.tolist(), mx.take_along_axis(lp, order, axis=-1).tolist()
        generated = best[-1][0]
        if self.shape == "prompt_logprobs":  # the top tokens' entries first, then the prompt token's (vLLM)
            entries = [None]
            for i, (t, v) in enumerate(zip(ids[1:], picked)):
                entry = {str(b): {"logprob": x, "rank": j + 1, "decoded_token": "?"}
                         for j, (b, x) in enumerate(zip(best[i], best_lp[i]))}
                entry.setdefault(str(t), {"logprob": v, "rank": k + 1, "decoded_token": "?"})
                entries.append(entry)
            return {"object": "text_completion", "model": SERVED_NAME,
                    "choices": [{"index": 0, "text": "?", "logprobs": None, "prompt_logprobs": entries}]}
        tokens = ids + [generated]
        return {"object": "text_completion", "model": SERVED_NAME, "choices": [{"index": 0, "text": "?", "logprobs": {
            "tokens": [f"token_id:{t}" for t in tokens], "token_logprobs": [None] + picked + [best_lp[-1][0]],
            "top_logprobs": [None] + [{f"token_id:{b}": x for b, x in zip(bs, xs)} for bs, xs in zip(best, best_lp)],
            "text_offset": list(range(len(tokens)))}}]}

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def teacher_cfg(student, out, *items):
    base = [f"model_name={student}", f"output_dir={out}", "batch_size=2", "num_generations=4", "max_new_tokens=8",
            "max_train_samples=4", "learning_rate=1e-2", "warmup_ratio=0", "log_completions_steps=0", "dataset=arith",
            "max_prompt_length=256", "system_prompt=", "kl_coeff=0", "save_steps=0", "model_dtype=float32",
            "distill_coeff=1"]
    return build_config("train", overrides=parse_set(base + list(items)))


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    """Another tiny llama with the student's tokenizer: the same architecture, other random weights."""
    return write_tiny_model(tmp_path_factory.mktemp("teacher") / "model", seed=5)


@pytest.fixture(scope="module")
def server(teacher_dir):
    s = TeacherServer(teacher_dir)
    yield s
    s.close()


@pytest.fixture
def stub(server):
    """The module's server, reset to answering in the classic shape with /tokenize."""
    server.shape, server.has_tokenize, server.reply, server.token_offset = "classic", True, None, 0
    server.requests.clear()
    server.max_logprobs = None
    return server


@pytest.fixture(scope="module")
def rollouts(tiny_model_dir, teacher_dir, tmp_path_factory):
    """A real rollout of the student, and a multi-turn-like copy of it whose rows end at different columns (pad
    ids after) and whose completions hold context the model did not sample (mask 0 at columns 2-3, as a tool's
    answer has), with the local teacher's log-probs of both: ([(rollout, log-probs)], the pad id)."""
    job = build_job(teacher_cfg(tiny_model_dir, tmp_path_factory.mktemp("local"), f"teacher_model={teacher_dir}"))
    try:
        rollout, pad = job.source.next().batches[0].rollout, job.trainer.pad_id
        N, T = rollout.completion_ids.shape
        ends = np.array([T - r % 4 for r in range(N)])  # the tiny model rarely ends early: make rows that do
        column = np.arange(T)[None]
        inside = column < ends[:, None]
        mask = np.where(inside & ((column < 2) | (column >= 4)), np.array(rollout.mask), 0.0).astype(np.float32)
        ids = mx.where(mx.array(inside), rollout.completion_ids, pad).astype(mx.int32)
        multi = replace(rollout, completion_ids=ids, mask=mx.array(mask), ends=ends)
        pairs = [(r, job.trainer.policies.teacher_logprobs(r, pad)) for r in (rollout, multi)]
    finally:
        job.close()
    assert len({len(p) for p in rollout.prompt_ids}) > 1  # prompts of different lengths in one rollout
    return pairs, pad


@pytest.mark.parametrize("shape", ["classic", "prompt_logprobs"])
def test_served_log_probs_equal_the_local_teachers(stub, rollouts, tiny_model_dir, tmp_path, shape):
    stub.shape = shape
    job = build_job(teacher_cfg(tiny_model_dir, tmp_path, f"teacher_url={stub.url}"))
    try:
        policies = job.trainer.policies
        assert isinstance(policies.teacher, ServedTeacher)
        pairs, pad = rollouts
        for rollout, local in pairs:
            served = policies.teacher_logprobs(rollout, pad)
            assert served.dtype == mx.float32 and served.shape == local.shape
            assert float(mx.abs(served).sum()) > 0
            np.testing.assert_allclose(np.array(served), np.array(local), rtol=0, atol=1e-6)
            assert (np.array(served)[np.array(rollout.mask) == 0] == 0).all()
    finally:
        job.close()
    body = stub.requests[-1]
    assert body["echo"] is True and body["max_tokens"] == 1 and body["logprobs"] == 1
    assert body["model"] == SERVED_NAME and all(isinstance(t, int) for t in body["prompt"])


TOPK = 5


@pytest.fixture(scope="module")
def local_topk(tiny_model_dir, teacher_dir, rollouts, tmp_path_factory):
    """The local teacher's top-k (policy.topk_pass) of both rollouts: [(log-probs, TeacherTopK)]."""
    cfg = teacher_cfg(tiny_model_dir, tmp_path_factory.mktemp("local_topk"), f"teacher_model={teacher_dir}",
                      f"distill_topk={TOPK}")
    job = build_job(cfg)
    try:
        pairs, pad = rollouts
        return [job.trainer.policies.teacher_scores(r, pad) for r, _ in pairs]
    finally:
        job.close()


@pytest.mark.parametrize("shape", ["classic", "prompt_logprobs"])
def test_served_top_k_equals_the_local_teachers(stub, rollouts, local_topk, tiny_model_dir, tmp_path, shape):
    """distill_topk through the server: the same top-k ids and log-probs as the local teacher's pass, in both
    answer shapes, multi-turn context columns (mask 0) left 0."""
    stub.shape = shape
    job = build_job(teacher_cfg(tiny_model_dir, tmp_path, f"teacher_url={stub.url}", f"distill_topk={TOPK}"))
    try:
        pairs, pad = rollouts
        for (rollout, _), (local_lp, local) in zip(pairs, local_topk):
            lp, served = job.trainer.policies.teacher_scores(rollout, pad)
            assert served.ids.shape == local.ids.shape == (*rollout.completion_ids.shape, TOPK)
            assert served.ids.dtype == mx.int32 and served.logprobs.dtype == mx.float32
            np.testing.assert_array_equal(np.array(served.ids), np.array(local.ids))
            np.testing.assert_allclose(np.array(served.logprobs), np.array(local.logprobs), rtol=0, atol=1e-5)
            np.testing.assert_allclose(np.array(lp), np.array(local_lp), rtol=0, atol=1e-5)
            off = np.array(rollout.mask) == 0
            assert off.any() or rollout is pairs[0][0]
            assert (np.array(served.ids)[off] == 0).all() and (np.array(served.logprobs)[off] == 0).all()
    finally:
        job.close()
    body = stub.requests[-1]
    assert body["prompt_logprobs"] == TOPK and body["logprobs"] == TOPK and body["return_tokens_as_token_ids"]


def test_a_server_without_the_top_k_is_one_line_at_start(stub, tiny_model_dir, tmp_path):
    """A server answering one log-prob per token (no top k) stops distill_topk at the start's probe."""
    stub.max_logprobs, stub.shape = 1, "prompt_logprobs"
    cfg = teacher_cfg(tiny_model_dir, tmp_path, f"teacher_url={stub.url}", f"distill_topk={TOPK}")
    with pytest.raises(UserError, match=rf"without the prompt's top {TOPK} log-probs \(entry 1 holds [12] tokens\)"):
        load_teacher(cfg, load_model(str(tiny_model_dir))[1])


def test_a_distillation_run_through_the_server_completes_two_updates(stub, tiny_model_dir, tmp_path):
    run = run_mod.train(teacher_cfg(tiny_model_dir, tmp_path, f"teacher_url={stub.url}", "reward_funcs=[]"))
    records = run_metrics(run)
    assert len(records) == 2
    assert all(r["teacher_kl"] is not None and np.isfinite(r["teacher_kl"]) and np.isfinite(r["loss"])
               for r in records)
    assert len(stub.requests) >= 2 * 8  # a request per row of each update (and the start's probe)


def test_a_server_without_tokenize_is_a_warning(stub, tiny_model_dir, tmp_path):
    stub.has_tokenize = False
    said = []
    cfg = teacher_cfg(tiny_model_dir, tmp_path, f"teacher_url={stub.url}")
    assert isinstance(load_teacher(cfg, load_model(str(tiny_model_dir))[1], say=said.append)[0], ServedTeacher)
    assert len(said) == 1 and "its tokenizer could not be checked" in said[0]


def _one_line(message: str) -> str:
    assert "\n" not in message
    return message


def test_another_tokenizer_on_the_server_is_one_line(stub, tiny_model_dir, tmp_path):
    stub.token_offset = 1
    cfg = teacher_cfg(tiny_model_dir, tmp_path, f"teacher_url={stub.url}")
    with pytest.raises(UserError) as e:
        load_teacher(cfg, load_model(str(tiny_model_dir))[1])
    assert "encodes to" in _one_line(str(e.value)) and "uses another tokenizer than the student" in str(e.value)


def test_a_server_that_is_down_is_one_line(tiny_model_dir, tmp_path):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there now
    cfg = teacher_cfg(tiny_model_dir, tmp_path, f"teacher_url=http://127.0.0.1:{port}/v1/completions",
                      "teacher_url_retries=0")
    with pytest.raises(UserError, match=rf"teacher server http://127.0.0.1:{port}/v1/models did not answer after 1 "
                                        r"tries \(ConnectionRefusedError"):
        load_teacher(cfg, load_model(str(tiny_model_dir))[1])


@pytest.mark.parametrize("reply, message", [
    (b"<html>busy</html>", "answered with invalid JSON"),
    ({"choices": []}, r"without the prompt's log-probs \(no choices\)"),
    ({"choices": [{"text": "x"}]}, r"neither choices\[0\].prompt_logprobs nor choices\[0\].logprobs.token_logprobs"),
    ({"choices": [{"logprobs": {"token_logprobs": [None, -1.0]}}]}, r"2 token_logprobs for \d+ prompt tokens: is "
                                                                    "echo supported"),
    ({"choices": [{"logprobs": {"token_logprobs": [None] + ["x"] * 99}}]}, "something other than numbers"),
    ({"choices": [{"prompt_logprobs": [None] + [{"99999": {"logprob": -1.0}}] * 99}]},
     r"prompt_logprobs entry 1 has no log-prob for its token \d+"),
])
def test_a_malformed_answer_is_one_line(stub, tiny_model_dir, tmp_path, reply, message):
    stub.reply = reply
    cfg = teacher_cfg(tiny_model_dir, tmp_path, f"teacher_url={stub.url}")
    with pytest.raises(UserError, match=message) as e:
        load_teacher(cfg, load_model(str(tiny_model_dir))[1])
    assert str(e.value).startswith(f"teacher server {stub.url}") and _one_line(str(e.value))


def test_a_malformed_answer_during_training_is_one_line(stub, rollouts):
    """The same check guards every row's answer, not only the start's probe."""
    teacher = ServedTeacher(stub.url, timeout_s=5, retries=0)
    pairs, _ = rollouts
    stub.reply = {"choices": [{"logprobs": {"token_logprobs": [None]}}]}
    with pytest.raises(UserError, match="is echo supported") as e:
        teacher.logprobs(pairs[0][0])
    _one_line(str(e.value))


@pytest.mark.parametrize("items, message", [
    (["teacher_url=http://127.0.0.1:8000/v1/completions", "temperature=0.7"],
     r"teacher_url's server gives log-probs of the untempered distribution, but the rollouts sample at "
     r"temperature = 0.7: set temperature = 1.0, or use teacher_model"),
    (["teacher_url=http://127.0.0.1:8000/v1/completions", "teacher_model=x"],
     "teacher_model and teacher_url both name a teacher: set one"),
    ([], r"distill_coeff > 0 needs a teacher: set teacher_model \(a local model\) or teacher_url \(a served one\)"),
    (["teacher_url_timeout=5", "teacher_model=x"], "teacher_url_timeout only applies with teacher_url set"),
    (["teacher_url=http://127.0.0.1:8000/v1/completions", "distill_coeff=0"],
     "teacher_url only applies with distill_coeff > 0"),
])
def test_teacher_settings_that_cannot_act_are_refused(tiny_model_dir, tmp_path, items, message):
    with pytest.raises(UserError, match=message) as e:
        teacher_cfg(tiny_model_dir, tmp_path, *items)
    _one_line(str(e.value))


def test_a_teacher_host_that_is_not_loopback_is_refused(tiny_model_dir, tmp_path):
    """Prompts and completions leave the machine only for a host the config names."""
    cfg = teacher_cfg(tiny_model_dir, tmp_path, "teacher_url=http://teacher.example.com/v1/completions")
    with pytest.raises(UserError, match="teacher_url host 'teacher.example.com' is not loopback: .* add it to "
                                        "teacher_url_allowed_hosts"):
        load_teacher(cfg, load_model(str(tiny_model_dir))[1])


def test_served_top_k_past_the_tokenizer_or_not_finite_is_one_line():
    """A served top-k id past the student tokenizer's ids (a padded head's row: the student's gather would read
    garbage) or a log-prob that is not finite (-inf: 0 * -inf = NaN in the loss) stops the run in one line."""
    from mlx_grpo.training.served_teacher import read_topk

    def answer(entry):
        return {"choices": [{"prompt_logprobs": [None, entry]}]}

    ids, lps = read_topk(answer({"5": {"logprob": -0.1}, "3": {"logprob": -1.0}}), [1, 5], 2, "http://t", 6)
    assert ids.tolist() == [[5, 3]] and np.allclose(lps, [[-0.1, -1.0]])
    with pytest.raises(UserError, match="token id 7, past the student tokenizer's 6 tokens"):
        read_topk(answer({"5": {"logprob": -0.1}, "7": {"logprob": -1.0}}), [1, 5], 2, "http://t", 6)
    with pytest.raises(UserError, match="not a token id and its log-prob"):
        read_topk(answer({"5": {"logprob": -0.1}, "3": {"logprob": float("-inf")}}), [1, 5], 2, "http://t", 6)
    with pytest.raises(UserError, match="not a token id"):
        read_topk(answer({"5": {"logprob": -0.1}, "²": {"logprob": -1.0}}), [1, 5], 2, "http://t", 6)

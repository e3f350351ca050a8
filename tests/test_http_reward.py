"""The HTTP reward against a real server on 127.0.0.1: request body, retries, timeouts, a server that
is down, bad answers, the loopback-only rule, and a training run scored by the server."""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from mlx_grpo.base.errors import UserError
from mlx_grpo.config import build_config, parse_set
from mlx_grpo.rewards import http as http_reward
from mlx_grpo.rewards.http import HttpReward, check_reward_url
from mlx_grpo.rewards.scoring import RewardSet


class Server:
    """A scoring server whose behaviour the test sets: rewards = length of each completion."""

    def __init__(self):
        self.requests, self.fail_first, self.delay_s, self.reply = [], 0, 0.0, None
        self.fail_status, self.fail_body = 503, b""
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                owner.requests.append(body)
                if len(owner.requests) <= owner.fail_first:
                    self.send_response(owner.fail_status)
                    if owner.fail_status == 302:
                        self.send_header("Location", "http://192.0.2.2:9/elsewhere")
                    self.end_headers()
                    self.wfile.write(owner.fail_body)
                    return
                time.sleep(owner.delay_s)
                reply = owner.reply if owner.reply is not None else \
                    json.dumps({"rewards": [float(len(c)) for c in body["completions"]]}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/score"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server(monkeypatch):
    monkeypatch.setattr(http_reward, "BACKOFF_S", 0.01)
    s = Server()
    yield s
    s.close()


def _score(fn, completions=("ab", "abcd")):
    return fn(prompts=["p1", "p2"], completions=list(completions), completion_ids=[[1], [2]], answer=["3", "4"])


def test_posts_prompts_completions_and_columns(server):
    fn = HttpReward(server.url, timeout_s=5, retries=0)
    assert _score(fn) == [2.0, 4.0]
    assert server.requests == [{"prompts": ["p1", "p2"], "completions": ["ab", "abcd"], "answer": ["3", "4"]}]


def test_reward_set_weights_the_server_reward(server):
    rs = RewardSet(["int"], extra=[("reward_url", HttpReward(server.url, 5, 0), 0.5)])
    scores = rs.score(["q", "q"], ["ab", "<answer>\n7\n</answer>"], [[1], [2]], {"answer": ["7", "7"]})
    assert scores.names == ["int", "reward_url"]
    assert scores.total.tolist() == pytest.approx([1.0, 0.5 + 0.5 * 20])  # int 0.5 + half of 20 chars


def test_retries_server_errors_with_backoff(server):
    server.fail_first = 2
    assert _score(HttpReward(server.url, timeout_s=5, retries=2)) == [2.0, 4.0]
    assert len(server.requests) == 3
    server.requests.clear()
    with pytest.raises(UserError, match=r"did not answer after 2 tries \(HTTP 503"):
        _score(HttpReward(server.url, timeout_s=5, retries=1))


def test_timeout_is_retried_then_reported(server):
    server.delay_s = 0.5
    with pytest.raises(UserError, match=r"did not answer after 2 tries \(timed out after 0.1 s\)"):
        _score(HttpReward(server.url, timeout_s=0.1, retries=1))
    assert len(server.requests) == 2


def test_server_down_is_one_clear_error():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    fn = HttpReward(f"http://127.0.0.1:{port}/", timeout_s=1, retries=1)
    with pytest.raises(UserError, match=rf"reward server http://127.0.0.1:{port}/ did not answer after 2 tries "
                                        r"\(ConnectionRefusedError.*is it running\?"):
        _score(fn)


@pytest.mark.parametrize("reply,message", [
    (b"not json", "invalid JSON"),
    (b'{"scores": [1, 2]}', "without a 'rewards' list"),
    (b'{"rewards": [1]}', "returned 1 values, expected 2"),
    (b'{"rewards": [1, "x"]}', "non-numeric value at index 1"),
])
def test_bad_answers_are_named(server, reply, message):
    server.reply = reply
    rs = RewardSet([], extra=[("reward_url", HttpReward(server.url, 5, 0), 1.0)])
    with pytest.raises(UserError, match=message):
        rs.score(["q", "q"], ["a", "b"], [[1], [2]], {})


@pytest.mark.parametrize("url", ["http://127.0.0.1:8000/x", "http://localhost/", "https://[::1]:9/"])
def test_loopback_is_allowed(url):
    check_reward_url(url, [])


def test_other_hosts_need_to_be_listed():
    with pytest.raises(UserError, match="'scorer.example.com' is not loopback"):
        check_reward_url("http://scorer.example.com/score", [])
    check_reward_url("http://scorer.example.com/score", ["scorer.example.com"])
    with pytest.raises(UserError, match="http:// or https://"):
        check_reward_url("ftp://127.0.0.1/x", [])


def test_url_fields_need_reward_url():
    with pytest.raises(UserError, match="reward_url_timeout only applies with reward_url set"):
        build_config("train", overrides=parse_set(["reward_url_timeout=5"]))
    cfg = build_config("train", overrides=parse_set(["reward_url=http://127.0.0.1:1/", "reward_funcs=[]"]))
    assert cfg.rewards.reward_funcs == []


def test_training_run_scored_by_the_server(server, tiny_model_dir, tmp_path):
    from mlx_grpo.commands import train as trainer

    cfg = build_config("train", overrides=parse_set([
        f"model_name={tiny_model_dir}", f"output_dir={tmp_path}", "batch_size=2", "num_generations=4",
        "max_new_tokens=8", "max_train_samples=2", "system_prompt=", "reward_funcs=[]", f"reward_url={server.url}",
        "reward_url_weight=0.25"]))
    run = trainer.train(cfg)
    record = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    assert len(server.requests) == 1 and len(server.requests[0]["completions"]) == 8
    assert {"prompts", "completions", "answer"} <= set(server.requests[0])  # and every other data column
    expected = sum(len(c) for c in server.requests[0]["completions"]) / 8
    assert record["reward/reward_url"] == pytest.approx(expected)
    assert record["reward_mean"] == pytest.approx(0.25 * expected)


def test_client_errors_are_not_retried_and_show_the_server_message(server):
    server.fail_first, server.fail_status, server.fail_body = 5, 422, b"completions missing"
    with pytest.raises(UserError, match=r"refused the batch \(HTTP 422 .*completions missing\)"):
        _score(HttpReward(server.url, timeout_s=5, retries=3))
    assert len(server.requests) == 1


def test_redirects_are_not_followed(server):
    """A redirect could carry the completions to another host."""
    server.fail_first, server.fail_status = 5, 302
    with pytest.raises(UserError, match="redirected to http://192.0.2.2:9/elsewhere"):
        _score(HttpReward(server.url, timeout_s=5, retries=0))


def test_proxy_variables_do_not_carry_loopback_traffic_away(server, monkeypatch):
    monkeypatch.setenv("http_proxy", "http://192.0.2.3:3128")
    monkeypatch.setenv("HTTP_PROXY", "http://192.0.2.3:3128")
    assert _score(HttpReward(server.url, timeout_s=2, retries=0)) == [2.0, 4.0]
    assert len(server.requests) == 1


def _raw_server(handler):
    """A one-shot TCP server on 127.0.0.1 that runs handler(conn) for each connection."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(4)

    def serve():
        while True:
            try:
                conn, _ = sock.accept()
            except OSError:
                return
            threading.Thread(target=handler, args=(conn,), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    return sock, sock.getsockname()[1]


def test_a_server_that_trickles_bytes_hits_the_total_deadline():
    def trickle(conn):
        with conn:
            conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n")
            for _ in range(50):  # one byte every 0.1 s: each read resets a socket timeout of 0.5 s
                try:
                    conn.sendall(b" ")
                except OSError:
                    return
                time.sleep(0.1)

    sock, port = _raw_server(trickle)
    try:
        # No clock here: only the total deadline can end the request with "timed out". Read byte by byte
        # without it, the trickle's 50 bytes arrive, the server closes, and the answer is short, invalid JSON.
        with pytest.raises(UserError, match=r"did not answer after 1 tries \(timed out after 0.5 s\)"):
            _score(HttpReward(f"http://127.0.0.1:{port}/", timeout_s=0.5, retries=0))
    finally:
        sock.close()


def test_retry_after_is_honoured(server, monkeypatch):
    waits = []
    monkeypatch.setattr(http_reward.time, "sleep", lambda s: waits.append(s))
    server.fail_first, server.fail_status = 1, 429
    real = server.httpd.RequestHandlerClass.send_response

    def with_retry_after(self, code, message=None):
        real(self, code, message)
        if code == 429:
            self.send_header("Retry-After", "2")

    monkeypatch.setattr(server.httpd.RequestHandlerClass, "send_response", with_retry_after)
    assert _score(HttpReward(server.url, timeout_s=5, retries=1)) == [2.0, 4.0]
    assert 2.0 in waits  # (server threads sleep through the same time module: their waits are recorded too)


def test_tls_errors_are_named_and_not_retried(server):
    url = server.url.replace("http://", "https://")  # a plain-HTTP server: the TLS handshake fails
    with pytest.raises(UserError, match=r"TLS error \(SSL"):
        _score(HttpReward(url, timeout_s=2, retries=3))
    assert server.requests == []

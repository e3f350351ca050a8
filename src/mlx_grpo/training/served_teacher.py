"""On-policy distillation's teacher behind an OpenAI-compatible completions endpoint (teacher_url): the served
counterpart of policy.logprob_pass over a local teacher, giving the same [N, T] log-probs of each row's
sampled completion tokens.

Each row is one request: its prompt + completion token ids (what the student's log-prob pass feeds, up to the
row's last completion token, fed context included) as the prompt, scored without generating:

    POST teacher_url  {"prompt": [ids...], "echo": true, "max_tokens": 1, "logprobs": 1, "temperature": 1.0,
                       "model": <the first id GET .../models lists, when the server has that endpoint>}

Two answer shapes are read, whichever the server sends (vLLM sends both; the first is used then):
- vLLM's extension: choices[0].prompt_logprobs = [null, {"<token id>": {"logprob": x, ...}, ...}, ...], one
  entry per prompt token, each holding (at least) the prompt token's own log-prob under its id;
- the classic completions API: choices[0].logprobs.token_logprobs = [null, x, ...], aligned with the echoed
  prompt tokens (then the one generated token, ignored).
Entry i is log p(ids[i] | ids[:i]), so completion column t of a row with a P-token prompt is entry P + t,
exactly the logit position models/forward.pack gives the local pass. Columns the row's mask leaves out
(padding, tool and environment text inside a multi-turn completion) are 0, as logprob_pass's are.
Served log-probs are of the untempered distribution: config validation allows teacher_url only at
temperature = 1.

With distill_topk = k the request also asks for each position's k most likely tokens ("logprobs": k,
"prompt_logprobs": k, "return_tokens_as_token_ids": true), read from either shape: vLLM's prompt_logprobs dicts
(the top k plus the prompt token, keyed by id), or the classic choices[0].logprobs.top_logprobs dicts keyed
"token_id:<id>". The k highest log-probs of each entry, descending, are the same ids and log-probs
forward.completion_topk gives a local teacher. The server must allow k (vLLM: --max-logprobs, default 20).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import mlx.core as mx
import numpy as np

from mlx_grpo.base.errors import UserError
from mlx_grpo.rewards.http import HttpRefused, check_reward_url, request_json
from mlx_grpo.rollout.rollout_records import Rollout

SERVER = "teacher server"
# Requests in flight at once: vLLM batches concurrent requests itself (and caches the group's shared prompt),
# so more than this only queues on the server's side.
MAX_IN_FLIGHT = 16
# Statuses meaning "this server has no such endpoint" (or takes another body there): /tokenize and /models
# are optional, a server without them is still a teacher.
MISSING = frozenset({400, 404, 405, 422, 501})


class ServedTeacher:
    """The teacher as a client of teacher_url. Constructing it checks the URL's host (loopback unless
    allowed) and asks the server which model it serves; a server that is down stops here, in one line."""

    def __init__(self, url: str, timeout_s: float, retries: int, allowed_hosts: Sequence[str] = ()):
        check_reward_url(url, allowed_hosts, setting="teacher_url")
        self.url, self.timeout_s, self.retries = url, timeout_s, retries
        self.model = self._served_model()

    def _sibling(self, path: str) -> str:
        """This server's URL for `path` (absolute, e.g. "/tokenize")."""
        parts = urlsplit(self.url)
        return urlunsplit((parts.scheme, parts.netloc, path, "", ""))

    def _served_model(self) -> str | None:
        """The model name requests carry: the first one GET .../models lists next to .../completions (older
        vLLM refuses a request without one); None when the URL has no such sibling or the server no list."""
        path = urlsplit(self.url).path.rstrip("/")
        if not path.endswith("/completions"):
            return None
        answer = self._optional(self._sibling(path[:-len("completions")] + "models"), None, "the model list request")
        data = answer.get("data") if isinstance(answer, dict) else None
        first = data[0] if isinstance(data, list) and data and isinstance(data[0], dict) else {}
        return first.get("id") if isinstance(first.get("id"), str) else None

    def _optional(self, url: str, body: bytes | None, what: str):
        """request_json's answer, or None where the server has no such endpoint (an optional one)."""
        try:
            return request_json(url, body, self.timeout_s, self.retries, SERVER, what)
        except HttpRefused as e:
            if e.status in MISSING:
                return None
            raise

    def tokenize(self, text: str) -> list[int] | None:
        """The server's token ids of `text` through vLLM's POST /tokenize {"prompt": text} -> {"tokens": [...]};
        None when the server offers no such endpoint (the tokenizer cannot be checked then)."""
        body = {"prompt": text, **({"model": self.model} if self.model else {})}
        answer = self._optional(self._sibling("/tokenize"), json.dumps(body).encode(), "the tokenize request")
        tokens = answer.get("tokens") if isinstance(answer, dict) else None
        if not tokens or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            return None  # another server's endpoint of that name, answering something else
        return tokens

    def score(self, ids: list[int]) -> list[float]:
        """log p(ids[i] | ids[:i]) for i >= 1: entry i - 1 scores token i (nothing precedes the first)."""
        return read_logprobs(self._echo(ids, logprobs=1), ids, self.url)

    def _echo(self, ids: list[int], **asked) -> Any:
        """The server's answer to a completions request that echoes ids with the log-probs `asked` for."""
        body = {"prompt": ids, "echo": True, "max_tokens": 1, **asked, "temperature": 1.0,
                **({"model": self.model} if self.model else {})}
        return request_json(self.url, json.dumps(body).encode(), self.timeout_s, self.retries, SERVER, "the request")

    def score_topk(self, ids: list[int], k: int,
                   tokens: int | None = None) -> tuple[list[float], np.ndarray, np.ndarray]:
        """score's log-probs, and for i >= 1 the k most likely tokens at position i: ids [n - 1, k] and their
        log-probs [n - 1, k], descending (read_topk)."""
        answer = self._echo(ids, logprobs=k, prompt_logprobs=k, return_tokens_as_token_ids=True)
        return (read_logprobs(answer, ids, self.url), *read_topk(answer, ids, k, self.url, tokens))

    def logprobs(self, rollout: Rollout) -> mx.array:
        """Log-probs [N, T] (float32) of each row's sampled completion tokens, 0 where the mask is 0."""
        return self.scores(rollout, 0)[0]

    def scores(self, rollout: Rollout, k: int,
               tokens: int | None = None) -> tuple[mx.array, mx.array | None, mx.array | None]:
        """logprobs, and with k > 0 each completion position's top-k ids [N, T, k] (int32) and log-probs
        [N, T, k] (float32, descending), 0 where the mask is 0 (as policy.topk_pass's); None, None with k = 0."""
        N, T = rollout.completion_ids.shape
        prompts, ids, mask = rollout.row_prompts, rollout.completion_ids.tolist(), np.array(rollout.mask)
        extents = [int(e) for e in rollout.extents]
        rows = [r for r in range(N) if extents[r] > 0]
        score = (lambda x: (self.score(x), None, None)) if k == 0 else (lambda x: self.score_topk(x, k, tokens))
        pool = ThreadPoolExecutor(min(MAX_IN_FLIGHT, max(1, len(rows))))
        try:
            scored = list(pool.map(lambda r: score(prompts[r] + ids[r][:extents[r]]), rows))
        finally:
            pool.shutdown(wait=True, cancel_futures=True)  # one row's error: the rows not started never start
        out = np.zeros((N, T), dtype=np.float32)
        top_ids, top_lps = np.zeros((N, T, max(k, 1)), np.int32), np.zeros((N, T, max(k, 1)), np.float32)
        for r, (values, row_ids, row_lps) in zip(rows, scored):
            start, end = len(prompts[r]) - 1, extents[r]  # column t is token P + t, scored by entry P + t - 1
            kept = mask[r, :end] > 0
            out[r, :end][kept] = np.array(values[start:start + end], dtype=np.float32)[kept]
            if k:
                top_ids[r, :end][kept] = row_ids[start:start + end][kept]
                top_lps[r, :end][kept] = row_lps[start:start + end][kept]
        return mx.array(out), *((mx.array(top_ids), mx.array(top_lps)) if k else (None, None))


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def read_logprobs(answer: Any, ids: list[int], url: str) -> list[float]:
    """The log-probs of ids[1:] (each given the tokens before it) from a completions answer of either shape
    (the module's docstring); a malformed answer is one UserError line saying what is wrong."""
    def bad(why: str) -> UserError:
        return UserError(f"{SERVER} {url} answered without the prompt's log-probs ({why}): teacher_url must be "
                         f"an OpenAI-compatible completions endpoint that echoes them (vLLM: .../v1/completions); "
                         f"the answer began {json.dumps(answer)[:160]}")

    choices = answer.get("choices") if isinstance(answer, dict) else None
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise bad("no choices")
    choice, n = choices[0], len(ids)
    entries = choice.get("prompt_logprobs")
    if isinstance(entries, list):  # vLLM: one {token id: {"logprob": x, ...}} dict per prompt token
        if len(entries) < n:
            raise bad(f"{len(entries)} prompt_logprobs entries for {n} prompt tokens")
        values = []
        for i in range(1, n):
            item = entries[i].get(str(ids[i])) if isinstance(entries[i], dict) else None
            values.append(item.get("logprob") if isinstance(item, dict) else None)
            if not _number(values[-1]):
                raise bad(f"prompt_logprobs entry {i} has no log-prob for its token {ids[i]}")
        return [float(v) for v in values]
    logprobs = choice.get("logprobs")
    values = logprobs.get("token_logprobs") if isinstance(logprobs, dict) else None
    if not isinstance(values, list):
        raise bad("neither choices[0].prompt_logprobs nor choices[0].logprobs.token_logprobs")
    if len(values) < n:
        raise bad(f"{len(values)} token_logprobs for {n} prompt tokens: is echo supported?")
    values = values[1:n]  # the first token has none (null); the generated token's comes after the prompt's
    if not all(_number(v) for v in values):
        raise bad("token_logprobs holds something other than numbers after the first")
    return [float(v) for v in values]


def read_topk(answer: Any, ids: list[int], k: int, url: str,
              tokens: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The k most likely tokens at each position i >= 1 of ids (each given the tokens before it) from a
    completions answer: ids [n - 1, k] and log-probs [n - 1, k], descending (ties by id); from vLLM's
    prompt_logprobs dicts, else the classic top_logprobs dicts keyed "token_id:<id>". A malformed answer, or one
    with fewer than k tokens at a position, is one UserError line."""
    def bad(why: str) -> UserError:
        return UserError(f"{SERVER} {url} answered without the prompt's top {k} log-probs ({why}): distill_topk "
                         f"needs a server that returns them by token id (vLLM's prompt_logprobs, or top_logprobs "
                         f"with return_tokens_as_token_ids; vLLM's --max-logprobs >= {k})")

    choice = answer["choices"][0]  # read_logprobs has checked the shape
    n, entries = len(ids), choice.get("prompt_logprobs")
    if not isinstance(entries, list):
        logprobs = choice.get("logprobs")
        entries = logprobs.get("top_logprobs") if isinstance(logprobs, dict) else None
        if not isinstance(entries, list) or len(entries) < n:
            raise bad("neither choices[0].prompt_logprobs nor choices[0].logprobs.top_logprobs for every token")
    out_ids, out_lps = np.zeros((n - 1, k), np.int32), np.zeros((n - 1, k), np.float32)
    for i in range(1, n):
        entry = entries[i] if isinstance(entries[i], dict) else {}
        pairs = []
        for key, value in entry.items():
            token = key[len("token_id:"):] if key.startswith("token_id:") else key
            lp = value.get("logprob") if isinstance(value, dict) else value
            if not token.isdecimal() or not _number(lp):
                raise bad(f"entry {i} holds {key!r}: {json.dumps(value)[:60]}, not a token id and its log-prob")
            if int(token) >= (tokens or 2 ** 31 - 1):  # a gather past the student's head reads garbage, not fails
                raise bad(f"entry {i} holds token id {token}, past the student tokenizer's {tokens} tokens")
            pairs.append((-float(lp), int(token)))
        if len(pairs) < k:
            raise bad(f"entry {i} holds {len(pairs)} tokens")
        best = sorted(pairs)[:k]
        out_ids[i - 1] = [t for _, t in best]
        out_lps[i - 1] = [-v for v, _ in best]
    return out_ids, out_lps

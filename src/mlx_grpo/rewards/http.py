"""A reward computed by an HTTP server: POST the batch as JSON, read one score per completion.

The request body is ``{"prompts": [...], "completions": [...], <every data column>: [...]}`` and the
answer must be ``{"rewards": [float | null, ...]}`` with one entry per completion. Only loopback hosts
are reached unless the config names the host in ``reward_url_allowed_hosts``: completions never leave
the machine by accident. Slow or failing servers are retried with exponential back-off; a server that
stays down stops the run with one line saying where and why. `request_json` and `check_reward_url` are
also the served teacher's client (training/served_teacher.py, teacher_url): one retry and host policy.
"""

from __future__ import annotations

import http.client
import ipaddress
import json
import ssl
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

from mlx_grpo.base.errors import UserError

LOOPBACK_NAMES = frozenset({"localhost"})
# Seconds before the first retry; each further retry waits twice as long.
BACKOFF_S = 0.5
# Largest answer read (a reward list for a few thousand completions is far smaller).
MAX_ANSWER_BYTES = 64 * 2 ** 20
# HTTP statuses worth retrying: the server is overloaded or restarting.
RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})
# Longest Retry-After honoured (seconds): a server asking for more is treated as down for now.
MAX_RETRY_AFTER_S = 60.0
READ_CHUNK = 2 ** 16


def _read_by(response, deadline: float) -> bytes:
    """The answer body, read chunk by chunk until `deadline` (time.monotonic): a server that trickles
    bytes resets the socket timeout with each one, so the socket timeout alone never ends the request."""
    parts, size = [], 0
    while True:
        if time.monotonic() > deadline:
            raise TimeoutError("the answer did not arrive in time")
        chunk = response.read1(READ_CHUNK)
        if not chunk:
            return b"".join(parts)
        parts.append(chunk)
        size += len(chunk)
        if size > MAX_ANSWER_BYTES:
            return b"".join(parts)


def _retry_after(error: urllib.error.HTTPError) -> float:
    """Seconds the server asked to wait (Retry-After in seconds), 0 when it did not say."""
    try:
        return max(0.0, float(error.headers.get("Retry-After", "")))
    except (TypeError, ValueError):
        return 0.0


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    """A redirect could send the completions to another host: refuse it."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        raise UserError(f"server {req.full_url} redirected to {newurl}; set the endpoint's own URL (redirects "
                        "are not followed)")


# No proxies (an http_proxy variable would carry loopback traffic off the machine) and no redirects.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}), _NoRedirects())


def _is_loopback(host: str) -> bool:
    if host.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_reward_url(url: str, allowed_hosts: Sequence[str], setting: str = "reward_url") -> None:
    """A well-formed http(s) URL whose host is loopback or explicitly allowed, else UserError naming
    `setting` (and its `<setting>_allowed_hosts`)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UserError(f"{setting} must be an http:// or https:// URL with a host, got {url!r}")
    host = parts.hostname
    if not _is_loopback(host) and host.lower() not in {h.lower() for h in allowed_hosts}:
        raise UserError(f"{setting} host {host!r} is not loopback: completions would leave this machine; "
                        f"add it to {setting}_allowed_hosts to allow it")


class HttpRefused(UserError):
    """The server answered with an HTTP error that retrying cannot fix; `status` says which (a caller probing
    an endpoint the server may not offer tells 404 from a real failure)."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


class HttpReward:
    """A reward function (TRL signature) backed by an HTTP endpoint."""

    def __init__(self, url: str, timeout_s: float, retries: int, allowed_hosts: Sequence[str] = ()):
        check_reward_url(url, allowed_hosts)
        self.url, self.timeout_s, self.retries = url, timeout_s, retries

    def __call__(self, prompts, completions, completion_ids, transcripts=None, **columns) -> list[Any]:
        extra = {} if transcripts is None else {  # multi-turn runs: each episode's turns with their origin
            "transcripts": [[{"origin": t.origin, "text": t.text} for t in tr.turns] for tr in transcripts]}
        body = json.dumps({"prompts": list(prompts), "completions": list(completions), **extra,
                           **{k: list(v) for k, v in columns.items()}}, default=str).encode()
        answer = request_json(self.url, body, self.timeout_s, self.retries)
        rewards = answer.get("rewards") if isinstance(answer, dict) else None
        if not isinstance(rewards, list):
            raise UserError(f"reward server {self.url} answered without a 'rewards' list: {str(answer)[:200]}")
        return rewards  # RewardSet checks the count and the values


def request_json(url: str, body: bytes | None, timeout_s: float, retries: int, server: str = "reward server",
                 what: str = "the batch") -> Any:
    """POST the JSON `body` (GET when None) and return the parsed answer, retrying up to `retries` times;
    each try has a total deadline of timeout_s seconds, however the server sends its bytes; 429/503 answers'
    Retry-After is honoured (up to MAX_RETRY_AFTER_S). Failures are one UserError line naming `server`."""
    last, wait = "", 0.0
    for attempt in range(retries + 1):
        if attempt:
            time.sleep(max(BACKOFF_S * 2 ** (attempt - 1), wait))
        wait = 0.0
        request = urllib.request.Request(url, data=body, method="GET" if body is None else "POST",
                                         headers={"Content-Type": "application/json"})
        try:
            deadline = time.monotonic() + timeout_s
            with _OPENER.open(request, timeout=timeout_s) as response:
                text = _read_by(response, deadline)
        except urllib.error.HTTPError as e:
            detail = e.read(500).decode(errors="replace").strip()
            last = f"HTTP {e.code} {e.reason}" + (f": {detail}" if detail else "")
            if e.code not in RETRY_STATUSES:  # the request itself is wrong: retrying will not help
                raise HttpRefused(f"{server} {url} refused {what} ({last})", e.code) from None
            wait = _retry_after(e)
            if wait > MAX_RETRY_AFTER_S:
                raise UserError(f"{server} {url} asked to retry after {wait:g} s ({last}); more "
                                f"than {MAX_RETRY_AFTER_S:g} s: stopping") from None
            continue
        except (urllib.error.URLError, TimeoutError, ConnectionError, http.client.HTTPException,
                ssl.SSLError) as e:
            reason = getattr(e, "reason", e)
            if isinstance(reason, ssl.SSLError):  # retrying cannot fix a certificate or protocol problem
                raise UserError(f"{server} {url}: TLS error ({type(reason).__name__}: "
                                f"{getattr(reason, 'reason', None) or reason})") from None
            last = f"timed out after {timeout_s:g} s" if isinstance(reason, TimeoutError) \
                or "timed out" in str(reason) else f"{type(reason).__name__}: {reason}"
            continue
        if len(text) > MAX_ANSWER_BYTES:
            raise UserError(f"{server} {url} answered with more than {MAX_ANSWER_BYTES} bytes")
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            raise UserError(f"{server} {url} answered with invalid JSON: {text[:200]!r}") from None
    raise UserError(f"{server} {url} did not answer after {attempt + 1} tries ({last}); is it running?")

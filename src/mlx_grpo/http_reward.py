"""A reward computed by an HTTP server: POST the batch as JSON, read one score per completion.

The request body is ``{"prompts": [...], "completions": [...], <every data column>: [...]}`` and the
answer must be ``{"rewards": [float | null, ...]}`` with one entry per completion. Only loopback hosts
are reached unless the config names the host in ``reward_url_allowed_hosts``: completions never leave
the machine by accident. Slow or failing servers are retried with exponential back-off; a server that
stays down stops the run with one line saying where and why.
"""

from __future__ import annotations

import ipaddress
import json
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

from mlx_grpo.errors import UserError

LOOPBACK_NAMES = frozenset({"localhost"})
# Seconds before the first retry; each further retry waits twice as long.
BACKOFF_S = 0.5


def _is_loopback(host: str) -> bool:
    if host.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_reward_url(url: str, allowed_hosts: Sequence[str]) -> None:
    """A well-formed http(s) URL whose host is loopback or explicitly allowed, else UserError."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UserError(f"reward_url must be an http:// or https:// URL with a host, got {url!r}")
    host = parts.hostname
    if not _is_loopback(host) and host.lower() not in {h.lower() for h in allowed_hosts}:
        raise UserError(f"reward_url host {host!r} is not loopback: completions would leave this machine; "
                        f"add it to reward_url_allowed_hosts to allow it")


class HttpReward:
    """A reward function (TRL signature) backed by an HTTP endpoint."""

    def __init__(self, url: str, timeout_s: float, retries: int, allowed_hosts: Sequence[str] = ()):
        check_reward_url(url, allowed_hosts)
        self.url, self.timeout_s, self.retries = url, timeout_s, retries

    def __call__(self, prompts, completions, completion_ids, **columns) -> list[Any]:
        body = json.dumps({"prompts": list(prompts), "completions": list(completions),
                           **{k: list(v) for k, v in columns.items()}}, default=str).encode()
        answer = self._post(body)
        rewards = answer.get("rewards") if isinstance(answer, dict) else None
        if not isinstance(rewards, list):
            raise UserError(f"reward server {self.url} answered without a 'rewards' list: {str(answer)[:200]}")
        return rewards  # RewardSet checks the count and the values

    def _post(self, body: bytes) -> Any:
        last = ""
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(BACKOFF_S * 2 ** (attempt - 1))
            request = urllib.request.Request(self.url, data=body, method="POST",
                                             headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                    text = response.read()
            except urllib.error.HTTPError as e:
                last = f"HTTP {e.code} {e.reason}"
                if e.code < 500:  # the request itself is wrong: retrying will not help
                    break
                continue
            except (urllib.error.URLError, TimeoutError, ConnectionError) as e:
                reason = getattr(e, "reason", e)
                last = f"timed out after {self.timeout_s:g} s" if isinstance(reason, TimeoutError) \
                    or "timed out" in str(reason) else f"{type(reason).__name__}: {reason}"
                continue
            try:
                return json.loads(text)
            except json.JSONDecodeError:
                raise UserError(f"reward server {self.url} answered with invalid JSON: {text[:200]!r}") from None
        raise UserError(f"reward server {self.url} did not answer after {attempt + 1} tries ({last}); "
                        "is it running?")

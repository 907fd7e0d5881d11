"""What every engine behind an inference server shares (SGLang, vLLM): JSON over HTTP with one-line
errors naming the server, trajectories pinned to one server each, and many turns in flight at once.

Turns are blocking HTTP calls on a bounded thread pool: the server batches whatever is in flight
continuously, so the client needs no event loop of its own, and `rollout_gen/scheduler.py` drives
it like any continuously batching engine (add / step / busy / release).
"""

from __future__ import annotations

import concurrent.futures as cf
import http.client
import json
import threading
import urllib.error
import urllib.request
from typing import Any, Callable, Hashable

from pipeline.engines.base import Generation, Request
from storage.errors import CleanerError


class ServerUnavailable(CleanerError, RuntimeError):
    """No server answers at a configured URL."""


class ServerRefused(CleanerError, RuntimeError):
    """A server answered a request with an error status."""


def http_json(
    url: str,
    route: str,
    payload: Any = None,
    method: str = "POST",
    timeout: float = 600.0,
    *,
    name: str = "server",
    hint: str = "",
    unavailable: type[ServerUnavailable] | type[RuntimeError] = ServerUnavailable,
) -> Any:
    """`payload` as JSON to url+route; the parsed answer (None when empty). An error status raises
    ServerRefused with the server's own message, no answer at all raises `unavailable`."""
    data = None if payload is None else json.dumps(payload).encode()
    req = urllib.request.Request(url + route, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            body = resp.read()
    except urllib.error.HTTPError as e:
        raise ServerRefused(f"{name} {route} at {url} answered {e.code}: {_message(e.read())}") from None
    except (urllib.error.URLError, OSError, http.client.HTTPException) as e:  # refused, reset, cut mid-answer
        reason = getattr(e, "reason", None) or str(e) or type(e).__name__
        raise unavailable(f"{name} server at {url} is unreachable ({reason})" + (f"; {hint}" if hint else "")) from None
    return json.loads(body) if body.strip() else None


def _message(body: bytes) -> str:
    """The error text of an error answer: OpenAI-style {"error": {"message"}} or FastAPI's {"detail"}."""
    try:
        parsed = json.loads(body)
    except ValueError:
        return body[:300].decode(errors="replace")
    if isinstance(parsed, dict):
        err = parsed.get("error", parsed.get("detail", parsed))
        if isinstance(err, dict):
            err = err.get("message", err)
        return str(err)[:300].replace("\n", " ")
    return str(parsed)[:300]


class StickyRouter:
    """Which server holds each trajectory's prefix. A key's first request goes to the live server with the
    fewest live keys (ties: the lowest index), every later one to the same server until `release(key)`: a
    trajectory's turns extend each other, so only the server that served its last turn has its prefix cached
    (sglang-router's cache_aware policy keeps the same affinity, by prefix match instead of by key)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self._of: dict[Hashable, int] = {}
        self._keys = [0] * n
        self._down: set[int] = set()
        self.requests = [0] * n  # requests sent to each server, for reports and tests
        self._lock = threading.Lock()

    def pick(self, key: Hashable) -> int:
        with self._lock:
            idx = self._of.get(key)
            if idx is None or idx in self._down:
                live = [i for i in range(self.n) if i not in self._down]
                if not live:
                    raise ServerUnavailable("every server is down")
                if idx is not None:
                    self._keys[idx] -= 1
                idx = min(live, key=lambda i: (self._keys[i], i))
                self._of[key] = idx
                self._keys[idx] += 1
            self.requests[idx] += 1
            return idx

    def release(self, key: Hashable) -> None:
        with self._lock:
            idx = self._of.pop(key, None)
            if idx is not None:
                self._keys[idx] -= 1

    def mark_down(self, idx: int) -> bool:
        """Server `idx` stopped answering; True while another one is left to take its trajectories."""
        with self._lock:
            self._down.add(idx)
            return len(self._down) < self.n


class ConcurrentTurns:
    """The continuous-batching side of the engine protocol for a server client: every request is its own
    call on a thread, at most `max_in_flight` at once. `wait_all` (the deterministic schedule): a step is the
    whole set in flight; otherwise whatever is back within 20 ms. Subclasses implement `_turn(request)`."""

    def _init_turns(self, max_in_flight: int, wait_all: bool) -> None:
        self.wait_all = wait_all
        self.pool = cf.ThreadPoolExecutor(max_workers=max_in_flight, thread_name_prefix="server-turn")
        self.flying: dict[cf.Future, Request] = {}

    def _turn(self, request: Request) -> Generation:
        raise NotImplementedError

    def add(self, requests: list[Request]) -> None:
        for r in requests:
            self.flying[self.pool.submit(self._turn, r)] = r

    def busy(self) -> bool:
        return bool(self.flying)

    def step(self) -> list[tuple[Request, Generation]]:
        done, _ = cf.wait(
            self.flying,
            timeout=None if self.wait_all else 0.02,
            return_when=cf.ALL_COMPLETED if self.wait_all else cf.FIRST_COMPLETED,
        )
        order = [f for f in self.flying if f in done]  # submission order
        return [(self.flying.pop(f), f.result()) for f in order]

    def map(self, fn: Callable[..., Any], *rows: list) -> list:
        """fn over rows concurrently on the same pool (batch calls: lockstep loop, scoring)."""
        return list(self.pool.map(fn, *rows))

    def _close_turns(self) -> None:
        for f in self.flying:
            f.cancel()
        self.flying.clear()
        self.pool.shutdown(wait=False, cancel_futures=True)

"""Runs one coroutine per trajectory against a continuously batching engine and the sandbox pool.

Each trajectory awaits `generate(request)` and `tool(fn)` as it needs them; nothing waits for the
rest of a batch. The scheduler owns every future the coroutines wait on, so it knows when all of
them are blocked ("settled") and only then moves the engine one step: between steps, requests join
and finished ones leave, and tool calls run in threads meanwhile.

Two schedules:
- deterministic (default): a tool result rejoins exactly `tool_delay_steps` engine steps after its
  call was made (the scheduler waits for it if it is late), and requests join in trajectory order.
  Which rows share a batch at every step is then a function of the trajectories alone, so a rerun
  gives bit-identical log-probs and samples, whatever the tool latency or machine load.
- free: a result rejoins at the first step after it arrives. Faster when tools are slow or uneven,
  but the batch composition depends on timing, and so the floating-point results, slightly
  (benchmarks/RESULTS.md, section `async rollout`, measures how much).

Retries to score (live importance-ratio rollbacks) wait until a trajectory needs its score: a rollback's
decision only has to be made before its retry's tool result is handled, so the trajectory asks for the
score, runs the retry's call and awaits the score after it. When one is awaited, the engine scores every
rollback asked by then in one batched forward (`score_turns`, where it has one): the rollbacks of several
steps share a forward, and no step or tool call moves from where it would be with scorings made one by one.

Tool calls run on at most `tool_slots` threads (one per sandbox worker); the rest wait here. The
deterministic schedule starts them in call order (the order in which they fall due). The free one
can start first the calls of the trajectories that have made the most calls (`most_calls`): a
rollout ends when its longest chain of turns does, and in a first-come queue that chain's k-th call
waits behind everyone's first.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import heapq
import threading
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Hashable, Literal

from pipeline.engines.base import Generation, Request, ScoreRequest


class BatchStepper:
    """An engine with only `generate` (test doubles): each step samples every queued request at once."""

    def __init__(self, engine) -> None:
        self.engine, self.queue = engine, []

    def add(self, requests: list[Request]) -> None:
        self.queue += requests

    def busy(self) -> bool:
        return bool(self.queue)

    def release(self, key: Hashable) -> None:
        pass

    def step(self) -> list[tuple[Request, Generation]]:
        out: list[tuple[Request, Generation]] = []
        groups: dict[Any, list[Request]] = {}
        for r in self.queue:
            groups.setdefault(r.params, []).append(r)
        self.queue = []
        for params, reqs in groups.items():
            gens = self.engine.generate(
                [list(r.context) for r in reqs],
                params,
                [r.seed for r in reqs],
                shared_prefix=[r.shared_prefix for r in reqs],
            )
            out += zip(reqs, gens)
        return out


class ConcurrentStepper:
    """A server engine (SGLang): every request is its own concurrent call, at most `limit` in flight,
    so the server's continuous batching and radix cache do the work."""

    def __init__(self, engine, limit: int, wait_all: bool) -> None:
        self.engine, self.wait_all = engine, wait_all
        self.pool = cf.ThreadPoolExecutor(max_workers=limit, thread_name_prefix="engine")
        self.flying: dict[cf.Future, Request] = {}

    def add(self, requests: list[Request]) -> None:
        for r in requests:
            fut = self.pool.submit(self.engine.generate, [list(r.context)], r.params, [r.seed], [r.shared_prefix])
            self.flying[fut] = r

    def busy(self) -> bool:
        return bool(self.flying)

    def release(self, key: Hashable) -> None:
        pass

    def step(self) -> list[tuple[Request, Generation]]:
        # Deterministic: a step is the whole set in flight. Free: whatever is back within 20 ms
        # (the scheduler then looks at tool results again).
        done, _ = cf.wait(
            self.flying,
            timeout=None if self.wait_all else 0.02,
            return_when=cf.ALL_COMPLETED if self.wait_all else cf.FIRST_COMPLETED,
        )
        order = [f for f in self.flying if f in done]  # submission order
        return [(self.flying.pop(f), f.result()[0]) for f in order]

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


@dataclass
class _ToolCall:
    due: int  # engine step at which the deterministic schedule delivers it
    rank: tuple[int, ...]  # start order while every tool slot is taken: lowest first
    call: tuple  # the function and its arguments
    waiter: asyncio.Future
    future: cf.Future | None = None  # once started

    def running(self) -> bool:
        return self.future is not None and not self.future.done()

    def ended(self) -> bool:
        return self.future is not None and self.future.done()


@dataclass
class Progress:
    finished: int = 0
    active: int = 0
    tools_in_flight: int = 0  # running in the sandbox
    tools_queued: int = 0  # waiting for a sandbox worker
    generated_tokens: int = 0  # by finished turns
    tokens_in_flight: int | None = None  # sampled by turns still generating (None: the engine does not say)
    steps: int = 0


class Scheduler:
    def __init__(
        self,
        engine,
        deterministic: bool = True,
        tool_delay_steps: int = 4,
        max_in_flight: int = 64,
        tool_slots: int = 64,
        tool_priority: Literal["most_calls", "fifo"] = "most_calls",
        on_progress: Callable[[Progress, float], None] | None = None,
    ) -> None:
        self.scorer = engine
        if hasattr(engine, "step"):
            self.engine = engine
        elif getattr(engine, "concurrent_requests", False):
            self.engine = ConcurrentStepper(engine, max_in_flight, wait_all=deterministic)
        else:
            self.engine = BatchStepper(engine)
        self.deterministic, self.delay = deterministic, tool_delay_steps
        self.tools = cf.ThreadPoolExecutor(max_workers=tool_slots, thread_name_prefix="tool")
        self.slots = tool_slots
        self.most_calls_first = tool_priority == "most_calls" and not deterministic
        self.on_progress = on_progress
        self.progress = Progress()
        self._asked: list[tuple[int, Request, asyncio.Future]] = []
        self._scorings: list[tuple[int, ScoreRequest, asyncio.Future]] = []  # asked, not yet scored
        self._awaited: set[asyncio.Future] = set()  # of those, the ones a trajectory is blocked on
        self._waiting: dict[Hashable, asyncio.Future] = {}
        self._calls: list[_ToolCall] = []  # made, not yet delivered, in call order
        self._queued: list[tuple[tuple[int, ...], _ToolCall]] = []  # heap of calls not started
        self._calls_made: dict[int, int] = {}  # per trajectory
        self._seq = 0  # calls made, all trajectories
        self._active = 0  # calls started and not ended
        self._slot_lock = threading.RLock()
        self._running = 0
        self._settled: asyncio.Event | None = None

    # ---- what a trajectory's coroutine awaits --------------------------------------------------
    async def generate(self, order: int, request: Request) -> Generation:
        fut = asyncio.get_running_loop().create_future()
        self._asked.append((order, request, fut))
        return await self._block(fut)

    def ask_score(self, order: int, request: ScoreRequest) -> asyncio.Future:
        """log π of each token of `request.turn` after its context, for trajectory `order`, when `scored` awaits it."""
        fut = asyncio.get_running_loop().create_future()
        self._scorings.append((order, request, fut))
        return fut

    async def scored(self, fut: asyncio.Future) -> list[float]:
        if not fut.done():
            self._awaited.add(fut)
            return await self._block(fut)
        return fut.result()

    async def tool(self, order: int, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)` on a tool thread, for trajectory `order`."""
        fut = asyncio.get_running_loop().create_future()
        made = self._calls_made.get(order, 0)
        self._calls_made[order] = made + 1
        self._seq += 1
        rank = (-made, self._seq) if self.most_calls_first else (self._seq,)
        call = _ToolCall(self.progress.steps + self.delay, rank, (fn, *args), fut)
        self._calls.append(call)
        with self._slot_lock:
            heapq.heappush(self._queued, (rank, call))
        self._start_tools()
        return await self._block(fut)

    def _start_tools(self) -> None:
        # Also called from a tool thread the moment its call ends, so a freed sandbox worker gets the
        # next call at once, not after the engine step under way (fast calls would leave it idle).
        with self._slot_lock:
            while self._active < self.slots and self._queued:
                _, c = heapq.heappop(self._queued)
                self._active += 1
                c.future = self.tools.submit(*c.call)
                c.future.add_done_callback(self._tool_ended)

    def _tool_ended(self, _: cf.Future) -> None:
        with self._slot_lock:
            self._active -= 1
        try:
            self._start_tools()
        except RuntimeError as e:  # the pool was shut down under it (Ctrl-C, a failure elsewhere): nothing to start
            if "shutdown" not in str(e):
                raise

    def _wait_for_a_tool(self) -> None:
        """Block until a running call ends (its thread starts the next queued one)."""
        cf.wait([c.future for c in self._calls if c.running()], return_when=cf.FIRST_COMPLETED)

    def release(self, key: Hashable) -> None:
        self._scorings = [a for a in self._scorings if a[1].key != key]  # its trajectory ended: nothing to decide
        self.engine.release(key)

    async def _block(self, fut: asyncio.Future) -> Any:
        self._running -= 1
        if self._running == 0:
            self._settled.set()
        return await fut

    def _wake(
        self, fut: asyncio.Future, value: Any = None, error: BaseException | None = None, blocked: bool = True
    ) -> None:
        """Resolve `fut`; the trajectory `blocked` on it runs again."""
        if blocked:
            self._running += 1
            self._settled.clear()
        fut.set_exception(error) if error is not None else fut.set_result(value)

    # ---- the loop ------------------------------------------------------------------------------
    def run(self, coroutines: list[Awaitable[None]]) -> None:
        try:
            asyncio.run(self._main(coroutines))
        finally:
            self.tools.shutdown(wait=True)
            if isinstance(self.engine, ConcurrentStepper):
                self.engine.close()

    async def _main(self, coroutines: list[Awaitable[None]]) -> None:
        self._settled = asyncio.Event()
        self._running = len(coroutines)
        self.progress.active = len(coroutines)
        tasks = [asyncio.ensure_future(self._trajectory(c)) for c in coroutines]
        t0 = time.monotonic()
        while True:
            if self._running:
                await self._settled.wait()
            if not self.progress.active:
                break
            if self._awaited:
                self._score()
                continue  # the trajectories that waited go on before anything else moves
            if self._deliver_tools():
                continue  # let the woken trajectories ask for their next turn before the step
            if self._asked:
                self._asked.sort(key=lambda a: a[0])  # trajectory order, not wake-up order
                self.engine.add([r for _, r, _ in self._asked])
                self._waiting.update((id(r), f) for _, r, f in self._asked)
                self._asked = []
            if self.engine.busy():
                for req, gen in self.engine.step():
                    self.progress.generated_tokens += len(gen.output_ids)
                    self._wake(self._waiting.pop(id(req)), gen)
                self.progress.steps += 1
            elif self._calls:  # everyone waits on tools: skip to the next result
                if self.deterministic:
                    self.progress.steps = min(c.due for c in self._calls)
                elif not any(c.ended() for c in self._calls):
                    self._wait_for_a_tool()
            self._report(t0)
        self._report(t0)  # the last trajectory has finished since the last report
        for t in tasks:
            t.result()  # a trajectory's own exception is not swallowed

    def _report(self, t0: float) -> None:
        if self.on_progress:
            self.progress.tools_in_flight = sum(c.running() for c in self._calls)
            self.progress.tools_queued = len(self._queued)
            in_flight = getattr(self.engine, "tokens_in_flight", None)
            self.progress.tokens_in_flight = in_flight() if in_flight is not None else None
            self.on_progress(self.progress, time.monotonic() - t0)

    def _score(self) -> None:
        asked = sorted(self._scorings, key=lambda a: a[0])  # trajectory order: the batch is the same every run
        self._scorings = []
        requests = [r for _, r, _ in asked]
        error = None
        try:
            if hasattr(self.scorer, "score_turns"):
                scores = self.scorer.score_turns(requests)
            else:
                scores = [self.scorer.score_turn(list(r.context), list(r.turn), r.temperature, r.key) for r in requests]
        except Exception as e:  # each trajectory that asked fails on its own
            scores, error = [None] * len(asked), e
        for (_, _, fut), got in zip(asked, scores):
            # a trajectory waiting for its score goes on; otherwise the score waits in its future
            blocked = fut in self._awaited
            self._awaited.discard(fut)
            self._wake(fut, got, error, blocked)

    def _deliver_tools(self) -> bool:
        if self.deterministic:
            ready = [c for c in self._calls if c.due <= self.progress.steps]
        else:
            ready = [c for c in self._calls if c.ended()]
        for c in ready:  # in call order; deterministic: waits for late ones
            while c.future is None:  # not even started: every slot holds an earlier call
                self._wait_for_a_tool()
            self._calls.remove(c)
            error = c.future.exception()
            self._wake(c.waiter, None if error else c.future.result(), error)
        return bool(ready)

    async def _trajectory(self, coroutine: Awaitable[None]) -> None:
        try:
            await coroutine
        finally:
            self.progress.active -= 1
            self.progress.finished += 1
            self._running -= 1
            if self._running == 0:
                self._settled.set()

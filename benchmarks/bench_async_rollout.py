"""The asynchronous agent loop vs the lockstep one: see `bench_rollout._async_rollout`."""

from benchmarks.bench_rollout import run_async as run  # noqa: F401

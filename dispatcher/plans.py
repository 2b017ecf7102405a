"""Redis work written once for both kinds of client (sans-I/O).

A *plan* is a generator that yields the round trips it needs (a `Round` of commands, or a
`Guarded` transaction) and is sent back their replies; it returns its answer. The plan holds the
rules; a driver does the I/O: `run` on a redis-py client, `run_async` on redis.asyncio, `run_on`
on either. So `Fleet` and `AsyncFleet`, `fleet batch` and the gateway's batch API, `fleet status`
and the gateway's dashboard share one implementation of each thing they read or write.

    def status_plan(job_id: str) -> Plan[str]:
        raw = yield from ask(cmd("hget", job_key(job_id), "status"))
        return as_str(raw) or "unknown"

    run(redis, status_plan(job_id))  /  await run_async(aredis, status_plan(job_id))

A command that fails, or is interrupted (Ctrl-C, a cancelled task), is raised inside the plan at
the `yield` that asked for it, so a plan handles errors as if it had made the call itself, and its
`finally`-like cleanup (a lock released) still runs.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from redis import Redis
from redis.asyncio import Redis as AsyncRedis
from redis.exceptions import WatchError

from backends.contract.replies import as_str

T = TypeVar("T")


@dataclass(frozen=True)
class Cmd:
    """One command, named by the redis-py method both clients have ("hget", "zrevrange", ...)."""

    name: str
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Eval:
    """One run of a Lua script (sent as EVALSHA, loaded when the server lacks it)."""

    source: str
    keys: Sequence[Any]
    args: Sequence[Any]


Call = Cmd | Eval


@dataclass(frozen=True)
class Round:
    """Commands sent together (pipelined; inside MULTI/EXEC with `transaction`). Reply: their
    replies in order."""

    calls: Sequence[Call]
    transaction: bool = False


@dataclass(frozen=True)
class Guarded:
    """MULTI/EXEC of `calls`, only while field `field` of hash `key` reads `value`. The field is
    read under WATCH: a write to `key` between that read and EXEC makes the driver read it again.
    Reply: the EXEC replies, or None when the field held something else."""

    key: str
    field: str
    value: str
    calls: Sequence[Call]


Step = Round | Guarded
Plan = Generator[Step, Any, T]
Client = Redis | AsyncRedis
ClientSource = Client | Callable[[], Client]  # a callable for a client that exists only later


def cmd(name: str, *args: Any, **kwargs: Any) -> Cmd:
    return Cmd(name, args, kwargs)


def ask(call: Call) -> Plan[Any]:
    """One command's reply (`reply = yield from ask(cmd(...))`)."""
    replies = yield Round((call,))
    return replies[0]


def gather(calls: Sequence[Call]) -> Plan[list[Any]]:
    """The replies of `calls`, pipelined in one round trip (none for no calls)."""
    if not calls:
        return []
    replies: list[Any] = yield Round(calls)
    return replies


# -- the drivers ------------------------------------------------------------------------------------


def run(redis: Redis, plan: Plan[T]) -> T:
    """Carry the plan out on a redis-py client."""
    done, value = _step(plan, None, None)
    while not done:
        try:
            reply = _do(redis, value)
        except BaseException as e:  # raised inside the plan, where it asked
            done, value = _step(plan, None, e)
        else:
            done, value = _step(plan, reply, None)
    return value


async def run_async(redis: AsyncRedis, plan: Plan[T], *, offload: bool = False) -> T:
    """Carry the plan out on a redis.asyncio client. `offload` runs the plan's own steps (its work
    between round trips) in a thread, for plans that do much of it (a batch's thousands of jobs),
    so the event loop goes on serving while they build their next round."""

    async def step(reply: Any, error: BaseException | None) -> tuple[bool, Any]:
        if offload:
            return await asyncio.to_thread(_step, plan, reply, error)
        return _step(plan, reply, error)

    done, value = await step(None, None)
    while not done:
        try:
            reply = await _do_async(redis, value)
        except BaseException as e:
            done, value = await step(None, e)
        else:
            done, value = await step(reply, None)
    return value


async def run_on(source: ClientSource, plan: Plan[T], *, offload: bool = False) -> T:
    """Carry the plan out on whichever client `source` is (or returns): a sync client's round
    trips run in a thread, off the event loop."""
    client = source if isinstance(source, Redis | AsyncRedis) else source()
    if isinstance(client, AsyncRedis):
        return await run_async(client, plan, offload=offload)
    return await asyncio.to_thread(run, client, plan)


def _step(plan: Plan[T], reply: Any, error: BaseException | None) -> tuple[bool, Any]:
    """(done, the next step or the plan's answer). StopIteration stays in here: it may not cross
    a thread's future."""
    try:
        if error is not None:
            return False, plan.throw(error)
        return False, plan.send(reply)
    except StopIteration as stop:
        return True, stop.value


def _do(redis: Redis, step: Step) -> Any:
    if isinstance(step, Guarded):
        return _guarded(redis, step)
    if len(step.calls) == 1 and not step.transaction:
        return [_call(redis, redis, step.calls[0])]
    with redis.pipeline(transaction=step.transaction) as pipe:
        for call in step.calls:
            _call(redis, pipe, call)
        return pipe.execute()


def _call(redis: Redis, target: Any, call: Call) -> Any:
    if isinstance(call, Eval):
        return redis.register_script(call.source)(keys=call.keys, args=call.args, client=target)
    return getattr(target, call.name)(*call.args, **call.kwargs)


def _guarded(redis: Redis, step: Guarded) -> list[Any] | None:
    while True:
        with redis.pipeline(transaction=True) as pipe:
            try:
                pipe.watch(step.key)
                if as_str(pipe.hget(step.key, step.field)) != step.value:
                    return None
                pipe.multi()
                for call in step.calls:
                    _call(redis, pipe, call)
                return pipe.execute()
            except WatchError:
                continue


async def _do_async(redis: AsyncRedis, step: Step) -> Any:
    if isinstance(step, Guarded):
        return await _guarded_async(redis, step)
    if len(step.calls) == 1 and not step.transaction:
        return [await _call_async(redis, redis, step.calls[0])]
    async with redis.pipeline(transaction=step.transaction) as pipe:
        for call in step.calls:
            await _queue_async(redis, pipe, call)
        return await pipe.execute()


async def _call_async(redis: AsyncRedis, target: Any, call: Call) -> Any:
    if isinstance(call, Eval):
        return await redis.register_script(call.source)(keys=call.keys, args=call.args, client=target)
    return await getattr(target, call.name)(*call.args, **call.kwargs)


async def _queue_async(redis: AsyncRedis, pipe: Any, call: Call) -> None:
    """Queue `call` in a pipeline (its commands are buffered, not awaited one by one)."""
    if isinstance(call, Eval):
        await redis.register_script(call.source)(keys=call.keys, args=call.args, client=pipe)
    else:
        getattr(pipe, call.name)(*call.args, **call.kwargs)


async def _guarded_async(redis: AsyncRedis, step: Guarded) -> list[Any] | None:
    while True:
        async with redis.pipeline(transaction=True) as pipe:
            try:
                await pipe.watch(step.key)
                if as_str(await pipe.hget(step.key, step.field)) != step.value:
                    return None
                pipe.multi()
                for call in step.calls:
                    await _queue_async(redis, pipe, call)
                return await pipe.execute()
            except WatchError:
                continue

"""Both engines behind the OpenAI front end implement its EngineClient protocol, member by member.

`runtime_checkable` would only check that the names exist; this checks the
method signatures too (parameter names, kinds, which have defaults), so a
parameter added to one engine and not the other fails here, not in production.
"""

import inspect

import pytest

from pdserve.router.disagg import DisaggEngine, RouterGroup
from pdserve.router.registry import Registry
from pdserve.server.async_engine import AsyncEngine, RequestGroup
from pdserve.server.engine_client import EngineClient, RequestStream


def _members(proto) -> tuple[dict, set]:
    """The protocol's methods (name -> function) and its data members (plain attributes, properties)."""
    methods, data = {}, set(proto.__annotations__)
    for name, value in vars(proto).items():
        if isinstance(value, property):
            data.add(name)
        elif inspect.isfunction(value) and not name.startswith("_"):
            methods[name] = value
    return methods, data


def _shape(fn) -> list[tuple]:
    return [(p.name, p.kind, p.default is inspect.Parameter.empty) for p in inspect.signature(fn).parameters.values()]


def _check(proto, cls, instance=None) -> None:
    """cls has proto's methods with the same signatures; and `instance`, if given, its data members."""
    methods, data = _members(proto)
    for name, want in methods.items():
        got = getattr(cls, name, None)
        assert callable(got), f"{cls.__name__} lacks {name}()"
        assert _shape(got) == _shape(want), (
            f"{cls.__name__}.{name}{inspect.signature(got)} is not {inspect.signature(want)}"
        )
        assert inspect.iscoroutinefunction(got) == inspect.iscoroutinefunction(want), f"{cls.__name__}.{name}: async?"
    for name in data if instance is not None else ():
        assert hasattr(instance, name), f"{cls.__name__} lacks {name}"


async def _engines():
    local = AsyncEngine(lambda: None, lambda name: None)
    disagg = DisaggEngine(None, Registry(), metrics=None)
    return local, disagg


@pytest.mark.parametrize("cls", [AsyncEngine, DisaggEngine])
def test_engines_implement_engine_client(cls):
    import asyncio

    local, disagg = asyncio.run(_engines())
    _check(EngineClient, cls, local if cls is AsyncEngine else disagg)


@pytest.mark.parametrize("cls", [RequestGroup, RouterGroup])
def test_their_groups_implement_request_stream(cls):
    # the methods; `subs` is set per instance, and building a group needs a running engine
    # (every test of the OpenAI app, collocated or disaggregated, reads it)
    _check(RequestStream, cls)


def test_the_check_catches_a_different_signature():
    class Wrong:
        def submit(self, inputs, request_id=None):
            pass

    with pytest.raises(AssertionError, match="submit"):
        _check(type("OnlySubmit", (), {"submit": EngineClient.submit}), Wrong)


def test_a_router_no_worker_ever_joined_turns_from_loading_to_failed():
    import time

    async def check():
        e = DisaggEngine(None, Registry(), metrics=None)
        e.started_s = time.monotonic()
        fresh = (e.loading, e.failure)
        e.started_s -= e.first_worker_timeout_s + 1  # long past the wait for a first worker
        return fresh, (e.loading, e.failure)

    import asyncio

    (loading, failure), (later_loading, later_failure) = asyncio.run(check())
    assert "register" in loading and failure is None
    assert later_loading is None and "no worker has registered" in later_failure and "secret" in later_failure


def test_echo_logprobs_without_the_prompts_logprobs_is_an_error_not_nulls():
    # a worker older than its router drops the field it does not know: say so, do not
    # answer 200 with null logprobs that a scoring client would read as data
    from pdserve.server.engine_client import ChoiceOutput, Completion
    from pdserve.server.errors import APIError
    from pdserve.server.format import CompletionFormatter

    fmt = CompletionFormatter("id", "m", lambda t: f"<{t}>", 1, 0, echo_texts=["ab"], echo_ids=[[1, 2]])
    done = ChoiceOutput([3], "x", [{3: -0.5}], Completion("x", [3], [{3: -0.5}], "length"))
    with pytest.raises(APIError) as e:
        fmt.full([done], {})
    assert e.value.status == 502
    ok = Completion("x", [3], [{3: -0.5}], "length", prompt_logprobs=[None, {2: -1.0}])
    body = fmt.full([ChoiceOutput([3], "x", [{3: -0.5}], ok)], {})
    lp = body["choices"][0]["logprobs"]
    assert lp["token_logprobs"] == [None, -1.0, -0.5] and lp["text_offset"] == [0, 3, 6]

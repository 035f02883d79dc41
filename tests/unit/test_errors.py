"""Error classes: codes, wire round trip, abstract bases."""

import pytest

from weightcache import errors


def test_base_is_abstract():
    with pytest.raises(TypeError):
        errors.WeightcacheError("x")
    with pytest.raises(TypeError):
        errors.ProtocolError("x")


@pytest.mark.parametrize("cls", list(errors.ERRORS_BY_CODE.values()))
def test_wire_round_trip_rebuilds_same_class(cls):
    e = cls("boom", model="m")
    back = errors.from_wire(**e.to_wire())
    assert type(back) is cls and back.code == cls.code and back.details == {"model": "m"}


def test_codes_unique_and_snake_case():
    import re

    codes = [c.code for c in errors.ERRORS_BY_CODE.values()]
    assert len(codes) == len(set(codes))
    assert all(re.fullmatch(r"[a-z]+(_[a-z]+)*", c) for c in codes)


def test_unknown_code_keeps_code():
    e = errors.from_wire("from_the_future", "msg", {"a": 1})
    assert isinstance(e, errors.UnknownRemoteError)
    assert e.remote_code == "from_the_future" and e.details == {"a": 1}


def test_retryable_flags():
    assert errors.DaemonUnavailable("x").retryable
    assert not errors.CacheKeyMismatch("x").retryable

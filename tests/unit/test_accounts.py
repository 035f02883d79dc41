"""Configured user and group names: resolved where the configuration is read, never by an access check.

``allow_users``, ``allow_groups`` and ``service.operator_groups`` name accounts; NSS
(``/etc/passwd``, sssd, LDAP) answers those names, and may take seconds. The checks
on the serving loop compare ids only (weightcache.config, weightcache.daemon.access).
"""

from __future__ import annotations

import grp
import os
import pwd

import pytest

from weightcache.config import _accounts as accounts
from weightcache.config import AccountNames
from weightcache.config import ModelConfig, Placement, load_config
from weightcache.daemon import access
from weightcache.daemon.state import Peer, Slot

ME = pwd.getpwuid(os.getuid()).pw_name
MY_GROUP = grp.getgrgid(os.getgid()).gr_name


def _slot(**allow) -> Slot:
    return Slot(Placement(ModelConfig("m", "/nonexistent", **allow), 1, 0, 0))


def _no_nss(monkeypatch):
    def refuse(*a):
        raise AssertionError(f"NSS asked during an access check: {a}")

    for mod, fn in ((pwd, "getpwnam"), (pwd, "getpwuid"), (grp, "getgrnam"), (grp, "getgrgid")):
        monkeypatch.setattr(mod, fn, refuse)


def test_the_config_resolves_its_names_when_read(tmp_path):
    f = tmp_path / "weightcache.toml"
    f.write_text(f'[service]\noperator_groups = ["{MY_GROUP}", "no-such-group-wc"]\n'
                 f'[models.m]\npath = "{tmp_path}"\nallow_users = ["{ME}", "no-such-user-wc", "4242"]\n'
                 f'allow_groups = ["{MY_GROUP}"]\n')
    cfg = load_config(str(f))
    assert cfg.names.uid(ME) == os.getuid() and cfg.names.gid(MY_GROUP) == os.getgid()
    assert cfg.names.uid("4242") == 4242  # numbers are ids, no lookup
    assert cfg.names.uid("no-such-user-wc") is None and cfg.names.gid("no-such-group-wc") is None
    assert cfg.names.user_of(os.getuid()) == ME


def test_checks_compare_ids_and_never_ask_nss(monkeypatch):
    """By user name, by uid, by group name, operator groups and the metrics user: all answered from the
    names resolved at config time; a name that did not resolve then matches nobody."""
    names = AccountNames(uids={"alice": 2001, accounts.METRICS_USER: 2999}, gids={"readers": 3001, "ops": 3002})
    policy = access.Policy(service_uid=999, operator_groups=("ops",), names=names)
    _no_nss(monkeypatch)
    alice, bob, carol = Peer(1, 2001, 100), Peer(2, 2002, 100, (3001,)), Peer(3, 2003, 100)
    slot = _slot(allow_users=("alice", "2003", "ghost"), allow_groups=("readers",))
    assert access.may_attach(alice, slot, policy)  # by name
    assert access.may_attach(bob, slot, policy)  # by supplementary group
    assert access.may_attach(carol, slot, policy)  # by uid written as a string
    stranger = Peer(4, 2004, 100)
    assert not access.may_attach(stranger, slot, policy)  # "ghost" did not resolve: nobody
    with pytest.raises(Exception) as e:
        access.check_attach(stranger, slot, policy)
    # No configured name has uid 2004 (no NSS lookup on the loop): the message names the uid once.
    assert e.value.code == "access_denied" and e.value.message.startswith("uid 2004 may not attach model"), \
        e.value.message
    assert access.is_operator(Peer(5, 2005, 3002), policy) and not access.is_operator(alice, policy)
    assert access.may_observe_all(Peer(6, 2999, 100), policy) and not access.may_observe_all(alice, policy)
    with pytest.raises(Exception) as e:
        access.check_operator(alice, policy, "evict", "m")
    assert e.value.code == "access_denied" and "user alice (uid 2001)" in e.value.message


def test_a_policy_without_resolved_names_allows_by_id_only(monkeypatch):
    _no_nss(monkeypatch)
    policy = access.Policy(service_uid=999, operator_groups=("3002",))
    slot = _slot(allow_users=("alice", "2001"))
    assert access.may_attach(Peer(1, 2001, 100), slot, policy)
    assert not access.may_attach(Peer(2, 2002, 100), slot, policy)
    assert access.is_operator(Peer(3, 2003, 3002), policy)
    assert access.may_attach(Peer(4, 999, 100), slot, policy)  # the service user, always


def test_a_refusal_does_not_tell_the_stranger_who_is_allowed(caplog):
    """A socket-group member off a model's allow lists may learn that it is refused, not whom the lists name
    (the threat model: it sees nothing of a restricted model; status and list hide it). The refusal quoted
    both lists to it; they go to the journal's warning, for the operator."""
    names = AccountNames(uids={"alice": 2001}, gids={"inference": 3001})
    policy = access.Policy(service_uid=999, names=names)
    slot = _slot(allow_users=("alice",), allow_groups=("inference",))
    caplog.set_level("WARNING", logger="weightcache.daemon.access")
    with pytest.raises(Exception) as e:
        access.check_attach(Peer(4, 2004, 100), slot, policy)
    told = e.value.message + repr(e.value.details)
    assert e.value.code == "access_denied" and "alice" not in told and "inference" not in told, told
    logged = [r.getMessage() for r in caplog.records]
    assert len(logged) == 1 and "allow_users=['alice']" in logged[0] and "allow_groups=['inference']" in logged[0], \
        logged

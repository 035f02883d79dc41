"""Fixtures for tests that need a real systemd as PID 1 (see nspawn.py).

``container`` boots the host OS once per session as a throw-away
``systemd-nspawn`` container with the tree's units installed, and stops it
(by PID) at the end. ``clean_container`` gives each test a container with no
weightcache unit running and none failed. Tests using them are marked
``system`` and skipped (only) when not root or without systemd-nspawn.
"""

from __future__ import annotations

import os

import pytest

from nspawn import Container, default_binds, install_weightcache, unavailable_reason, unreadable_reason


@pytest.fixture(scope="session")
def container():
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    unreadable = unreadable_reason()
    if unreadable:  # every unit would fail; say why once, at once
        pytest.fail(f"system tests cannot run from this checkout: {unreadable}", pytrace=False)
    box = Container(f"weightcache-test-{os.getpid()}", binds_ro=default_binds())
    box.start()
    try:
        install_weightcache(box)
        yield box
    finally:
        box.stop()


@pytest.fixture
def clean_container(container):
    yield container
    # Stop only what the tests start: weightcache units (stop also drops their fd stores).
    container.run("systemctl stop 'weightcache@*.service' 'weightcache@*.socket' weightcache.target weightcache.service; "
                  "systemctl reset-failed 'weightcache*'", check=False)

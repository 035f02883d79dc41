"""The harness starts a service with stored fds as systemd does: at 3, 4, ... and nowhere else.

The known bug of ``test_tiers::test_after_a_crash_the_budget_keeps_an_adopted_slab_as_leased`` (issue 38,
found merging 38 and 39): after ``evict --force`` of an adopted slab its memfd stayed counted as held elsewhere
for good. The service was right: a second fd of that memfd was open in the service itself, the copy
``pass_fds`` left at the test process's fd number (inheritable, so it survived the exec) beside the one the
wrapper moved to 3, 4, ...; which stored fds leaked depended on the numbers the test process happened to give
them (a ``status`` session open while the fd store stand-in received them moved them up).
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys

from service_harness import listen_fds_wrapper

#: Run after the wrapper: what a started service sees (its memfd fds, each with its name, and the variables).
_CHILD = (
    "import json, os\n"
    "fds = {}\n"
    "for fd in os.listdir('/proc/self/fd'):\n"
    "    try:\n"
    "        target = os.readlink(f'/proc/self/fd/{fd}')\n"
    "    except OSError:\n"
    "        continue\n"
    "    if target.startswith('/memfd:'):\n"
    "        fds[fd] = target.split(':', 1)[1].split(' ')[0]\n"
    "print(json.dumps({'fds': fds, 'names': os.environ['LISTEN_FDNAMES'], 'n': os.environ['LISTEN_FDS']}))\n"
)


def test_stored_fds_reach_the_service_at_3_4_only():
    made = []
    try:
        for name in ("slab-x", "manifest-x"):
            fd = os.memfd_create(name)
            made.append(fd)
            # Above 3 + their count, where pass_fds' copies were left open at exec (the numbers the failing run
            # had: the fd store stand-in received them while the test held other fds)
            made.append(fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 40))
        stored = {"slab-x": made[1], "manifest-x": made[3]}
        out = subprocess.run([*listen_fds_wrapper(stored), sys.executable, "-c", _CHILD], pass_fds=tuple(stored.values()),
                             capture_output=True, text=True, timeout=60, check=True)
    finally:
        for fd in made:
            os.close(fd)
    seen = json.loads(out.stdout)
    assert (seen["n"], seen["names"]) == ("2", "manifest-x:slab-x"), seen
    assert seen["fds"] == {"3": "manifest-x", "4": "slab-x"}, seen

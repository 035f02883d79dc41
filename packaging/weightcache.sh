#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# /usr/bin/weightcache: runs the weightcache command line with the runtime
# interpreter. Debian's and Fedora's python3 have no usable torch, so the
# command runs from the runtime made by weightcache-setup-runtime
# (/opt/weightcache/venv), or from $WEIGHTCACHE_PYTHON as set in the
# environment or in /etc/default/weightcache (the file weightcache@.service
# reads too).
set -u

from_env=${WEIGHTCACHE_PYTHON:-}
if [ -r /etc/default/weightcache ]; then
    # KEY=value lines, the same file systemd reads with EnvironmentFile=
    # (e.g. WEIGHTCACHE_PYTHON, PYTHONPATH, WEIGHTCACHE_SOCKET_DIR).
    set -a
    . /etc/default/weightcache
    set +a
fi
# A WEIGHTCACHE_PYTHON set in the caller's environment wins over the file.
PY=${from_env:-${WEIGHTCACHE_PYTHON:-/opt/weightcache/venv/bin/python}}

if [ ! -x "$PY" ]; then
    # Without the runtime, the commands that need no torch, safetensors or
    # numpy run on the distribution's python3, which imports weightcache from
    # the package: --help, --version, and the ones that only talk to the
    # service's socket. serve and check-config read checkpoints: they need it.
    needs_runtime=yes
    for arg in "$@"; do
        case $arg in
            -h|--help|--version) needs_runtime=no; break ;;
        esac
    done
    case ${1:-} in
        ""|status|list|verify|evict|preload|wait|reload|metrics|serve-metrics) needs_runtime=no ;;
    esac
    if [ "$needs_runtime" = no ] && [ -x /usr/bin/python3 ]; then
        exec /usr/bin/python3 -m weightcache "$@"
    fi
    echo "weightcache: runtime missing: $PY does not exist or is not executable;" \
         "'weightcache ${1:-}' reads checkpoints and needs it: run weightcache-setup-runtime (as root)," \
         "or set WEIGHTCACHE_PYTHON in /etc/default/weightcache to a Python that has torch and weightcache" >&2
    exit 78
fi
exec "$PY" -m weightcache "$@"

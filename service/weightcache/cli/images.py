"""``weightcache images``: the processed images of the node (issue 36), read from the image directory.

The directory is the service user's, mode 0700: run as root or as the service user. Reads each file's
header only (no slab byte).

Forbidden imports: torch, weightcache.daemon, weightcache.client.
"""

from __future__ import annotations

import argparse
import json
import os
import time

from ..config import load_config
from ..images import ImageStore
from .common import EXIT_FAILED, EXIT_OK, format_age, human_bytes


def cmd_images(args: argparse.Namespace) -> int:
    """Lists the images: size, model and ranks, key summary, age (since written) and last use (last read
    into a slab), least recently used first (the order the byte limit removes them in, within a priority)."""
    if args.dir:
        directory, limit = args.dir, 0
    else:
        svc = load_config(args.config).service
        directory = svc.image_directory({"CACHE_DIRECTORY": os.environ.get("CACHE_DIRECTORY",
                                                                           "/var/cache/weightcache")})
        limit = svc.image_max_bytes
    try:
        os.listdir(directory)
    except FileNotFoundError:
        print(f"no image directory at {directory}: no image was written yet")
        return EXIT_OK
    except PermissionError:
        print(f"weightcache: {directory}: permission denied (the directory is the service user's, mode 0700: "
              f"run as root or as the service user)")
        return EXIT_FAILED
    store = ImageStore(directory, limit, "")
    entries = store.entries()
    if args.json:
        for e in entries:
            print(json.dumps(e.to_json()))
        return EXIT_OK
    now = time.time()
    total = sum(e.size_bytes for e in entries)
    print(f"{directory}: {len(entries)} file(s), {human_bytes(total)}"
          + (f" of image_max_bytes {human_bytes(limit)}" if limit else ""))
    for e in entries:
        k = e.key or {}
        what = (f"{e.model}/tp{e.tp_size}/rank{e.tp_rank}" if e.model else "(unreadable header)")
        key = " ".join(f"{n}={k[n]}" for n in ("architecture", "dtype", "naming", "quant_scheme", "backend",
                                                 "compute_capability", "pipeline_version") if k.get(n) not in (None, ""))
        print(f"  {what:<32} {human_bytes(e.size_bytes):>10}  age {format_age(now - e.written_at):>6}  "
              f"last use {format_age(now - e.last_used):>6} ago{'  REJECTED' if e.rejected else ''}")
        print(f"      {e.name}  {key}")
    return EXIT_OK

"""``import weightcache`` loads lazily: attaching never imports the load pipeline, the disk fallback does.

Each check runs a fresh interpreter of the test venv (``sys.executable``) and
reads the modules it imported from ``-X importtime`` (stderr: one line per
module) or from ``sys.modules``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from service_harness import daemon  # noqa: F401 - pytest fixture (a host-backend service)

#: The load pipeline and what only it needs: never imported by ``import weightcache; weightcache.attach``.
PIPELINE = ("weightcache.pipeline", "weightcache.quant", "weightcache.sharding", "weightcache.reader",
            "weightcache.reader._rows")
#: The operator's messages, the records inside their replies, and ``release`` (the client ends a lease by closing
#: its connection), and publication's messages: an engine's attach never exchanges them.
OPERATOR_PROTOCOL = ("weightcache.protocol._admin", "weightcache.protocol._records", "weightcache.protocol._lease",
                     "weightcache.protocol._publish")
#: The planning stages' tensor specs and the safetensors header reads: an attach served by the service builds no
#: spec and reads no header (the key's checkpoint identity is checked by ``stat()``).
NOT_ATTACHING = ("weightcache.tensor_spec", "weightcache.checkpoint.header")


def _imported(code: str, ahead: str = "0") -> set[str]:
    """Modules a fresh interpreter imports running ``code`` (``$WEIGHTCACHE_IMPORT_AHEAD`` = ``ahead``), from
    ``-X importtime``."""
    r = subprocess.run([sys.executable, "-X", "importtime", "-c", code], capture_output=True, text=True, timeout=120,
                       check=True, env={**os.environ, "WEIGHTCACHE_IMPORT_AHEAD": ahead})
    return {line.rsplit("|", 1)[1].strip() for line in r.stderr.splitlines() if line.startswith("import time:")
            and "|" in line} - {"package"}


#: What only the CUDA attach path needs: imported by the first CUDA attach, or ahead by weightcache.client._imports.
CUDA_PATH = ("weightcache.memory.cuda", "weightcache.identity", "cuda.bindings")


@pytest.mark.parametrize("ahead", ["0", "1"])
def test_import_weightcache_and_attach_skip_the_pipeline(ahead):
    """The client's modules, never the pipeline's; the CUDA attach path only when imported ahead (``1``: on a thread,
    waited for here so that the list is whole)."""
    mods = _imported("import weightcache; weightcache.attach; weightcache.AttachOptions; "
                     "from weightcache.client import _imports as attach_imports; attach_imports.wait()", ahead)
    assert {"weightcache", "weightcache.client", "weightcache.protocol"} <= mods
    for name in PIPELINE + OPERATOR_PROTOCOL + NOT_ATTACHING + ("numpy", "torch", "safetensors"):
        assert not any(m == name or m.startswith(name + ".") for m in mods), f"{name} imported: {sorted(mods)}"
    ahead_of_attach = {m for m in mods if m.startswith(CUDA_PATH)}
    if ahead == "0":
        assert ahead_of_attach == set(), sorted(mods)
    else:
        assert {"weightcache.memory.cuda", "weightcache.identity"} <= ahead_of_attach, sorted(mods)


def _toy_checkpoint(path: Path):
    """A one-file unquantized checkpoint (``w``: F32 [2, 3], ``b``: BF16 [4]); returns the tensors."""
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file

    path.mkdir()
    tensors = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3),
               "b": torch.arange(4, dtype=torch.bfloat16)}
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({"architectures": ["Toy"], "model_type": "toy"}))
    return tensors


@pytest.mark.parametrize("by,ahead", [("path", "0"), ("name", "0"), ("path", "1")])
def test_first_attach_to_a_service_imports_no_pipeline(daemon, tmp_path, by, ahead):  # noqa: F811 - the fixture
    """A fresh engine's first attach served by a running (host-backend) service: the key is checked
    (identity from ``stat()`` and the small JSON files) without the load pipeline, the quantization
    registry or the operator's messages; the tensors are the checkpoint's bytes. (numpy is not checked here:
    ``import torch``, which the views need, imports it itself; the check before attach holds it out.)
    A host attach never imports the cuda backend; with the CUDA path imported ahead (``ahead`` = ``1``, on a
    thread) the host attach is the same."""
    ck = tmp_path / "ck"
    tensors = _toy_checkpoint(ck)
    svc = daemon({"toy": str(ck)})
    model = str(ck) if by == "path" else "toy"
    code = (
        "import sys, json, weightcache\n"
        f"a = weightcache.attach({model!r}, socket_dir={svc.socket_dir!r}, fallback=False, timeout=60)\n"
        "from weightcache.client import _imports as attach_imports\nattach_imports.wait()\n"
        "mods = sorted(m for m in sys.modules if m.startswith('weightcache.'))\n"
        "print(json.dumps([mods, a.source, {k: [str(v.dtype), v.float().tolist()] for k, v in a.tensors.items()}]))\n"
        "a.close()\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "WEIGHTCACHE_IMPORT_AHEAD": ahead})
    assert r.returncode == 0, r.stderr[-3000:]
    mods, source, got = json.loads(r.stdout.strip().splitlines()[-1])
    assert source == "daemon"
    assert got == {k: [str(v.dtype), v.float().tolist()] for k, v in tensors.items()}
    for name in PIPELINE + OPERATOR_PROTOCOL + NOT_ATTACHING:
        assert not any(m == name or m.startswith(name + ".") for m in mods), f"{name} imported: {mods}"
    assert "weightcache.client" in mods and "weightcache.identity" in mods and "weightcache.memory.host" in mods
    assert ("weightcache.memory.cuda" in mods) is (ahead == "1"), mods


def test_import_weightcache_alone_imports_no_submodule():
    mods = _imported("import weightcache")
    assert {m for m in mods if m.startswith("weightcache.")} == set(), sorted(mods)


def test_the_operator_tools_import_no_client():
    """``weightcache status``'s modules and the metrics talk through the session alone."""
    mods = _imported("import weightcache.cli.status, weightcache.metrics")
    for name in ("weightcache.client", "weightcache.daemon", "weightcache.pipeline", "torch"):
        assert not any(m == name or m.startswith(name + ".") for m in mods), f"{name} imported"


def test_unknown_attribute_is_an_attribute_error():
    import weightcache

    with pytest.raises(AttributeError):
        weightcache.no_such_name  # noqa: B018
    assert {"attach", "Attachment", "AttachOptions", "WeightcacheError"} <= set(dir(weightcache))


def test_disk_fallback_imports_the_pipeline_when_it_runs(tmp_path):
    """No service: ``attach(fallback=True)`` loads from disk, the pipeline imported by then; bytes as stored."""
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file

    ck = tmp_path / "ck"
    ck.mkdir()
    w = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    save_file({"w": w}, str(ck / "model.safetensors"))
    (ck / "config.json").write_text(json.dumps({"architectures": ["Toy"], "model_type": "toy"}))
    code = (
        "import sys, json, weightcache\n"
        "before = sorted(m for m in ('weightcache.pipeline', 'weightcache.sharding') if m in sys.modules)\n"
        f"a = weightcache.attach({str(ck)!r}, socket_dir={str(tmp_path / 'run')!r}, fallback=True, timeout=1)\n"
        "after = sorted(m for m in ('weightcache.pipeline', 'weightcache.sharding') if m in sys.modules)\n"
        "print(json.dumps([before, after, a.source, a.tensors['w'].tolist()]))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    before, after, source, values = json.loads(r.stdout.strip().splitlines()[-1])
    assert (before, after, source) == ([], ["weightcache.pipeline", "weightcache.sharding"], "disk")
    assert values == w.tolist()


def test_without_torch_import_works_and_attach_names_the_runtime(tmp_path):
    """torch missing: ``from weightcache import attach`` succeeds; calling it raises ModuleNotFoundError naming
    the runtime, not a traceback from inside the package."""
    code = (
        "import sys\n"
        "sys.modules['torch'] = None  # as if torch were not installed\n"
        "from weightcache import attach, AttachOptions\n"
        "try:\n"
        f"    attach('/nonexistent', socket_dir={str(tmp_path)!r})\n"
        "except ModuleNotFoundError as e:\n"
        "    print('NAME', e.name)\n"
        "    print('MSG', e)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    out = dict(line.split(" ", 1) for line in r.stdout.splitlines())
    assert out["NAME"] == "torch"
    assert "weightcache-setup-runtime" in out["MSG"] and "/opt/weightcache/venv" in out["MSG"]


def test_options_record_and_keywords_are_the_same_request(tmp_path):
    """``attach(options=AttachOptions(...))`` and the keyword form build one request; keywords override."""
    from weightcache.client import AttachOptions, AttachRequest

    opts = AttachOptions(device="cpu", fallback=False, timeout=2.0, socket_dir=str(tmp_path), naming="vllm")
    a = AttachRequest.of("/m", 2, 1, opts)
    b = AttachRequest("/m", 2, 1, "cpu", "zero_copy", False, 2.0, str(tmp_path), None, None, "vllm", "cutlass")
    assert a == b and a.socket_path == str(tmp_path / "0.sock")
    import weightcache

    with pytest.raises(TypeError) as e:
        weightcache.attach("/m", options=opts, devcie="cpu")
    assert "devcie" in str(e.value)
    with pytest.raises(ValueError):
        weightcache.attach("/m", options=opts, mode="mmap")
    assert Path(tmp_path).is_dir()


def test_the_attach_path_modules_offer_no_names_of_the_planning_stages():
    """Each name has one import path: ``spec`` has no tensor specs and ``checkpoint`` no header names (no PEP 562
    re-export); they are :mod:`weightcache.tensor_spec`'s and :mod:`weightcache.checkpoint.header`'s, which an
    attach never imports (``test_import_weightcache_and_attach_skip_the_pipeline``)."""
    from weightcache import checkpoint, spec, tensor_spec
    from weightcache.checkpoint import header

    assert tensor_spec.TensorSpec and tensor_spec.SourceRef and header.TensorInfo and header.pread_exact
    for module, names in ((spec, ("TensorSpec", "SourceRef")), (checkpoint, ("TensorInfo", "pread_exact"))):
        for name in names:
            assert not hasattr(module, name), f"{module.__name__}.{name}"

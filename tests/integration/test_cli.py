"""Operator commands against running services (host backend, real sockets).

Two ``weightcache serve`` subprocesses (GPU 0 and GPU 1, ``--backend host``)
hold: the real all-MiniLM-L6-v2 checkpoint (tp = 1 on GPU 0), a tiny Llama
written here without transformers (tp = 2 over GPUs 0 and 1), and a model whose
checkpoint does not exist (fails on GPU 0). The CLI runs in-process
(``weightcache.cli.main``) with ``--socket-dir``; engines attach with
``weightcache.attach``. Tests assert exit codes, JSON fields and real bytes.

:class:`Services` is a plain helper (not a fixture) so that ``test_docs.py``
can reuse it.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
from checkpoints import minilm_path  # noqa: E402
import torch
from safetensors.torch import load_file

from weightcache import attach, protocol
from weightcache.cli import main
from weightcache.session import Session

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from service_harness import FdStoreStandIn, ServiceProcess, make_config, poll_until  # noqa: E402
from checkpoints import write_checkpoint  # noqa: E402

pytestmark = pytest.mark.timeout(120)


def write_tiny_llama(dest: Path) -> Path:
    """A 2-layer LlamaForCausalLM (hidden 64, 8 heads / 4 KV heads, vocab 128), F32, 2 files."""
    h, inter, vocab, layers = 64, 128, 128, 2
    g = torch.Generator().manual_seed(7)
    shapes = {"model.embed_tokens.weight": (vocab, h), "lm_head.weight": (vocab, h), "model.norm.weight": (h,)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (32, h),
            p + "self_attn.v_proj.weight": (32, h), p + "self_attn.o_proj.weight": (h, h),
            p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
        })
    tensors = {n: torch.randn(s, generator=g) for n, s in shapes.items()}
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": h, "intermediate_size": inter,
        "num_hidden_layers": layers, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 8,
        "vocab_size": vocab, "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }
    return write_checkpoint(dest, tensors, config, files=2)


class Services:
    """``weightcache serve`` subprocesses, one per GPU index, on sockets in ``socket_dir``.

    Args:
        config (`Path`): the TOML file passed with ``--config``.
        socket_dir (`Path`): where ``<gpu>.sock`` are bound (``--listen``).
        gpus (`list[int]`): GPU indices to serve.
    """

    def __init__(self, config: Path, socket_dir: Path, gpus: list[int]) -> None:
        self.config, self.socket_dir, self.gpus = config, socket_dir, gpus
        self.procs: dict[int, subprocess.Popen] = {}
        self.logs: dict[int, Path] = {}

    def __enter__(self) -> "Services":
        self.socket_dir.mkdir(parents=True, exist_ok=True)
        try:
            for gpu in self.gpus:
                svc = ServiceProcess(self.socket_dir.parent / f"serve-{gpu}", self.config, gpu, "host",
                                     socket_dir=self.socket_dir).launch()
                self.procs[gpu], self.logs[gpu] = svc.proc, svc.log_path
            self.wait_settled()
        except BaseException:
            self.__exit__()
            raise
        return self

    def log_text(self) -> str:
        return "\n".join(f"--- serve --gpu {g} ---\n{p.read_text(errors='replace')}" for g, p in self.logs.items())

    def status(self, gpu: int) -> dict:
        s = Session(str(self.socket_dir / f"{gpu}.sock"), timeout=10.0)
        try:
            return s.request(protocol.Status()).status
        finally:
            s.close()

    def wait_settled(self, limit_s: float = 90.0) -> None:
        """Blocks until every slab of every instance is ready, failed or evicted."""
        pending = set(self.gpus)

        def settled() -> bool:
            for gpu in sorted(pending):
                proc = self.procs[gpu]
                if proc.poll() is not None:
                    raise AssertionError(f"serve --gpu {gpu} exited with {proc.returncode}\n{self.log_text()}")
                if not (self.socket_dir / f"{gpu}.sock").exists():
                    continue
                st = self.status(gpu)
                if all(sl["state"] not in ("pending", "loading") for sl in st["slabs"]):
                    pending.discard(gpu)
            return not pending

        poll_until(settled, "every instance's loads to settle", limit_s, 0.1, detail=self.log_text)

    def __exit__(self, *exc: object) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    """Runs ``weightcache ARGV`` in-process; returns ``(exit status, stdout, stderr)``."""
    capsys.readouterr()
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture(scope="module")
def llama_path(tmp_path_factory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama")


@pytest.fixture(scope="module")
def services(tmp_path_factory, llama_path):
    root = tmp_path_factory.mktemp("wc")
    cfg = root / "weightcache.toml"
    cfg.write_text(f"""
[service]
backend = "host"

[models.minilm]
path = "{minilm_path()}"

[models.llama]
path = "{llama_path}"
layouts = [ {{ tp = 2, gpus = [0, 1] }} ]

[models.broken]
path = "{root / 'no-such-checkpoint'}"
""")
    with Services(cfg, root / "run", [0, 1]) as svc:
        yield svc


def sock(svc: Services) -> tuple[str, str]:
    return "--socket-dir", str(svc.socket_dir)


def slab(status_json: dict, gpu: int, model: str, tp_size: int | None = None) -> dict:
    (st,) = [g for g in status_json["gpus"] if g["gpu"] == gpu]
    (sl,) = [s for s in st["slabs"] if s["model"] == model and tp_size in (None, s["tp_size"])]
    return sl


def assert_equal_to_checkpoint(tensors: dict[str, torch.Tensor]) -> None:
    disk = load_file(str(minilm_path() / "model.safetensors"))
    assert set(tensors) == set(disk)
    for name, t in disk.items():
        assert torch.equal(tensors[name], t), name


# --- check-config (no service needed) ---------------------------------------


def test_check_config_prints_every_rank_on_every_gpu(capsys, tmp_path, llama_path):
    cfg = tmp_path / "weightcache.toml"
    cfg.write_text(f"""
[models.minilm]
path = "{minilm_path()}"
layouts = [ {{ tp = 1, gpus = [0] }}, {{ tp = 1, gpus = [1] }} ]

[models.llama]
path = "{llama_path}"
layouts = [ {{ tp = 2, gpus = [1, 0] }}, {{ tp = 1, gpus = [0] }} ]
""")
    rc, out, err = cli(capsys, "check-config", "--config", str(cfg))
    assert rc == 0, err
    placed: dict[int, set[tuple[str, int, int, str]]] = {}
    counts: dict[int, int] = {}
    gpu = None
    for line in out.splitlines():
        if m := re.match(r"GPU (\d+): (\d+) slabs?", line):
            gpu = int(m.group(1))
            placed[gpu], counts[gpu] = set(), int(m.group(2))
        elif m := re.match(r"\s+(\S+)\s+tp=(\d+) rank=(\d+)\s+gpus=\[([\d,]+)\]", line):
            placed[gpu].add((m.group(1), int(m.group(2)), int(m.group(3)), m.group(4)))
    assert placed == {
        0: {("minilm", 1, 0, "0"), ("llama", 2, 1, "1,0"), ("llama", 1, 0, "0")},
        1: {("minilm", 1, 0, "1"), ("llama", 2, 0, "1,0")},
    }
    assert counts == {0: 3, 1: 2}


def test_check_config_shows_disabled_gpus(capsys, tmp_path):
    """Issue 39: [service] disabled_gpus was invisible to check-config."""
    cfg = tmp_path / "weightcache.toml"
    cfg.write_text(f'[service]\ndisabled_gpus = [1]\n\n[models.minilm]\npath = "{minilm_path()}"\n'
                   f'layouts = [ {{ tp = 1, gpus = [0] }}, {{ tp = 1, gpus = [1] }} ]\n')
    rc, out, err = cli(capsys, "check-config", "--config", str(cfg))
    assert rc == 0, err
    assert "disabled_gpus=[1]: weightcache.target starts no instance for these GPUs" in out, out
    assert re.search(r"^GPU 1: 1 slab, .* planned \(disabled_gpus: not started by weightcache.target\)$", out, re.M)
    assert re.search(r"^GPU 0: 1 slab, .* planned$", out, re.M), out


def test_check_config_shows_a_vllm_model_without_rules_as_waiting_for_engine(capsys, tmp_path):
    """A ``naming = "vllm"`` model of an architecture without rules (Qwen3, written by transformers) is
    ``waiting_for_engine`` in the service (the engine publishes it), so check-config does not call it an error;
    the same checkpoint with tp = 2 and ``naming = "hf"`` still is one."""
    import transformers

    qwen3 = tmp_path / "qwen3"
    config = transformers.Qwen3Config(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=8, num_key_value_heads=2, head_dim=8, vocab_size=151,
                                      max_position_embeddings=64)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(qwen3)
    cfg = tmp_path / "weightcache.toml"
    cfg.write_text(f'[models.qwen3]\npath = "{qwen3}"\nnaming = "vllm"\n')
    rc, out, err = cli(capsys, "check-config", "--config", str(cfg))
    assert rc == 0, err
    assert "error" not in err, err
    assert re.search(r"^  qwen3 +tp=1 rank=0  gpus=\[0\]  waiting_for_engine \(unsupported_architecture\): the "
                     r"service cannot lay it out; the first engine started with --load-format weightcache "
                     rf"publishes it  {re.escape(str(qwen3))}$", out, re.M), out
    cfg.write_text(f'[models.qwen3]\npath = "{qwen3}"\nlayouts = [ {{ tp = 2, gpus = [0, 1] }} ]\n')
    rc, out, err = cli(capsys, "check-config", "--config", str(cfg))
    assert rc == 1
    assert "ERROR unsupported_architecture" in out and "error: model qwen3 tp=2 rank=0" in err, (out, err)


def test_check_config_fails_on_a_missing_checkpoint(capsys, tmp_path):
    missing = tmp_path / "gone"
    cfg = tmp_path / "weightcache.toml"
    cfg.write_text(f'[models.minilm]\npath = "{minilm_path()}"\n\n[models.gone]\npath = "{missing}"\n')
    rc, out, err = cli(capsys, "check-config", "--config", str(cfg))
    assert rc == 1
    assert re.search(r"gone\s+tp=1 rank=0\s+gpus=\[0\]\s+ERROR checkpoint_not_found", out)
    assert "model gone tp=1 rank=0" in err and "checkpoint_not_found" in err and str(cfg) in err


@pytest.mark.parametrize("body, dropin, key", [
    ('[models.x]\npath = "/m"\nlayouts = [ { tp = 2, gpus = [0] } ]\n', None, "models.x.layouts[0].gpus"),
    ('[models.x]\npath = "/m"\n', '[models.y]\npath = "/m"\ncolour = "red"\n', "models.y.colour"),
    ('[service]\nsocket_dir = 5\n', None, "service.socket_dir"),
    ('[models.x\npath = "/m"\n', None, ""),
])
def test_check_config_names_file_and_key_of_a_bad_config(capsys, tmp_path, body, dropin, key):
    cfg = tmp_path / "weightcache.toml"
    cfg.write_text(body)
    bad = cfg
    if dropin is not None:
        (tmp_path / "conf.d").mkdir()
        bad = tmp_path / "conf.d" / "50-extra.toml"
        bad.write_text(dropin)
    rc, out, err = cli(capsys, "check-config", "--config", str(cfg))
    assert rc == 2
    assert err.startswith(f"weightcache: {bad}: {key}")


def test_check_config_warns_of_one_checkpoint_configured_twice(capsys, tmp_path):
    """Through a symlink, and with ``dtype = "float32"`` on a float32 checkpoint (the same bytes as ``auto``),
    two models plan the same slab on GPU 0: each later one is a warning naming it and the first, exit 0.
    float16 (other bytes) and the link's rank on GPU 1 (no twin there) are not warned about."""
    link = tmp_path / "minilm-link"
    link.symlink_to(minilm_path())
    cfg = tmp_path / "weightcache.toml"
    cfg.write_text(f"""[service]
backend = "host"

[models.minilm]
path = "{minilm_path()}"

[models.alias]
path = "{link}"
layouts = [ {{ tp = 1, gpus = [0] }}, {{ tp = 1, gpus = [1] }} ]

[models.explicit]
path = "{minilm_path()}"
dtype = "float32"

[models.half]
path = "{link}"
dtype = "float16"
""")
    rc, out, err = cli(capsys, "check-config", "--config", str(cfg))
    assert rc == 0, err
    warnings = [ln for ln in err.splitlines() if ln.startswith("warning: ")]
    assert [re.match(r"warning: models (\S+) and (\S+) are the same slab on GPU (\d+) \(tp=1 rank=0\)", w).groups()
            for w in warnings] == [("minilm", "alias", "0"), ("minilm", "explicit", "0")]
    assert f"{minilm_path()} and {link} are the same checkpoint files" in warnings[0]
    assert "an attach by path gets minilm" in warnings[0]
    assert "error:" not in err and "GPU 0: 4 slabs" in out


def _probe(usable: bool, devices: int, reason: str):
    from weightcache.memory import CudaProbe

    def probe():
        probe.calls += 1
        return CudaProbe(usable, devices, reason)

    probe.calls = 0
    return probe


def test_check_config_warns_of_gpus_the_node_does_not_have(capsys, tmp_path, monkeypatch):
    """A node whose driver reports 2 GPUs: indices 2 and 5 are warnings naming their models, exit 0."""
    monkeypatch.setattr("weightcache.memory.probe_cuda", _probe(True, 2, "the CUDA driver reports 2 device(s)"))
    cfg = tmp_path / "weightcache.toml"
    cfg.write_text(f"""[models.minilm]
path = "{minilm_path()}"
layouts = [ {{ tp = 1, gpus = [0] }}, {{ tp = 1, gpus = [5] }} ]

[models.other]
path = "{minilm_path()}"
dtype = "float16"
layouts = [ {{ tp = 1, gpus = [1] }}, {{ tp = 1, gpus = [2] }} ]

[models.third]
path = "{minilm_path()}"
dtype = "bfloat16"
layouts = [ {{ tp = 1, gpus = [2] }} ]
""")
    rc, out, err = cli(capsys, "check-config", "--config", str(cfg))
    assert rc == 0, err
    assert "GPUs on this node: 2 (the CUDA driver reports 2 device(s))" in out
    warnings = [ln for ln in err.splitlines() if ln.startswith("warning: ")]
    assert [re.match(r"warning: GPU (\d+) \((.*?)\) is not on this node: the CUDA driver reports 2 GPUs "
                     r"\(indices 0..1\)", w).groups() for w in warnings] == [
        ("2", "models other, third"), ("5", "model minilm")]
    assert "weightcache@5 would find no device" in warnings[1]


@pytest.mark.parametrize("backend, seen", [
    ("auto", "GPUs on this node: unknown, GPU indices not checked against them (cuda-bindings is not installed"),
    ("host", "GPUs on this node: not checked (backend = host"),
])
def test_check_config_skips_the_gpu_count_it_cannot_know(capsys, tmp_path, monkeypatch, backend, seen):
    """No driver (the count is unknown) or backend = host (indices only number instances): no warning,
    exit 0; with host the driver is not even asked."""
    probe = _probe(False, 0, "cuda-bindings is not installed (no module named 'cuda')")
    monkeypatch.setattr("weightcache.memory.probe_cuda", probe)
    cfg = tmp_path / "weightcache.toml"
    cfg.write_text(f'[service]\nbackend = "{backend}"\n\n[models.minilm]\npath = "{minilm_path()}"\n'
                   f'layouts = [ {{ tp = 1, gpus = [1023] }} ]\n')
    rc, out, err = cli(capsys, "check-config", "--config", str(cfg))
    assert rc == 0, err
    assert seen in out and "warning:" not in err
    assert probe.calls == (backend == "auto")


def test_check_config_says_serve_here_would_refuse_cuda_without_a_driver(capsys, tmp_path, monkeypatch):
    """New-user walk: check-config passed ``backend = "cuda"`` silently where ``serve`` exits 78. A warning
    (exit 0: the check may run on a build host), saying what serve on this node would do."""
    monkeypatch.setattr("weightcache.memory.probe_cuda", _probe(False, 0, "libcuda.so.1 not found"))
    cfg = tmp_path / "weightcache.toml"
    cfg.write_text(f'[service]\nbackend = "cuda"\n\n[models.minilm]\npath = "{minilm_path()}"\n')
    rc, out, err = cli(capsys, "check-config", "--config", str(cfg))
    assert rc == 0, err
    assert ('warning: backend = "cuda" but this node has no usable CUDA driver (libcuda.so.1 not found): '
            '`weightcache serve` on this node would refuse to start (config_invalid, exit 78)') in err, err


def test_check_config_rejects_a_gpu_index_past_1023_naming_its_line(capsys, tmp_path):
    cfg = tmp_path / "weightcache.toml"
    cfg.write_text(f'[models.minilm]\npath = "{minilm_path()}"\nlayouts = [ {{ tp = 1, gpus = [99999999999999] }} ]\n')
    rc, out, err = cli(capsys, "check-config", "--config", str(cfg))
    assert rc == 2
    assert err == (f"weightcache: {cfg}: models.minilm.layouts[0].gpus: GPU index 99999999999999 is out of range: "
                   f"expected 0..1023 (the node's CUDA device numbers, as `nvidia-smi -L` lists them) (line 3)\n")


# --- against the running services -------------------------------------------


def test_status_json_reports_states_keys_and_a_failed_model(capsys, services):
    rc, out, err = cli(capsys, "status", "--json", *sock(services))
    assert rc == 1  # broken failed
    doc = json.loads(out)
    assert doc["unreachable"] == []
    assert sorted(g["gpu"] for g in doc["gpus"]) == [0, 1]
    for g in doc["gpus"]:
        assert g["backend"] == "host" and g["pid"] == services.procs[g["gpu"]].pid
        assert 0 < g["memory"]["free_bytes"] <= g["memory"]["total_bytes"]
    mini = slab(doc, 0, "minilm")
    assert mini["state"] == "ready" and mini["adopted"] is False
    assert mini["tensors"] == len(load_file(str(minilm_path() / "model.safetensors")))
    assert mini["resident_bytes"] >= mini["total_bytes"] > 0
    assert mini["key"]["architecture"] == "BertModel" and mini["key"]["files"] == 1
    assert mini["leases"] == []
    broken = slab(doc, 0, "broken")
    assert broken["state"] == "failed" and broken["resident_bytes"] == 0 and "adopted" in broken
    assert broken["error"]["code"] == "checkpoint_not_found"
    for gpu in (0, 1):
        ll = slab(doc, gpu, "llama")
        assert (ll["state"], ll["tp_size"], ll["tp_rank"]) == ("ready", 2, gpu)
        assert ll["key"]["architecture"] == "LlamaForCausalLM"


def test_status_human_output(capsys, services):
    rc, out, err = cli(capsys, "status", *sock(services))
    assert rc == 1
    gpu0 = out.split("GPU 1 ")[0]
    assert re.search(r"^GPU 0  backend=host  service pid=%d$" % services.procs[0].pid, gpu0, re.M)
    assert re.search(r"^  resident [\d.]+ MiB in 2 slabs; host RAM free [\d.]+ \wiB of [\d.]+ \wiB; 0 leases$",
                     gpu0, re.M)
    assert re.search(r"^  minilm tp=1 rank=0\s+ready$", gpu0, re.M)
    assert re.search(r"^      key: arch=BertModel dtype=auto naming=hf quant=none files=1 pipeline=v\d+$", gpu0, re.M)
    assert re.search(r"^  broken tp=1 rank=0\s+failed: checkpoint_not_found$", gpu0, re.M)
    assert re.search(r"^      reason: .*no-such-checkpoint", gpu0, re.M)
    assert re.search(r"^  llama tp=2 rank=1\s+ready$", out.split("GPU 1 ")[1], re.M)
    # --gpu 1 alone has no failed model
    rc, out, _ = cli(capsys, "status", "--gpu", "1", *sock(services))
    assert rc == 0 and "GPU 0" not in out


def test_status_shows_an_active_lease_and_resident_bytes(capsys, services):
    with attach(str(minilm_path()), socket_dir=str(services.socket_dir), gpu=0, fallback=False) as w:
        assert w.source == "daemon"
        rc, out, _ = cli(capsys, "status", "--json", "--gpu", "0", *sock(services))
        mini = slab(json.loads(out), 0, "minilm")
        (lease,) = mini["leases"]
        assert (lease["pid"], lease["uid"], lease["mode"]) == (os.getpid(), os.getuid(), "zero_copy")
        assert lease["lease_id"] == w.lease_id and lease["since"] <= time.time()
        rc, out, _ = cli(capsys, "status", "--gpu", "0", *sock(services))
        assert re.search(r"^      lease %d: pid=%d uid=%d\b.* mode=zero_copy since \d{4}-\d\d-\d\d \d\d:\d\d:\d\d "
                         r"\(\d+s ago\)$" % (w.lease_id, os.getpid(), os.getuid()), out, re.M)
        assert "; 1 lease" in out
        rc, out, _ = cli(capsys, "list", "--json", *sock(services))
        assert [len(r["leases"]) for r in json.loads(out) if r["model"] == "minilm"] == [1]
    rc, out, _ = cli(capsys, "status", "--json", "--gpu", "0", *sock(services))
    assert slab(json.loads(out), 0, "minilm")["leases"] == []


def test_attachment_resident_bytes_equals_the_slab_size(capsys, services):
    """``Attachment.resident_bytes`` is what an engine subtracts from its KV-cache budget."""
    with attach(str(minilm_path()), socket_dir=str(services.socket_dir), gpu=0, fallback=False) as w:
        last = max(r.offset_bytes + r.size_bytes for r in w.manifest.tensors)
        assert last <= w.manifest.slab_size_bytes <= w.resident_bytes
        # every tensor is a view of the one mapping, and resident_bytes is that mapping's size
        assert {t.untyped_storage().nbytes() for t in w.tensors.values()} == {w.resident_bytes}
        assert len({t.untyped_storage().data_ptr() for t in w.tensors.values()}) == 1


def test_attachment_resident_bytes_equals_the_services_slab(capsys, services):
    with attach(str(minilm_path()), socket_dir=str(services.socket_dir), gpu=0, fallback=False) as w:
        rc, out, _ = cli(capsys, "status", "--json", "--gpu", "0", *sock(services))
        assert w.resident_bytes == slab(json.loads(out), 0, "minilm")["resident_bytes"]


def test_list_human_and_json(capsys, services):
    rc, out, err = cli(capsys, "list", *sock(services))
    assert rc == 0
    lines = out.splitlines()
    assert lines[0].split() == ["GPU", "MODEL", "TP", "RANK", "STATE", "RESIDENT", "LEASES", "PATH"]
    rows = {tuple(line.split()[:5]) for line in lines[1:]}
    assert rows == {("0", "minilm", "1", "0", "ready"), ("0", "llama", "2", "0", "ready"),
                    ("0", "broken", "1", "0", "failed"), ("1", "llama", "2", "1", "ready")}
    rc, out, _ = cli(capsys, "list", "--json", "--gpu", "1", *sock(services))
    (row,) = json.loads(out)
    assert (row["gpu"], row["model"], row["tp_rank"], row["state"], row["adopted"]) == (1, "llama", 1, "ready", False)


def test_verify(capsys, services):
    rc, out, err = cli(capsys, "verify", "minilm", *sock(services))
    assert rc == 0, err
    n = len(load_file(str(minilm_path() / "model.safetensors")))
    assert out == f"GPU 0 minilm tp=1 rank=0: ok, {n} tensors match their load-time digests\n"
    rc, out, _ = cli(capsys, "verify", "llama", *sock(services))
    assert rc == 0 and out.count(": ok, ") == 2
    rc, out, _ = cli(capsys, "verify", "broken", *sock(services))
    assert rc == 1 and "failed, not resident" in out
    rc, out, err = cli(capsys, "verify", "no-such-model", *sock(services))
    assert rc == 1 and "not configured on any GPU" in err
    rc, out, err = cli(capsys, "verify", "no-such-model", "--gpu", "0", *sock(services))
    assert rc == 1 and "model_not_found" in err


def test_evict_refused_while_leased_then_forced_then_preload(capsys, services):
    s = sock(services)
    w = attach(str(minilm_path()), socket_dir=str(services.socket_dir), gpu=0, fallback=False)
    try:
        rc, out, err = cli(capsys, "evict", "minilm", *s)
        assert rc == 1
        assert "GPU 0: lease_busy: " in err
        assert re.search(r"minilm tp=1 rank=0: lease %d pid=%d uid=%d" % (w.lease_id, os.getpid(), os.getuid()), err)
        assert slab(json.loads(cli(capsys, "status", "--json", *s)[1]), 0, "minilm")["state"] == "ready"

        rc, out, err = cli(capsys, "evict", "minilm", "--force", *s)
        assert (rc, out) == (0, "GPU 0: evicted minilm/tp1/rank0\n"), err
        st = slab(json.loads(cli(capsys, "status", "--json", *s)[1]), 0, "minilm")
        assert (st["state"], st["resident_bytes"]) == ("evicted", 0)
        assert_equal_to_checkpoint(w.tensors)  # the engine keeps its mapping
    finally:
        w.close()
    rc, out, _ = cli(capsys, "evict", "minilm", *s)
    assert (rc, out) == (0, "GPU 0: nothing resident to evict for minilm\n")
    rc, out, err = cli(capsys, "status", *s)
    assert re.search(r"^  minilm tp=1 rank=0\s+evicted", out, re.M)

    rc, out, err = cli(capsys, "preload", "minilm", *s)  # stdout is not a terminal: plain lines
    assert rc == 0, err
    lines = out.splitlines()
    assert lines[0] == "GPU 0: loading minilm/tp1/rank0"
    for line in lines[1:]:
        # No rate before one is measured, "planning" before the size is known (never "0 B/0 B 0.00 GB/s").
        assert re.fullmatch(r"GPU 0 minilm tp=1 rank=0: (pending|ready|loading planning \(reading the checkpoint's "
                            r"headers\)|loading [\d.]+ \w*B/[\d.]+ \w*B \(\d+%\)( [\d.]+ GB/s(, ~\w+ left)?)?)",
                            line), line
        assert "0 B/0 B" not in line and "0.00 GB/s" not in line, line
    assert lines[-1] == "GPU 0 minilm tp=1 rank=0: ready"
    rc, out, _ = cli(capsys, "preload", "minilm", *s)
    assert rc == 0 and out.splitlines()[0] == "GPU 0: minilm is already resident or loading"
    rc, out, err = cli(capsys, "verify", "minilm", *s)
    assert rc == 0, err
    with attach(str(minilm_path()), socket_dir=str(services.socket_dir), gpu=0, fallback=False) as w2:
        assert w2.source == "daemon"
        assert_equal_to_checkpoint(w2.tensors)


def test_preload_retries_a_failed_model_and_reports_the_failure(capsys, services):
    rc, out, err = cli(capsys, "preload", "broken", *sock(services))
    assert rc == 1
    assert out.splitlines()[0] == "GPU 0: loading broken/tp1/rank0"
    assert "GPU 0 broken tp=1 rank=0 failed: checkpoint_not_found: " in err


def test_wait(capsys, services):
    s = sock(services)
    rc, out, err = cli(capsys, "wait", "llama", *s)
    assert rc == 0, err
    assert sorted(out.splitlines()) == ["GPU 0 llama tp=2 rank=0: ready", "GPU 1 llama tp=2 rank=1: ready"]
    rc, out, err = cli(capsys, "wait", *s)
    assert rc == 1 and "broken tp=1 rank=0 failed: checkpoint_not_found" in err
    rc, out, err = cli(capsys, "wait", "no-such-model", *s)
    assert rc == 1 and "not configured on any GPU" in err


def test_commands_without_a_service(capsys, tmp_path):
    s = ("--socket-dir", str(tmp_path))
    for argv in (["status"], ["status", "--json"], ["list"], ["wait", "--wait-timeout", "0.5"], ["verify", "m"],
                 ["evict", "m"], ["preload", "m"]):
        rc, out, err = cli(capsys, *argv, *s)
        assert rc == 3, argv
    rc, out, err = cli(capsys, "wait", "--wait-timeout", "0", *s)  # wait polls for a service, then says why
    assert rc == 3 and "no weightcache sockets in" in err, err
    rc, out, err = cli(capsys, "status", "--gpu", "4", *s)
    assert rc == 3 and "GPU 4  unreachable: no weightcache service at" in out
    assert "systemctl status weightcache@4.socket weightcache@4.service; journalctl -u weightcache@4" in out


def test_wait_started_before_the_service_waits_for_it(capsys):
    """``serve ... &`` then ``wait`` at once (quickstart §3): wait polls until the socket is bound and the
    load settles, instead of exiting 3 because no socket exists yet."""
    run = Path(tempfile.mkdtemp(prefix="wcw-", dir="/tmp"))
    result: list[int] = []
    waiter = threading.Thread(target=lambda: result.append(
        main(["wait", "--socket-dir", str(run), "--wait-timeout", "120"])))
    capsys.readouterr()
    waiter.start()  # before the service exists
    svc = ServiceProcess(run, make_config({"minilm": str(minilm_path())}))
    try:
        svc.launch()
        waiter.join(150)
        out, err = capsys.readouterr()
        assert result == [0], (err, svc.log())
        assert "GPU 0 minilm tp=1 rank=0: ready" in out.splitlines()
    finally:
        svc.kill()


def test_status_and_list_show_a_slab_adopted_from_the_fd_store(capsys, tmp_path):
    """A restarted service re-adopts the stored slab; the CLI says so and verify still passes."""
    cfg = tmp_path / "weightcache.toml"
    cfg.write_text(f'[models.minilm]\npath = "{minilm_path()}"\n')
    run = tmp_path / "run"
    run.mkdir()
    with FdStoreStandIn(tmp_path / "notify.sock") as store:
        first = Services(cfg, run, [0])
        first.logs = {0: tmp_path / "serve.log"}
        first.procs = {0: store.serve(cfg, run / "0.sock", first.logs[0])}  # nothing stored yet
        first.wait_settled()  # the slab is stored before it is reported ready
        stored = store.collect(2, timeout=2, log=first.log_text)  # FDNAME=slab-<id> and FDNAME=manifest-<id>
        assert {n.split("-")[0] for n in stored} == {"slab", "manifest"}
        first.procs[0].send_signal(signal.SIGTERM)
        assert first.procs[0].wait(timeout=30) == 0

        second = store.serve(cfg, run / "0.sock", tmp_path / "serve.log")
        def listening() -> bool:
            assert second.poll() is None, (tmp_path / "serve.log").read_text()
            return (run / "0.sock").exists()

        poll_until(listening, "the restarted service's socket", 90, 0.1,
                   detail=lambda: (tmp_path / "serve.log").read_text())
        rc, out, err = cli(capsys, "wait", "--socket-dir", str(run))
        assert rc == 0, err
        rc, out, err = cli(capsys, "status", "--json", "--socket-dir", str(run))
        mini = slab(json.loads(out), 0, "minilm")
        assert (rc, mini["state"], mini["adopted"]) == (0, "ready", True)
        rc, out, _ = cli(capsys, "status", "--socket-dir", str(run))
        assert re.search(r"^  minilm tp=1 rank=0\s+ready \(adopted from fd store; leases from before the restart "
                         r"unknown\)$", out, re.M)
        assert re.search(r"; 0 leases \(\+ unknown from before the restart\)$", out, re.M), out
        # ... so evict without --force is refused (engines that attached before the restart may map it).
        rc, _, err = cli(capsys, "evict", "minilm", "--socket-dir", str(run))
        assert rc == 1 and "after the service restarted" in err, err
        rc, out, _ = cli(capsys, "list", "--socket-dir", str(run))
        assert out.splitlines()[1].split()[4] == "ready*" and "* adopted from the fd store" in out
        rc, out, err = cli(capsys, "verify", "minilm", "--socket-dir", str(run))
        assert rc == 0 and ": ok, " in out, err
        with attach(str(minilm_path()), socket_dir=str(run), fallback=False) as w:
            assert_equal_to_checkpoint(w.tensors)


def test_preload_after_the_path_was_fixed_in_the_file_says_to_reload(capsys, daemon, monkeypatch, tmp_path):
    """troubleshooting.md's checkpoint_not_found: fix ``path`` in the file; ``preload`` alone loads the running
    configuration (the old path) again and failed the same way, without a word on why. It now says the file
    gives another path and that ``weightcache reload`` applies it; the reload then loads the model."""
    wrong = tmp_path / "no-such-checkpoint"
    svc = daemon(make_config({"minilm": wrong}))
    svc.wait_settled()
    monkeypatch.setenv("WEIGHTCACHE_CONFIG", str(svc.config_path))
    s = ("--socket-dir", str(svc.socket_dir))
    rc, _, err = cli(capsys, "preload", "minilm", *s)
    assert rc == 1 and "checkpoint_not_found" in err and "note:" not in err  # the file agrees: nothing to add
    svc.write_config(make_config({"minilm": minilm_path()}))
    rc, _, err = cli(capsys, "preload", "minilm", *s)
    assert rc == 1 and "checkpoint_not_found" in err
    assert f'{svc.config_path} now gives model minilm path = "{minilm_path()}"' in err, err
    assert f"still runs with {wrong}" in err and "weightcache reload" in err, err
    rc, _, err = cli(capsys, "reload", *s)
    assert rc == 0, err
    rc, out, err = cli(capsys, "wait", "minilm", *s)
    assert (rc, out.splitlines()[-1]) == (0, "GPU 0 minilm tp=1 rank=0: ready"), err


def test_serve_metrics_by_hand_without_listen_names_the_configs_address(capsys, tmp_path, monkeypatch):
    """Run by hand without --listen: the advice is the [metrics] address and port of the config given, the
    address weightcache-metrics.socket would listen on, not a fixed 127.0.0.1:9661."""
    monkeypatch.delenv("LISTEN_FDS", raising=False)
    monkeypatch.delenv("LISTEN_PID", raising=False)
    cfg = tmp_path / "weightcache.toml"
    cfg.write_text('[metrics]\naddress = "::1"\nport = 9761\n')
    rc, out, err = cli(capsys, "serve-metrics", "--config", str(cfg))
    assert rc == 2
    assert ("no socket from systemd ($LISTEN_FDS) and no --listen HOST:PORT; start weightcache-metrics.socket, or "
            f"give --listen [::1]:9761 ([metrics] address and port of {cfg})") in err, err

"""fp32 CPU linears through oneDNN (rlhfkit/models/cpu_gemm.py): the same values and gradients as a float64
product, the fall-backs, a whole model's step, and one recorded kernel decision per machine."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from rlhfkit.cache import CACHE_ENV
from rlhfkit.models import cpu_gemm
from tests.helpers import REPO


@pytest.fixture
def forced(monkeypatch):
    monkeypatch.setenv(cpu_gemm.ENV, "onednn")


def _float64_grads(x, w, b, g):
    x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
    b64 = b.double().requires_grad_() if b is not None else None
    y = F.linear(x64, w64, b64)
    y.backward(g.double())
    return y, x64.grad, w64.grad, b64.grad if b is not None else None


@pytest.mark.parametrize("bias", [True, False])
def test_values_and_gradients_equal_a_float64_product(bias):
    torch.manual_seed(0)
    x = torch.randn(4, 96, 256, requires_grad=True)  # 384 x 256 x 384: above the routing threshold
    w = torch.randn(384, 256, requires_grad=True)
    b = torch.randn(384, requires_grad=True) if bias else None
    assert cpu_gemm._routable(x, w)
    y = cpu_gemm._OneDnnLinear.apply(x, w, b)
    g = torch.randn_like(y)
    y.backward(g)
    y64, gx64, gw64, gb64 = _float64_grads(x.detach(), w.detach(), b.detach() if bias else None, g)
    for ours, ref in [(y, y64), (x.grad, gx64), (w.grad, gw64)] + ([(b.grad, gb64)] if bias else []):
        assert ours.shape == ref.shape and ours.dtype == torch.float32
        assert ((ours.double() - ref).abs().max() / ref.abs().max()).item() < 1e-5


def test_a_frozen_weight_gets_no_gradient_and_a_frozen_input_none():
    torch.manual_seed(1)
    x, w = torch.randn(512, 128), torch.randn(512, 128, requires_grad=True)
    cpu_gemm._OneDnnLinear.apply(x, w, None).sum().backward()
    assert x.grad is None
    ref = torch.ones(512, 512).double().t() @ x.double()
    assert torch.allclose(w.grad.double(), ref, rtol=1e-5, atol=1e-4)
    x2, w2 = torch.randn(512, 128, requires_grad=True), torch.randn(512, 128)
    cpu_gemm._OneDnnLinear.apply(x2, w2, None).sum().backward()
    assert w2.grad is None
    assert torch.allclose(x2.grad.double(), torch.ones(512, 512).double() @ w2.double(), rtol=1e-5, atol=1e-4)


def test_calls_that_do_not_pay_or_cannot_run_fall_back_to_f_linear():
    w = torch.randn(384, 256)
    assert not cpu_gemm._routable(torch.randn(8, 256), w)  # 8 x 256 x 384 < 2^21: MKL's lower overhead wins
    assert not cpu_gemm._routable(torch.randn(512, 256).double(), w.double())
    assert not cpu_gemm._routable(torch.randn(512, 256).bfloat16(), w.bfloat16())
    assert not cpu_gemm._routable(torch.randn(512, 256), w.t().contiguous().t())  # a transposed view
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not cpu_gemm._routable(torch.randn(512, 256), w)
        assert cpu_gemm.linear(torch.randn(512, 256), w).dtype == torch.bfloat16  # autocast still applies
    x64 = torch.randn(512, 256).double()
    assert torch.equal(cpu_gemm.linear(x64, w.double()), F.linear(x64, w.double()))


def test_the_setting_is_read_from_the_environment(monkeypatch):
    monkeypatch.setenv(cpu_gemm.ENV, "aten")
    assert cpu_gemm.use_fast_cpu_linears(nn.Sequential(nn.Linear(4, 4))) == 0
    monkeypatch.setenv(cpu_gemm.ENV, "onednn")
    assert cpu_gemm.onednn_faster()
    monkeypatch.setenv(cpu_gemm.ENV, "mkl")
    with pytest.raises(ValueError, match="RLHFKIT_CPU_GEMM='mkl': expected one of auto, onednn, aten"):
        cpu_gemm.onednn_faster()


@pytest.fixture
def empty_cache(monkeypatch, tmp_path):
    """No recorded decision: the next `onednn_faster()` probes (and records under tmp_path)."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(cpu_gemm, "_choice", {})
    return tmp_path


def test_the_probe_decides_once_per_thread_count(monkeypatch, empty_cache):
    monkeypatch.delenv(cpu_gemm.ENV, raising=False)
    calls = []
    monkeypatch.setattr(cpu_gemm, "_probe", lambda: calls.append(1) or True)
    assert cpu_gemm.onednn_faster() and cpu_gemm.onednn_faster()
    assert calls == [1]


def test_the_driver_decides_once_for_every_process_it_starts(monkeypatch, empty_cache):
    from rlhfkit.distributed.ray_groups import worker_env

    monkeypatch.delenv(cpu_gemm.ENV, raising=False)
    for probe, kernel in ((True, "onednn"), (False, "aten")):  # the driver's probe, passed on as a fixed choice
        monkeypatch.setattr(cpu_gemm, "_choice", {})
        monkeypatch.setenv(CACHE_ENV, str(empty_cache / kernel))
        monkeypatch.setattr(cpu_gemm, "_probe", lambda probe=probe: probe)
        assert worker_env()[cpu_gemm.ENV] == kernel and worker_env({"X": "1"})[cpu_gemm.ENV] == kernel
    monkeypatch.setenv(cpu_gemm.ENV, "aten")  # the user's choice wins, and reaches every process of the run
    assert cpu_gemm.kernel_for_workers() == "aten" and worker_env()[cpu_gemm.ENV] == "aten"


def test_the_probe_times_both_kernels_for_real():
    assert isinstance(cpu_gemm._probe(), bool)


def test_the_kernels_are_timed_once_per_thread_count(monkeypatch):
    calls: list[int] = []
    monkeypatch.setattr(cpu_gemm, "_seconds", {})
    monkeypatch.setattr(cpu_gemm, "_time_kernels", lambda: calls.append(1) or {"aten": 0.5})
    assert not cpu_gemm._probe() and not cpu_gemm._probe()  # no oneDNN timing: MKL stays
    assert cpu_gemm.kernel_seconds() == {"aten": 0.5}
    assert calls == [1]


def test_a_build_without_onednn_times_mkl_only(monkeypatch):
    monkeypatch.setattr(cpu_gemm, "_onednn_works", lambda: False)
    monkeypatch.setattr(cpu_gemm, "_rates", {})
    assert set(cpu_gemm._time_kernels()) == {"aten"}
    assert cpu_gemm.gemm_rate("onednn") is None


def test_the_measured_rate_is_a_real_timing_kept_per_thread_count(monkeypatch):
    monkeypatch.setattr(cpu_gemm, "_rates", {})
    rate = cpu_gemm.gemm_rate("aten")
    # any CPU that runs the suite multiplies faster than 0.1 GFLOP/s and slower than 100 TFLOP/s
    assert rate is not None and 1e8 < rate < 1e14
    assert cpu_gemm.gemm_rate("aten") == rate  # measured once
    assert cpu_gemm._rates == {(torch.get_num_threads(), "aten"): rate}


def _tiny_llama() -> LlamaForCausalLM:
    cfg = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=344, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg)


def test_a_routed_model_trains_like_the_plain_one(forced):
    plain = _tiny_llama()
    routed = copy.deepcopy(plain)
    assert cpu_gemm.use_fast_cpu_linears(routed) == 2 * 7 + 1  # q k v o gate up down per layer, and the LM head
    assert routed.state_dict().keys() == plain.state_dict().keys()
    ids = torch.randint(0, 512, (4, 64))  # 256 tokens: every projection is above the threshold
    losses = []
    for model in (plain, routed):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.item())
    assert abs(losses[0] - losses[1]) < 1e-5
    for (name, p), q in zip(plain.named_parameters(), routed.parameters()):
        rel = ((p.grad - q.grad).abs().max() / p.grad.abs().max()).item()
        assert rel < 1e-4, name


def test_a_routed_model_pickles_and_deep_copies_onto_its_copy(forced):
    import io
    import pickle

    model = nn.Sequential(nn.Linear(256, 512))
    cpu_gemm.use_fast_cpu_linears(model)
    x = torch.randn(64, 256)
    for copied in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert copied[0].forward.args[0] is copied[0]  # routed, and onto the copy's own weights
        assert torch.equal(copied(x), model(x))
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    assert torch.equal(torch.load(buffer, weights_only=False)(x), model(x))


def test_the_decision_is_recorded_once_per_machine_and_read_back(monkeypatch, empty_cache):
    """A later process (here: the per-process memo cleared) reads the machine's record and does not probe, whatever
    a probe of its own would say: a resumed run multiplies on the kernel its first half used."""
    monkeypatch.delenv(cpu_gemm.ENV, raising=False)
    calls: list[int] = []
    monkeypatch.setattr(cpu_gemm, "_probe", lambda: calls.append(1) or False)
    assert not cpu_gemm.onednn_faster() and calls == [1]
    path = empty_cache / "cpu-gemm" / "choices.json"
    key = cpu_gemm.machine_key(torch.get_num_threads())
    record = json.loads(path.read_text())
    assert list(record) == [key] and record[key]["onednn"] is False and "aten" in record[key]["cpu_seconds"]
    assert "torch " + torch.__version__ in key

    def no_probe() -> bool:
        raise AssertionError("probed although the machine's decision is recorded")
    monkeypatch.setattr(cpu_gemm, "_probe", no_probe)
    monkeypatch.setattr(cpu_gemm, "_choice", {})
    assert not cpu_gemm.onednn_faster()
    record[key]["onednn"] = True  # the record decides, not this process
    path.write_text(json.dumps(record))
    monkeypatch.setattr(cpu_gemm, "_choice", {})
    assert cpu_gemm.onednn_faster() == cpu_gemm._onednn_works()


def test_a_damaged_record_is_measured_again_and_an_unwritable_cache_probes_per_process(monkeypatch, empty_cache):
    monkeypatch.delenv(cpu_gemm.ENV, raising=False)
    monkeypatch.setattr(cpu_gemm, "_probe", lambda: False)
    (empty_cache / "cpu-gemm").mkdir()
    for damaged in ("{not json", "[]"):
        (empty_cache / "cpu-gemm" / "choices.json").write_text(damaged)
        monkeypatch.setattr(cpu_gemm, "_choice", {})
        assert not cpu_gemm.onednn_faster()
        assert json.loads((empty_cache / "cpu-gemm" / "choices.json").read_text())  # rewritten whole
    blocked = empty_cache / "a_file"
    blocked.write_text("")
    monkeypatch.setenv(CACHE_ENV, str(blocked))  # the cache folder cannot be made under a file
    monkeypatch.setattr(cpu_gemm, "_choice", {})
    monkeypatch.setattr(cpu_gemm, "_probe", lambda: True)
    assert cpu_gemm.onednn_faster() == cpu_gemm._onednn_works()


def test_processes_starting_together_probe_once_and_agree(tmp_path):
    """Two real processes (as the ranks of a torchrun job start) with no record: one probes, the other waits on the
    lock and reads the same decision."""
    code = ("import torch; torch.set_num_threads(1); from rlhfkit.models import cpu_gemm; calls = []; "
            "probe = cpu_gemm._probe; cpu_gemm._probe = lambda: calls.append(1) or probe(); "
            "print(cpu_gemm.onednn_faster(), len(calls))")
    env = {k: v for k, v in os.environ.items() if k != cpu_gemm.ENV}
    env.update({CACHE_ENV: str(tmp_path), "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
             for _ in range(2)]
    outs = [p.communicate(timeout=120)[0].split() for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    assert outs[0][0] == outs[1][0] and sorted(int(o[1]) for o in outs) == [0, 1], outs
    assert len(json.loads((tmp_path / "cpu-gemm" / "choices.json").read_text())) == 1

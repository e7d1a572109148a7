"""`rlhfkit.planner.step_time`: the FLOPs of a step against a hand count on a toy shape, the seconds against the
module's constants, and the line `--dry_run` prints on CPU (never against a timing: bench/cost_curves.py measures)."""

from __future__ import annotations

import pytest
import torch

from rlhfkit.config.base import parse_config
from rlhfkit.config.sft import SFTConfig
from rlhfkit.models import cpu_gemm
from rlhfkit.planner import step_time as st
from rlhfkit.planner.cpu_probe import CpuProbe, measure_one_thread
from rlhfkit.planner.dry_run import dry_run
from rlhfkit.planner.memory import ModelShape
from tests.planner.memory_shapes import write_config

# vocab 100, hidden 8, MLP 16, 2 layers, 2 heads (1 KV head) of 4, tied embeddings
TOY = ModelShape(vocab_size=100, hidden_size=8, intermediate_size=16, num_layers=2, num_heads=2, num_kv_heads=1,
                 head_dim=4, tie_word_embeddings=True)
TOY_CONFIG = {"vocab_size": 100, "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 2,
              "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4, "tie_word_embeddings": True}


def test_weights_a_token_multiplies_through():
    # per layer: q and o 8 x 8 each (128), k and v 8 x 4 each (64), MLP 3 x 8 x 16 (384) = 576; x 2 layers = 1152;
    # the LM head 100 x 8 = 800 (tied, but still a matmul); a value head instead: 8
    assert st.matmul_weights(TOY) == 1952
    assert st.matmul_weights(TOY, lm_head=False) == 1160


def test_forward_and_train_work_by_hand():
    # 3 rows of 5 tokens: matmuls 2 x 1952 x 15 = 58,560; causal attention 2 x 2 layers x 3 rows x 5^2 x 8 = 2,400;
    # element-wise: (2 layers x (8 + 16) + 100 logits) x 15 tokens = 2,220
    assert st.attention_flops(TOY, 3, 5) == 2400
    assert st.forward_work(TOY, 3, 5) == st.Work(58560, 2400, 2220)
    assert st.train_work(TOY, 3, 5) == st.Work(175680, 7200, 6660)
    assert st.train_work(TOY, 3, 5).flops == 182880


def test_offline_trainers_count_their_rows():
    assert st.offline_step_work("sft", TOY, 3, 5, None) == st.Work(175680, 7200, 6660)
    # 3 pairs: 6 rows trained (3 x (2 x 1952 x 30, 4,800, 148 x 30)) and the reference forward on them
    assert st.offline_step_work("dpo", TOY, 3, 5, TOY) == st.Work(4 * 117120, 4 * 4800, 4 * 4440)
    assert st.offline_step_work("dpo", TOY, 3, 5, None) == st.Work(3 * 117120, 3 * 4800, 3 * 4440)  # reference-free
    # RM: 6 rows trained with a value head: 2 x 1160 x 30 FLOPs and (48 + 1) x 30 elements a pass
    assert st.offline_step_work("rm", TOY, 3, 5, None) == st.Work(3 * 69600, 3 * 4800, 3 * 1470)


@pytest.mark.parametrize("rates", [st.MKL, st.ONEDNN])
def test_seconds_from_the_rates_the_overhead_and_the_gloo_traffic(rates):
    work = st.Work(1e9, 2e8, 1e6)
    one = st.cpu_step_time(work, 100, threads=1, rates=rates)
    compute = 1e9 / rates.matmul + 2e8 / rates.attention + 1e6 * rates.seconds_per_element
    assert one.seconds == pytest.approx(compute + rates.overhead_s)
    two = st.cpu_step_time(work, 100, threads=2, rates=rates, params=1000, world=2)
    # a second thread adds extra_thread_efficiency of the first; ZeRO-3 / FSDP2: every fp32 parameter moves 3
    # times a step
    assert two.seconds == pytest.approx(compute / (1 + rates.extra_thread_efficiency) + rates.overhead_s
                                        + 3 * 4 * 1000 / rates.gloo_bytes_per_s)


def test_a_measured_matmul_rate_replaces_the_fit_for_the_matmul_term_only():
    work, rates = st.Work(1e9, 2e8, 1e6), st.MKL
    two = st.cpu_step_time(work, 100, threads=2, rates=rates, matmul_rate=5e9)
    # the measured rate is the process's at its thread count: no thread speed-up on top of it
    rest = (2e8 / rates.attention + 1e6 * rates.seconds_per_element) / (1 + rates.extra_thread_efficiency)
    assert two.seconds == pytest.approx(1e9 / 5e9 + rest + rates.overhead_s)
    assert two.matmul_rate == 5e9


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU machine plans against its GPUs (no estimate there)")
def test_without_a_measured_rate_the_line_claims_none(tmp_path, capsys, monkeypatch):
    # RLHFKIT_CPU_GEMM=onednn on a build whose oneDNN lacks the fp32 linear: the fit's rate, and no "measured" figure
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RLHFKIT_CPU_GEMM", "onednn")
    monkeypatch.setattr(cpu_gemm, "gemm_rate", lambda kernel: None)
    model = write_config(tmp_path / "toy", TOY_CONFIG)
    cfg = parse_config(SFTConfig, ["--pretrain", str(model), "--dataset", "x.jsonl", "--max_len", "5",
                                   "--train_batch_size", "3", "--micro_train_batch_size", "3", "--dry_run"], "x")
    assert dry_run(cfg, "sft", "x")
    line = capsys.readouterr().out.splitlines()[-1]
    seconds = st.cpu_step_time(st.Work(175680, 7200, 6660), 15, torch.get_num_threads(), st.ONEDNN).seconds
    assert line.startswith(f"step time: about {seconds:.3g} s per optimizer step on this CPU (15 tokens per rank")
    assert "linears on oneDNN);" in line and "measured" not in line


def test_the_rates_follow_the_kernel_of_the_linears():
    assert st.cpu_rates(True) is st.ONEDNN and st.cpu_rates(False) is st.MKL
    assert (st.ONEDNN.kernel, st.MKL.kernel) == ("onednn", "aten")
    assert st.ONEDNN.matmul > st.MKL.matmul  # the reason for the routing on this machine


def test_each_term_follows_its_probe_against_the_fit_machines():
    ref = st.MKL.reference
    assert ref is not None
    probe = CpuProbe(gemm=ref.gemm * 2, attention=ref.attention * 3, element_ns=ref.element_ns / 4,
                     op_us=ref.op_us * 5)
    here = st.on_this_machine(st.MKL, probe)
    # twice the GEMM rate, 3x the attention rate, a quarter of the time per element (and 4x the gloo traffic rate,
    # memory-bound like it), 5x the time per small op
    assert here.matmul == pytest.approx(st.MKL.matmul * 2)
    assert here.attention == pytest.approx(st.MKL.attention * 3)
    assert here.seconds_per_element == pytest.approx(st.MKL.seconds_per_element / 4)
    assert here.gloo_bytes_per_s == pytest.approx(st.MKL.gloo_bytes_per_s * 4)
    assert here.overhead_s == pytest.approx(st.MKL.overhead_s * 5)
    assert here.extra_thread_efficiency == st.MKL.extra_thread_efficiency
    # no reference recorded (the oneDNN fit) or nothing measured: the fit as it is
    assert st.on_this_machine(st.ONEDNN, probe) is st.ONEDNN and st.on_this_machine(st.MKL, None) is st.MKL


def test_the_matmul_rate_from_the_gemm_probe_at_the_runs_thread_count():
    ref = st.MKL.reference
    assert ref is not None
    # the fit's rate times the measured 1024^3 rate against the fit machine's: the models' products run below it
    assert st.matmul_rate_from(st.MKL, ref.gemm * 1.5) == pytest.approx(st.MKL.matmul * 1.5)
    assert st.matmul_rate_from(st.ONEDNN, 2e11) == 2e11  # no reference: the probe's own rate
    assert st.matmul_rate_from(st.MKL, None) is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU machine plans against its GPUs (no estimate there)")
@pytest.mark.parametrize(("setting", "rates", "name"), [("onednn", st.ONEDNN, "oneDNN"), ("aten", st.MKL, "MKL")])
def test_dry_run_prints_the_estimate_beside_the_memory_plan(tmp_path, capsys, monkeypatch, setting, rates, name):
    # the estimate uses the rates of the kernel the run's linears will use (RLHFKIT_CPU_GEMM first, then the probe)
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RLHFKIT_CPU_GEMM", setting)
    model = write_config(tmp_path / "toy", TOY_CONFIG)
    cfg = parse_config(SFTConfig, ["--pretrain", str(model), "--dataset", "x.jsonl", "--max_len", "5",
                                   "--train_batch_size", "3", "--micro_train_batch_size", "3", "--dry_run"], "x")
    assert dry_run(cfg, "sft", "x")
    line = capsys.readouterr().out.splitlines()[-1]
    # the probes of this machine (cached per process and thread count, so the same figures as the line's)
    measured = cpu_gemm.gemm_rate(rates.kernel)
    assert measured is not None
    here = st.on_this_machine(rates, measure_one_thread(rates.kernel) if rates.reference else None)
    matmul = st.matmul_rate_from(rates, measured)
    assert matmul is not None
    seconds = st.cpu_step_time(st.Work(175680, 7200, 6660), 15, torch.get_num_threads(), here,
                               matmul_rate=matmul).seconds
    assert line.startswith(f"step time: about {seconds:.3g} s per optimizer step on this CPU (15 tokens per rank")
    if rates.reference:
        assert (f"linears on {name} at {matmul / 1e9:.0f} GFLOP/s (a 1024^3 product: {measured / 1e9:.0f} measured "
                "here)") in line
    else:
        assert f"linears on {name} at a measured {measured / 1e9:.0f} GFLOP/s" in line

"""Every worked figure of ../shared/capacity-figures.md, from plan's own functions with the
same inputs (GB = 1e9 bytes). Tolerances are pinned: exact where the figure is exact,
the figure's own rounding where it is rounded."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

from posttrain.recipes.planning import formulas as plan
from tests.conftest import ROOT

GB = 1e9


def test_mixed_precision_adam_is_16_bytes_per_param():
    assert plan.ADAM_BYTES_PER_PARAM == 16 == 2 + 2 + 4 + 8
    assert plan.training_state_bytes(7e9) == 112 * GB
    assert plan.training_state_bytes(100e9) == 1.6e12
    assert plan.training_state_bytes(100e9) > 8 * 80 * GB  # does not fit a 640 GB node


@pytest.mark.parametrize(
    ("ranks", "want"),
    [
        (8, (385, 262.5, 140)),
        (16, (332.5, 201.25, 70)),
        (32, (306.25, 170.6, 35)),
        (64, (293.1, 155.3, 17.5)),
    ],
)
def test_zero_stages_for_70b(ranks, want):
    got = [plan.zero_bytes_per_rank(70e9, ranks, s) / GB for s in (1, 2, 3)]
    for g, w in zip(got, want, strict=True):  # figures printed to 1 decimal at most
        assert g == pytest.approx(w, abs=0.05)
    assert plan.zero_bytes_per_rank(70e9, 8, 0) == 16 * 70e9


def test_zero_wire():
    assert plan.zero_wire_elements(70e9, 1) == plan.zero_wire_elements(70e9, 2) == 2 * 70e9
    assert plan.zero_wire_elements(70e9, 3) / plan.zero_wire_elements(70e9, 0) == 1.5


def test_ring_allreduce():
    assert plan.ring_allreduce_bytes(16 * GB, 8) == pytest.approx(28 * GB, rel=1e-12)
    sent = plan.ring_allreduce_bytes(14 * GB, 8)
    assert sent == pytest.approx(24.5 * GB, rel=1e-12)
    assert plan.transfer_seconds(sent, 100e9 / 8) == pytest.approx(1.96, abs=1e-9)  # "~2 s"


def test_pipeline_bubble_and_recompute():
    assert plan.pipeline_bubble_fraction(16, 64) == 15 / 64
    assert plan.training_flops(1e9, 1e9, recompute=True) / plan.training_flops(
        1e9, 1e9
    ) == pytest.approx(4 / 3, rel=1e-12)  # +33%


def test_mfu_definition():
    flops_step = plan.training_flops(8e9, 1e6)
    assert plan.mfu(8e9, 1e6, 10.0, 8, 989e12) == pytest.approx(flops_step / (10 * 8 * 989e12))


def test_activations_128k_one_layer():
    # Llama 3 405B: hidden 16384, 128 heads; fused attention stores no score matrix
    got = plan.activation_bytes_per_layer(128 * 1024, 1, 16384, 128)
    assert got / GB == pytest.approx(73, abs=0.05)
    with_scores = plan.activation_bytes_per_layer(128 * 1024, 1, 16384, 128, scores=True)
    assert with_scores > 50 * got  # quadratic attention: why context parallelism


def test_moe_hot_experts():
    assert plan.hot_expert_load(0.9, 26, 256) == pytest.approx(8.86, abs=0.005)  # "~9x"


def test_llama3_405b_parallelism():
    assert 8 * 16 * 128 == 16384  # TP8 x PP16 x DP128


def test_failures_and_checkpoint_interval():
    mtbf = plan.mtbf_seconds(54, 419)
    assert mtbf / 3600 == pytest.approx(3.09, abs=0.005)  # "one every ~3 h"
    assert plan.young_daly_interval(60, 3 * 3600) == pytest.approx(math.sqrt(2 * 60 * 10800))
    assert plan.young_daly_interval(60, 3 * 3600) == pytest.approx(1138.4, abs=0.05)
    assert plan.restart_overhead(2, 15 * 60) == pytest.approx(0.0208, abs=5e-5)  # "2%"


def test_400b_dense_pretraining():
    flops = plan.training_flops(400e9, 10e12)
    assert flops == pytest.approx(2.4e25, rel=1e-12)
    h100 = plan.HARDWARE["h100"]
    days = plan.compute_seconds(flops, 16384, h100.bf16_flops, 0.40) / 86400
    assert days == pytest.approx(43, abs=0.5)
    interruptions = days * 86400 / plan.mtbf_seconds(54, 466)  # all interruptions
    assert interruptions == pytest.approx(380, rel=0.03)  # "~380"


def test_rl_broadcast_70b():
    assert plan.broadcast_bytes(70.6e9) / GB == pytest.approx(141, abs=0.25)  # Llama 3 70B


def test_qlora_70b():
    assert plan.frozen_base_bytes(70.6e9) / GB == pytest.approx(141, abs=0.25)
    nf4_data = 70e9 * 4 / 8
    assert nf4_data / GB == 35
    assert plan.nf4_scale_bits(double_quant=False) == 0.5
    assert plan.nf4_scale_bits(double_quant=True) == pytest.approx(0.127, abs=5e-4)
    assert plan.frozen_base_bytes(70e9, "nf4") / GB == pytest.approx(35 * (4.127 / 4), abs=0.01)


def test_kv_cache_and_decode():
    # 2 × 30 layers × 3 kv heads × 64 × 2 B = 23,040 B per token (SmolLM2-135M)
    assert plan.kv_cache_bytes(30, 3, 64, 1) == 23040
    t = plan.decode_seconds(1e9, 1e5, 10, 100, 200, 1e12)
    assert t == pytest.approx(200 * (1e9 + 1e5 * 10 * 200) / 1e12)


def test_hardware_table_has_sources():
    assert set(plan.HARDWARE) == {"h100", "h200", "a100"}
    assert all(h.source for h in plan.HARDWARE.values())
    assert plan.HARDWARE["h100"].bf16_flops == 989e12


def test_plan_imports_no_torch():
    code = (
        "import sys, posttrain.recipes.planning.formulas; "
        "sys.exit(1 if 'torch' in sys.modules else 0)"
    )
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0


def test_number_formats():
    fp16, bf16, e4m3 = plan.FORMATS["fp16"], plan.FORMATS["bf16"], plan.FORMATS["fp8_e4m3"]
    assert fp16.max_finite == 65504
    assert fp16.min_subnormal == 2.0**-24
    assert fp16.min_subnormal == pytest.approx(5.96e-8, abs=5e-11)
    assert bf16.max_finite / plan.FORMATS["fp32"].max_finite == pytest.approx(1, abs=0.01)
    assert bf16.spacing(1.0) == 2.0**-7 == 0.0078125
    assert bf16.spacing(1.0) / 2 == pytest.approx(0.0039, abs=1e-4)
    assert 3e-5 < bf16.spacing(1.0) / 2  # the update rounds away: 1.0 + 3e-5 == 1.0 in bf16
    assert e4m3.max_finite == 448 and e4m3.mantissa_bits == 3

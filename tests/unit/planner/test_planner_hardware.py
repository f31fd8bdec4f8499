"""Hardware specs: the shipped catalogue, user files merged over it, every problem reported."""

from __future__ import annotations

import pytest

from streamrl_cli.planner import PlannerError
from streamrl_cli.planner.hardware import load_hardware, replace_efficiency


def test_shipped_kinds_in_si_units():
    hw = load_hardware()
    assert {"h800", "h20", "h100", "h200", "a100", "cpu"} <= set(hw.gpus)
    h20, h800 = hw.get("H20"), hw.get("h800")
    # The StreamRL paper's H20/H800 reference table.
    assert h800.flops == pytest.approx(989.5e12) and h20.flops == pytest.approx(148e12)
    assert (h20.hbm_bytes, h800.hbm_bytes) == (96e9, 80e9)
    assert (h20.hbm_bw, h800.hbm_bw) == (pytest.approx(4.0e12), pytest.approx(3.35e12))
    assert (h20.nvlink_bw, h800.nvlink_bw) == (900e9, 400e9)
    assert h800.cost_per_hour / h20.cost_per_hour == pytest.approx(2.85)
    assert h800.usable_bytes == pytest.approx(80e9 * 0.9 - 4e9)
    assert hw.cross_site_bw == pytest.approx(100e9 / 8 * 0.9)


def test_user_file_adds_a_kind_and_corrects_a_field(tmp_path):
    f = tmp_path / "mine.yaml"
    f.write_text(
        "gpus:\n"
        "  h800: {cost_per_hour: 2.0}\n"
        "  b200: {flops_tflops: 2250, hbm_gb: 192, hbm_tb_s: 8, nvlink_gb_s: 1800, internode_gb_s: 100,\n"
        "         pcie_gb_s: 50, host_gb_s: 20, collective_us: 50, gpus_per_node: 8, cost_per_hour: 5,\n"
        "         efficiency: {train_compute: 0.5}}\n"
    )
    hw = load_hardware([f])
    assert hw.get("h800").cost_per_hour == 2.0
    assert hw.get("h800").flops == pytest.approx(989.5e12)  # the rest of the shipped spec stays
    b200 = hw.get("b200")
    assert b200.hbm_bytes == 192e9 and b200.eff.train_compute == 0.5
    assert b200.eff.decode_memory == hw.get("h800").eff.decode_memory  # shared defaults apply


def test_bad_file_reports_every_problem(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text(
        "gpus:\n"
        "  x1: {flops_tflops: fast, hbm_gb: 80, hbm_tb_s: 2, nvlink_gb_s: 0, internode_gb_s: 1,\n"
        "       pcie_gb_s: 1, host_gb_s: 1, collective_us: 1, gpus_per_node: 8, cost_per_hour: 1,\n"
        "       hbm_gbs: 3}\n"
        "  x2: {flops_tflops: 100}\n"
        "efficiency: {comm: 1.5}\n"
    )
    with pytest.raises(PlannerError) as e:
        load_hardware([f])
    msg = str(e.value)
    assert "gpus.x1.flops_tflops: expected a number" in msg
    assert "gpus.x1.hbm_gbs: unknown key (did you mean 'hbm_gb'?)" in msg
    assert "gpus.x2.hbm_gb: missing" in msg
    assert "efficiency.comm: a fraction in (0, 1]" in msg


def test_unknown_kind_suggests_the_closest_and_how_to_add_one():
    with pytest.raises(PlannerError, match=r"'h900' \(did you mean 'h800'\?\).*--hardware FILE"):
        load_hardware().get("h900")


def test_unreadable_and_non_mapping_files(tmp_path):
    with pytest.raises(PlannerError, match="cannot read hardware file"):
        load_hardware([tmp_path / "missing.yaml"])
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(PlannerError, match="expected a mapping"):
        load_hardware([tmp_path / "list.yaml"])


def test_replace_efficiency_makes_a_modified_copy():
    h800 = load_hardware().get("h800")
    slow = replace_efficiency(h800, train_compute=0.2)
    assert slow.eff.train_compute == 0.2 and h800.eff.train_compute == 0.45

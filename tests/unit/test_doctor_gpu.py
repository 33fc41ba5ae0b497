"""doctor's GPU findings on recorded nvidia-smi output (fixtures/nvidia-smi/h200: a real H200, idle and
under a bf16 matmul; README.txt there says how they were taken). Where a case needs what that card did
not show, the recorded text is edited and the edit is named in the test."""
from __future__ import annotations

from pathlib import Path

import pytest

from backend import gpu
from backend.doctor import FAIL, OK, WARN
from backend.doctor_gpu import CardNeed, findings

pytestmark = pytest.mark.unit
H200 = Path(__file__).resolve().parent / "fixtures" / "nvidia-smi" / "h200"
GiB = 1 << 30


def _text(name: str) -> str:
    return (H200 / name).read_text()


def _h200(idle: str | None = None, load: str | None = None, apps: str | None = None):
    info = gpu.parse_smi_xml(_text("nvidia-smi-q.xml"))[0]
    idle_s = gpu.parse_query_gpu(idle or _text("query-gpu-idle.csv"))[0]
    load_s = gpu.parse_query_gpu(load or _text("query-gpu-load.csv"))[0]
    return info, idle_s, load_s, gpu.parse_compute_apps(apps if apps is not None else _text("compute-apps-idle.csv"))


def _by_name(checks) -> dict:
    return {c.name: c for c in checks}


def test_the_recorded_outputs_parse():
    info, idle, load, apps = _h200()
    assert (info.name, info.driver, info.cuda) == ("NVIDIA H200", "580.159.04", "13.0")
    assert (info.default_power_w, info.max_power_w, info.mig) == (700.0, 700.0, False)
    assert idle.mem_total_mib == 143771 and idle.mem_free_mib == 143156 and idle.sm_mhz == 345
    assert (load.sm_mhz, load.sm_max_mhz, load.power_draw_w, load.power_limit_w) == (1500, 1980, 691.2, 700)
    assert apps == []
    busy = gpu.parse_compute_apps(_text("compute-apps-load.csv"))
    assert busy == [gpu.ComputeApp(504, "python3", 1002.0)]


def test_a_ready_h200_for_gpu_long():
    """The recorded card against gpu-long's needs (0.93 of the card; the 5.2 GiB pool pin; 1.5 GiB
    reserve; the 27B not local): every finding ok, each saying what it measured."""
    info, idle, load, apps = _h200()
    need = CardNeed(0.93, 5583457484, int(1.5 * GiB), None)
    got = _by_name(findings(0, info, idle, load, apps, need, torch_cuda="13.0"))
    assert {c.status for c in got.values()} == {OK}, got
    assert "NVIDIA H200, 140.4 GiB" in got["gpu 0 card"].detail
    assert got["gpu 0 driver"].detail.startswith("driver 580.159.04, supports CUDA 13.0")
    assert got["gpu 0 power limit"].detail == "700 W (default 700 W, max 700 W)"
    # under the matmul the H200 sits at its maximum 700 W limit with the SM clock at 1500 of 1980 MHz:
    # power-capped by design, nothing to raise
    clocks = got["gpu 0 clocks under load"].detail
    assert "SM 1500 of 1980 MHz at 691 W of 700 W" in clocks and "maximum power limit" in clocks
    assert "no other compute process" in got["gpu 0 processes"].detail
    assert "left for the weights" in got["gpu 0 free memory"].detail


def test_a_torch_newer_than_the_driver_fails_with_the_fix():
    info, idle, load, apps = _h200()
    got = _by_name(findings(0, info, idle, load, apps, None, torch_cuda="13.1"))
    c = got["gpu 0 driver"]
    assert c.status == FAIL and "built for CUDA 13.1" in c.detail and "upgrade the NVIDIA driver" in c.detail


def test_a_lowered_power_limit_is_named_with_the_command():
    info, _, _, apps = _h200()
    # edit: the limit set to 450 W (`nvidia-smi -pl 450`), in both readings
    low = lambda t: t.replace("700.00 W, 700.00 W", "450.00 W, 700.00 W").replace("691.20 W", "447.90 W")  # noqa: E731
    _, idle_low, load_low, _ = _h200(idle=low(_text("query-gpu-idle.csv")), load=low(_text("query-gpu-load.csv")))
    got = _by_name(findings(0, info, idle_low, load_low, apps, None))
    assert got["gpu 0 power limit"].status == WARN and "sudo nvidia-smi -i 0 -pl 700" in got["gpu 0 power limit"].detail
    clocks = got["gpu 0 clocks under load"]
    assert clocks.status == WARN and "power-limited" in clocks.detail and "-pl 700" in clocks.detail


def test_clocks_held_without_a_cause_and_thermal():
    info, idle, _, apps = _h200()
    # edit: the same 1500 MHz at 300 W (far from the limit) and 55 °C: not power, not heat
    cool = _text("query-gpu-load.csv").replace("691.20 W", "300.00 W")
    got = _by_name(findings(0, info, idle, gpu.parse_query_gpu(cool)[0], apps, None))
    assert got["gpu 0 clocks under load"].status == WARN and "-rgc" in got["gpu 0 clocks under load"].detail
    # edit: 300 W and 88 °C: thermal
    hot = cool.replace(", 55, 95 %", ", 88, 95 %")
    got = _by_name(findings(0, info, idle, gpu.parse_query_gpu(hot)[0], apps, None))
    assert "thermal" in got["gpu 0 clocks under load"].detail
    # no load run at all
    got = _by_name(findings(0, info, idle, None, apps, None))
    assert got["gpu 0 clocks under load"].status == WARN and "not measured" in got["gpu 0 clocks under load"].detail


def test_another_process_on_the_card_is_named_unless_it_is_our_load():
    info, idle, load, _ = _h200()
    busy = gpu.parse_compute_apps(_text("compute-apps-load.csv"))  # pid 504, the recording's own load
    got = _by_name(findings(0, info, idle, load, busy, None))
    assert got["gpu 0 processes"].status == WARN
    detail = got["gpu 0 processes"].detail
    assert "pid 504 python3 (1,002 MiB)" in detail and "kill 504" in detail
    got = _by_name(findings(0, info, idle, load, busy, None, own_pids=frozenset({504})))
    assert got["gpu 0 processes"].status == OK


def test_free_memory_below_what_vllm_takes_fails_with_the_utilization_that_would_start():
    info, _, load, _ = _h200()
    # edit: another process holds 40,000 MiB of the idle card (used 40000, free 103156)
    busy_idle = _text("query-gpu-idle.csv").replace("0 MiB, 143156 MiB", "40000 MiB, 103156 MiB")
    idle = gpu.parse_query_gpu(busy_idle)[0]
    apps = [gpu.ComputeApp(4242, "other-server", 40000.0)]
    got = _by_name(findings(0, info, idle, load, apps, CardNeed(0.93, 5583457484, int(1.5 * GiB), None)))
    c = got["gpu 0 free memory"]
    assert c.status == FAIL
    assert "100.7 GiB free (1 other process holds memory)" in c.detail
    assert "0.93 × 140.4 GiB = 130.6 GiB" in c.detail and "gpu_memory_utilization to 0.71" in c.detail


def test_pool_pin_and_weights_over_what_vllm_takes_fail_with_the_pin_that_fits():
    info, idle, load, apps = _h200()
    total = int(idle.mem_total_mib) << 20
    wanted = -(-total * 93 // 100)
    # a profile asking for a pool that leaves no room for its weights on this card
    need = CardNeed(0.93, wanted - 10 * GiB, int(1.5 * GiB), 16 * GiB)
    c = _by_name(findings(0, info, idle, load, apps, need))["gpu 0 free memory"]
    assert c.status == FAIL and "lower kv_cache_memory_bytes" in c.detail
    ok = _by_name(findings(0, info, idle, load, apps, CardNeed(0.93, 5583457484, int(1.5 * GiB), 16 * GiB)))
    assert ok["gpu 0 free memory"].status == OK and "to spare" in ok["gpu 0 free memory"].detail


def test_mig_and_visible_count():
    # edit: MIG enabled in the -q -x report
    xml = _text("nvidia-smi-q.xml").replace("<current_mig>Disabled</current_mig>", "<current_mig>Enabled</current_mig>")
    info = gpu.parse_smi_xml(xml)[0]
    _, idle, load, apps = _h200()
    c = _by_name(findings(0, info, idle, load, apps, None))["gpu 0 card"]
    assert c.status == WARN and "-mig 0" in c.detail
    assert gpu.visible_count({"CUDA_VISIBLE_DEVICES": "0"}) == 1
    assert gpu.visible_count({"CUDA_VISIBLE_DEVICES": "0,1"}) == 2
    assert gpu.visible_count({"CUDA_VISIBLE_DEVICES": ""}) == 0
    assert gpu.visible_count({"CUDA_VISIBLE_DEVICES": "-1"}) == 0

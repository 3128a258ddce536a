"""What time costs (eksft_nb.cost): prices parsed strictly from the table or a figure, GPU-hours and dollars
by hand, the scaled model's arithmetic and the assumptions it says, a job's account; and the same figures in
summary and the widget dashboard's goodput bar."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from eksft_nb import cost
from eksft_nb.errors import EksftError
from eksft_nb.spec import JobSpec

SPEC = JobSpec(name="c")   # 2 ranks on one node


def test_an_instance_of_the_table_is_priced_per_gpu_with_its_date_and_region() -> None:
    p = cost.pricing(SPEC, "p5.48xlarge")
    assert p.usd_per_gpu_hour == pytest.approx(55.04 / 8) and p.gpus_per_node == 8
    assert p.instance == "p5.48xlarge"
    assert "us-east-1" in p.said and cost.PRICES_AS_OF in p.said and "$55.04/h" in p.said
    assert cost.pricing(SPEC, "ml.p4d.24xlarge").usd_per_gpu_hour == pytest.approx(21.957642 / 8)
    # a price per instance-hour of no instance of the table is divided by the job's ranks per node
    given_ = cost.pricing(SPEC, "55.04/h")
    assert given_.usd_per_gpu_hour == pytest.approx(27.52) and given_.gpus_per_node == 2
    assert "2 GPU(s) a node as the job runs" in given_.said
    assert cost.pricing(SPEC, "6.88/gpu-h").usd_per_gpu_hour == 6.88
    assert cost.pricing(SPEC).usd_per_gpu_hour is None   # GPU-hours only
    # an EKS job on an instance of the table is priced by it without --price
    eks = SPEC.replace(backend="eks", **{"eks.instance_type": "p5en.48xlarge"})
    assert cost.pricing(eks).usd_per_gpu_hour == pytest.approx(63.296 / 8)


def test_gpu_hours_and_dollars_by_hand() -> None:
    p = cost.pricing(SPEC, "p5.48xlarge")
    # 90 s on 16 GPUs = 0.4 GPU-h at $6.88
    assert p.cost(90.0, 16) == {"gpu_h": 0.4, "usd": pytest.approx(2.752)}
    assert cost.text(p.cost(90.0, 16)) == "0.4 GPU-h ($2.75)"
    assert cost.pricing(SPEC).cost(90.0, 16) == {"gpu_h": 0.4, "usd": None}
    assert cost.text({"gpu_h": None, "usd": None}) == "-"
    assert cost.money(3412.7) == "$3,413" and cost.money(0.004) == "$0.004"
    assert p.delta(-1.0) == {"gpu_h": -1.0, "usd": pytest.approx(-6.88)}


def test_the_scaled_model_by_hand_says_what_it_assumes() -> None:
    p = cost.pricing(SPEC, "p5.48xlarge", "30d", 16, 2.0)
    # 2 % of steady time on checkpoints, a failure costing 45 s of the whole job, 2 failures a day
    proj = cost.project(cost.Losses(0.02, 45.0, 3, 300.0, 1, "the job's 3"), p)
    run_s, gpus = 30 * 86400, 16 * 8
    assert proj["gpus"] == gpus and proj["failures_expected"] == 60.0
    assert proj["total"]["gpu_h"] == pytest.approx(run_s * gpus / 3600)
    assert proj["failures"]["gpu_h"] == pytest.approx(60 * 45.0 * gpus / 3600)
    assert proj["checkpoints"]["gpu_h"] == pytest.approx((run_s - 60 * 45.0) * 0.02 * gpus / 3600)
    lost = proj["failures"]["gpu_h"] + proj["checkpoints"]["gpu_h"]
    assert proj["lost"]["usd"] == pytest.approx(lost * 6.88, rel=1e-6)
    said = " ".join(proj["assumes"])
    assert "2 failures a day (given)" in said and "45.0s" in said and "2.00% of steady training time" in said
    # the job's own rate is scaled per node, and said to be a test's
    own = cost.project(cost.Losses(0.02, 45.0, 3, 300.0, 1), cost.pricing(SPEC, None, "1d", 4))
    assert own["failures_expected"] == pytest.approx(3 / 300 * 86400 * 4)
    assert "give --failures-per-day" in " ".join(own["assumes"])


def test_a_jobs_account_splits_faults_from_checkpoints() -> None:
    seconds = {"productive": 80.0, "checkpoint_stall": 4.0, "checkpoint_interference": 2.0,
               "restart_downtime": 6.0, "recomputed": 3.0, "skipped": 0.0, "startup": 3.0, "other": 2.0}
    a = cost.account(seconds, 2, 4, 1, cost.pricing(SPEC, "6.88/gpu-h"))
    assert a["faults"]["gpu_h"] == pytest.approx(9.0 * 4 / 3600, abs=1e-6)
    assert a["checkpoints"]["gpu_h"] == pytest.approx(6.0 * 4 / 3600, abs=1e-6)
    assert a["lost"]["gpu_h"] == pytest.approx(20.0 * 4 / 3600, abs=1e-6) and a["projection"] is None
    a = cost.account(seconds, 2, 4, 1, cost.pricing(SPEC, "6.88/gpu-h", "7d", 2, 1.0))
    assert a["projection"]["failures_expected"] == 7.0
    assert "a failure stops all 4 GPUs for 4.5s" in " ".join(a["projection"]["assumes"])
    assert any("a model of a 7d run" in line for line in cost.account_text(a))


@pytest.mark.parametrize(("args", "said"), [
    ({"price": "p9.huge"}, "neither a price nor an instance type"), ({"price": "0"}, "out of range"),
    ({"price": "1e9"}, "neither a price"), ({"price": ""}, "names no price"),
    ({"run_for": "30 days"}, "not a run length"), ({"run_for": "0d"}, "not a run length"),
    ({"run_for": "11000d"}, "not a run length"), ({"nodes": 16}, "give its length too"),
    ({"run_for": "1d", "nodes": 0}, "not a number of nodes"),
    ({"run_for": "1d", "failures_per_day": -1.0}, "not a rate")])
def test_bad_cost_options_are_one_line(args: dict, said: str) -> None:
    with pytest.raises(EksftError) as e:
        cost.pricing(SPEC, **args)
    assert said in str(e.value) and "\n" not in str(e.value), str(e.value)


@given(st.text(max_size=40))
def test_any_price_text_is_a_price_or_one_line(text: str) -> None:
    try:
        price = cost.parse_price(text)
    except EksftError as e:
        assert "\n" not in str(e) and len(str(e)) < 600
    else:
        assert 0 < price.usd <= cost.MAX_USD_PER_HOUR


@given(st.text(max_size=20))
def test_any_duration_text_is_a_duration_or_one_line(text: str) -> None:
    try:
        seconds = cost.parse_duration(text)
    except EksftError as e:
        assert "\n" not in str(e)
    else:
        assert 0 < seconds <= cost.MAX_RUN_S


def test_the_goodput_bar_says_what_the_faults_and_checkpoints_cost() -> None:
    from eksft_nb.dashboard.parts import GoodputBar

    seconds = {"productive": 80.0, "checkpoint_stall": 4.0, "checkpoint_interference": 2.0,
               "restart_downtime": 6.0, "recomputed": 3.0, "skipped": 0.0, "startup": 3.0, "other": 2.0}
    bar = GoodputBar(seconds=seconds, gpus=4)
    assert "(faults 0.01 GPU-h, checkpoints 0.00667 GPU-h)" in bar.value and "GPU-hours only" in bar.value
    p = cost.pricing(SPEC, "p5.48xlarge")
    bar.usd_per_gpu_hour, bar.price = p.usd_per_gpu_hour, p.said
    assert "faults 0.01 GPU-h ($0.07)" in bar.value and "lost 0.0222 GPU-h ($0.15)" in bar.value
    assert "restart downtime: 6.0s (6.0%), 0.00667 GPU-h ($0.05)" in bar.value   # each term's tooltip

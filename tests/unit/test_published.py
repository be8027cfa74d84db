"""`predict published` and described models: the published tables' arithmetic, offline, in seconds."""

import json

import pytest

from ddp_lab.analysis.predict import published, torch_estimate
from ddp_lab.analysis.predict.cli import main
from ddp_lab.analysis.predict.scale import described_workload, nccl_seconds, step_ms
from ddp_lab.analysis.predict.systems import SYSTEMS


def test_every_source_cites_repository_path_and_commit():
    for source in published.SOURCES:
        s = published.load(source)["source"]
        assert s["repository"].count("/") == 1 and s["path"] and len(s["commit"]) == 40


@pytest.mark.parametrize("name,total", [("resnet50", 25_557_032), ("resnet101", 44_549_160),
                                        ("resnext50_32x4d", 25_028_904), ("resnext101_32x8d", 88_791_336)])
def test_resnet_descriptions_count_torchvisions_parameters(name, total):
    params = published.resnet_parameters(name)
    assert sum(p["numel"] for p in params) == total
    assert params[0]["name"] == "stem.conv1.weight" and params[-1]["name"] == "fc.bias"


def test_llama3_8b_description_counts_8_03_billion():
    params = published.llama_parameters(published.load("torchtitan")["model"])
    assert sum(p["numel"] for p in params) == 8_030_261_248
    assert len({p["unit"] for p in params}) == 32 + 2


def test_h100_all_reduce_sweep_within_five_percent_from_one_mib():
    rows = published.nccl_rows()
    scored = [r for r in rows if r["scored"]]
    assert len(rows) == 32 and len(scored) == 15
    assert published.mean_abs(scored, "ours_error") < 0.05
    # the regimes a single line cannot follow: LL below a few MiB, LL128, NVLS from 64 MiB
    assert {r["algorithm"] for r in scored} == {"ring/LL", "ring/LL128", "nvls/Simple"}
    # torch's estimator is torch's own function, told the system's generation
    r = scored[-1]
    assert r["torch_us"] == pytest.approx(torch_estimate.collective_s(SYSTEMS["h100-nvlink"], "all_reduce",
                                                                      r["bytes"], 8) * 1e6)
    assert published.mean_abs(scored, "torch_error") > published.mean_abs(scored, "ours_error")


def test_ddp_v100_within_ten_percent_at_every_gpu_count():
    rows = published.ddp_rows()
    assert len(rows) == 20
    assert max(abs(r["ours_error"]) for r in rows) < 0.10
    one = [r for r in rows if r["gpus"] == 1]
    assert all(r["exposed_ms"] == 0 for r in one)  # one GPU: no collective, the compute alone
    sixteen = [r for r in rows if r["gpus"] == 16]
    assert all(r["exposed_ms"] > 0 and r["bucket_1mb_ours"] > 0 for r in sixteen)  # 1 MiB buckets cost


def test_torchtitan_growth_is_calibrated_at_eight_and_predicted_at_128():
    rows = published.torchtitan_rows()
    assert [r["model"] for r in rows] == ["ddp-lab", "torch's estimator"]
    for r in rows:
        assert r["base_step_ms"] == pytest.approx(2 * 8192 / 5762 * 1e3, rel=1e-4)
        assert r["measured_growth"] == pytest.approx(5762 / 5605 - 1)
        assert r["predicted_growth"] == pytest.approx(r["step_ms"] / r["base_step_ms"] - 1)


def test_torchtitans_multi_axis_rows_are_priced_from_one_calibrated_mfu():
    """The MFU makes the planner's price of the calibration row (Table 1, 1D, the same software) the published one;
    every scored row is priced at it, its error and the published layout's place among the planner's reported as
    they are (docs/plan.md reads them)."""
    data = published.load("torchtitan_multi_axis")
    mfu = published.calibrated_mfu(data)
    assert published._priced(data, data["calibration"], mfu).tokens_per_s_per_gpu == pytest.approx(8532, rel=1e-6)
    attention = published.calibrated_attention_mfu(data)
    first = data["rows"][data["attention_calibration_row"]]
    assert published._priced(data, first, mfu, attention).tokens_per_s_per_gpu == pytest.approx(first["tps_per_gpu"],
                                                                                              rel=1e-6)
    assert attention < mfu  # attention does not get Float8's speed
    rows = published.multi_axis_rows(data)
    assert len(rows) == 11 and {r["table"] for r in rows} == {"2", "4", "5", "6"}
    for r in rows:
        assert r["error"] == pytest.approx(r["ours_tps"] / r["tps_per_gpu"] - 1)
        assert r["attention_error"] == pytest.approx(r["attention_tps"] / r["tps_per_gpu"] - 1)
        assert r["place"] is None or 1 <= r["place"] <= r["of"]
    gpus = {r["row"]: r for r in rows}
    assert gpus["1F1B (FSDP 8, TP 8, PP 8)"]["of"] > 100  # the 405B search on 512 GPUs: every layout that divides


def test_published_prints_every_table_with_torch_beside(capsys):
    assert main(["published"]) == 0
    out = capsys.readouterr().out
    for heading in ("NVIDIA DGX H100", "torch DDP benchmark", "torchtitan Llama 3.1 8B",
                    "torchtitan Llama 3.1, FSDP + TP + PP + CP"):
        assert heading in out
    assert out.count("torch's estimator") >= 3 and "46e4201" in out and "bf69c14" in out and "31a17bf" in out


def test_a_described_model_replays_like_the_arithmetic_says(tmp_path):
    # two parameters, 1 ms forward, 2 ms backward; the last parameter's gradient ready after its share
    desc = {"name": "two", "wire_bytes": 4, "compute_ms": {"forward": 1.0, "backward": 2.0, "optimizer": 0.5},
            "parameters": [{"name": "a.weight", "numel": 1000, "backward_flops": 3},
                           {"name": "b.weight", "numel": 3000, "backward_flops": 1}]}
    h100 = SYSTEMS["h100-nvlink"]
    w = described_workload(h100, desc)
    assert [p["bwd_ms"] for p in w.params] == [1.5, 0.5] and [p["unit"] for p in w.params] == ["a", "b"]
    one = step_ms(h100, w, 1, "flat")  # no collective at one GPU; flat still copies its 16 kB in and out
    copies = 2 * (2 * 16000 / h100.hbm_Bps * 1e3)
    assert one["step_ms"] == pytest.approx(3.5 + copies) and one["exposed_ms"] == pytest.approx(copies)
    assert step_ms(h100, w, 1, "bucketed")["step_ms"] == pytest.approx(3.5)
    # zero1 broadcasts each parameter from its owner after the update, as it does on NCCL: one call each
    broadcasts = sum(nccl_seconds(h100, "broadcast", n * 4, 8) * 1e3 for n in (1000, 3000))
    zero1, bucketed = step_ms(h100, w, 8, "zero1"), step_ms(h100, w, 8, "bucketed")
    assert zero1["exposed_ms"] - bucketed["exposed_ms"] == pytest.approx(broadcasts)
    path = tmp_path / "two.json"
    path.write_text(json.dumps(desc))
    assert main(["scale", "--system", "h100-nvlink", "--model", str(path), "--world-size", "1,8",
                 "--strategy", "bucketed,fsdp"]) == 0


def test_a_bad_description_is_one_line(tmp_path, capsys):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"name": "bad", "parameters": [{"name": "x"}]}))
    assert main(["scale", "--model", str(path), "--world-size", "8", "--strategy", "bucketed"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: model description bad") and err.count("\n") == 1
    assert main(["scale", "--model", str(tmp_path / "missing.json")]) == 2

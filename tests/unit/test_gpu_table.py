"""The GPU check's table (ddp_lab/analysis/gpu_table.py) and the × floor, × torch's ratios every table shows,
from recorded results: fabricated job folders as the trainer writes them."""

from ddp_lab.analysis.gpu_table import HEADER, gpu_rows, main
from ddp_lab.analysis.records import job_records, load_runs
from tests.helpers.report_fixtures import train_results, write_job


def _job(root, index, strategy, step_ms, per_collective=True, model="medium", status="ok", compiled=False, **knobs):
    results = train_results(strategy, step_ms=step_ms, world_size=1, status=status)
    results["config"]["model"]["name"] = model
    results["config"]["train"] = {"compile": compiled}
    results["config"]["strategy"].update(knobs)
    results["config"]["measure"] = {"per_collective": per_collective}
    if status == "ok":
        results["summary"]["memory"]["max_memory_allocated_max_rank"] = 3 * 2**30
    return write_job(root / str(index), results)


def _sweeps(tmp_path):
    on, off = tmp_path / "medium", tmp_path / "medium_figures_off"
    for i, (name, step) in enumerate([("none", 60.0), ("bucketed", 99.0), ("torch_ddp", 90.0), ("zero2", 120.0),
                                      ("zero1_torch", 100.0), ("flat", 66.0)]):
        _job(on, i, name, step)
    _job(off, 0, "bucketed", 90.0, per_collective=False)
    _job(off, 1, "torch_ddp", 88.0, per_collective=False)
    _job(off, 2, "zero2", 0.0, per_collective=False, status="failed")
    return [on, off]


def test_each_strategy_beside_the_floor_its_torch_reference_and_itself_with_figures_off(tmp_path):
    rows = {row[1].split("-")[0]: dict(zip(HEADER, row)) for row in gpu_rows(_sweeps(tmp_path))}
    assert rows["none"]["× floor"] == "1.00" and rows["none"]["× torch's"] == "-"
    bucketed = rows["bucketed"]
    assert bucketed["step"] == "99.0" and bucketed["× floor"] == "1.65"
    assert bucketed["× torch's"] == "1.10", "99 over torch_ddp's 90"
    assert bucketed["step, figures off"] == "90.0" and bucketed["on ÷ off"] == "1.100"
    assert bucketed["peak MiB"] == "3072"
    assert rows["torch_ddp"]["on ÷ off"] == "1.023", "the lab's torch_ddp over the bare DDP row"
    assert rows["zero2"]["× torch's"] == "1.20", "zero2's reference is zero1_torch"
    assert rows["zero2"]["step, figures off"] == "failed" and rows["zero2"]["on ÷ off"] == "-"
    assert rows["flat"]["× floor"] == "1.10" and rows["flat"]["step, figures off"] == "-"


def test_ratios_only_within_the_same_work_and_the_same_switch(tmp_path):
    _job(tmp_path, 0, "none", 50.0, model="xl")
    _job(tmp_path, 1, "bucketed", 100.0, model="medium")
    _job(tmp_path, 2, "torch_ddp", 80.0, model="medium", per_collective=False)
    records = {r["strategy"]: r for r in job_records([(n, r) for n, r, _ in load_runs(tmp_path)])}
    assert records["bucketed"]["vs_floor"] is None, "the floor of another model is no floor"
    assert records["bucketed"]["vs_torch"] is None, "a bare reference is no bar for a stamped run"


def test_the_command_writes_the_table_and_refuses_a_missing_folder(tmp_path, capsys):
    roots = _sweeps(tmp_path)
    assert main([str(r) for r in roots] + ["-o", str(tmp_path / "table.md")]) == 0
    assert (tmp_path / "table.md").read_text().startswith("| model | strategy | step |")
    assert main([str(tmp_path / "nowhere")]) == 2
    assert "no such folder" in capsys.readouterr().err


def test_compiled_rows_stand_apart_and_compare_with_compiled_ones(tmp_path):
    for i, (name, step, compiled) in enumerate([("none", 60.0, False), ("bucketed", 99.0, False), ("none", 40.0, True),
                                                 ("bucketed", 48.0, True), ("torch_ddp", 45.0, True)]):
        _job(tmp_path, i, name, step, compiled=compiled, bucket_mb=25.0 if name == "bucketed" else None)
    rows = {row[1]: dict(zip(HEADER, row)) for row in gpu_rows([tmp_path])}
    assert rows["none-compile=inductor"]["× floor"] == "1.00" and rows["none"]["× floor"] == "1.00"
    compiled = rows["bucketed-bucket_mb=25.0-compile=inductor"]
    assert compiled["× floor"] == "1.20", "48 over the compiled floor's 40"
    assert compiled["× torch's"] == "1.07", "over the compiled torch_ddp's 45"
    assert rows["bucketed-bucket_mb=25.0"]["× floor"] == "1.65" and rows["bucketed-bucket_mb=25.0"]["× torch's"] == "-"

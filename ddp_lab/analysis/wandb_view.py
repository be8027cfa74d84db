"""A sweep's W&B comparison: one folder of runs, one saved view of them.

- Every job of a sweep logs its W&B run under SWEEP/wandb (launch.py sets `logger.dir` to the sweep's
  folder; a single run keeps JOB/wandb), so `wandb leet SWEEP/wandb` compares them in the terminal,
  offline, with no account.
- `view_spec(SWEEP)` is the dashboard as data, written to SWEEP/wandb_workspace.json at the end of
  every sweep: runs filtered to the sweep's W&B group and grouped by the config keys the sweep varied,
  and panels for what the lab measures (step time and its phases, exposed comm and overlap, model and
  strategy state per rank, validation loss against step and wall time, bytes per step).
- `publish(SWEEP, "ENTITY/PROJECT")` (`python -m ddp_lab.report SWEEP --publish ENTITY/PROJECT`)
  uploads the runs with `wandb sync` and saves the view with the `wandb-workspaces` package. It checks
  first that it can (the package, a login, a reachable server) and refuses in one line otherwise, so
  nothing is half made.

Config keys: ddp-lab logs its config nested (`strategy: {name, bucket_mb}`); W&B stores each top-level
key as `{"value": ...}`, so a nested key is addressed as `strategy.value.bucket_mb` in a view's
grouping, a top-level one (`world_size`) by its name (`config_key`).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from ddp_lab.analysis.records import load_runs
from ddp_lab.spec.figures import COMM, COMM_BYTES, EXPOSED, FWD_BWD, LOSS, OPTIMIZER, STEP_TIME, SYNC, VAL_LOSS
from ddp_lab.spec.labels import flatten

SPEC = "wandb_workspace.json"
FORMAT = "ddp-lab W&B view 1"
NOT_GROUPED = ("logger.", "hydra.", "launcher.node_rank", "launcher.master_port", "train.seed")

SECTIONS = [
    {"name": "Step time", "panels": [
        {"kind": "bar", "title": "step time p50 (ms)", "summary": [f"{STEP_TIME.key}/p50"]},
        {"kind": "line", "title": "step time (ms)", "x": "Step", "y": [STEP_TIME.key]},
        {"kind": "line", "title": "phases (ms): forward+backward, sync, optimizer", "x": "Step",
         "y": [FWD_BWD.key, SYNC.key, OPTIMIZER.key]},
    ]},
    {"name": "Communication", "panels": [
        {"kind": "bar", "title": "exposed comm p50 (ms)", "summary": [f"{EXPOSED.key}/p50"]},
        {"kind": "bar", "title": "overlap (%)", "summary": ["overlap_pct"]},
        {"kind": "line", "title": "comm in flight and exposed (ms)", "x": "Step", "y": [COMM.key, EXPOSED.key]},
        {"kind": "line", "title": "bytes per step", "x": "Step", "y": [COMM_BYTES.key]},
    ]},
    {"name": "Memory", "panels": [
        {"kind": "bar", "title": "model state per rank (bytes, most-loaded rank)",
         "summary": ["memory/model_state_max_rank"]},
        {"kind": "bar", "title": "strategy state per rank (bytes, most-loaded rank)",
         "summary": ["memory/strategy_state_max_rank"]},
    ]},
    {"name": "Loss", "panels": [
        {"kind": "line", "title": "validation loss against step", "x": "Step", "y": [VAL_LOSS.key]},
        {"kind": "line", "title": "validation loss against wall time", "x": "RelativeTime(Wall)", "y": [VAL_LOSS.key]},
        {"kind": "line", "title": "training loss", "x": "Step", "y": [LOSS.key]},
    ]},
]


class PublishError(Exception):
    """Why a sweep cannot be published: one line for the user."""


def varied_keys(configs: list[dict]) -> list[str]:
    """Config keys (dotted) whose values differ between the jobs, in config order; not the logger's,
    Hydra's or per-job bookkeeping."""
    flats = [flatten(c, ".") for c in configs]
    keys = list(dict.fromkeys(k for f in flats for k in f))
    return [k for k in keys if not k.startswith(NOT_GROUPED) and not k.endswith("_target_")
            and len({json.dumps(f.get(k), sort_keys=True, default=str) for f in flats}) > 1]


def config_key(dotted: str) -> str:
    """How a W&B view addresses a config key ddp-lab logged nested (module docstring)."""
    top, _, rest = dotted.partition(".")
    return f"{top}.value.{rest}" if rest else top


def view_spec(sweep_dir) -> dict:
    """The sweep's W&B view as data (module docstring)."""
    sweep_dir = Path(sweep_dir)
    runs = [res for _, res, _ in load_runs(sweep_dir)]
    configs = [res.get("config") or {} for res in runs]
    logger = next((c.get("logger") for c in configs if c.get("logger")), {}) or {}
    varied = varied_keys(configs)
    return {"format": FORMAT, "name": f"ddp-lab {logger.get('group') or sweep_dir.name}",
            "project": logger.get("project", "ddp-lab"), "group": logger.get("group"),
            "runs_folder": str(sweep_dir / "wandb"), "jobs": len(runs),
            "groupby": [config_key(k) for k in varied], "varied": varied, "sections": SECTIONS}


def write_view_spec(sweep_dir) -> Path:
    path = Path(sweep_dir) / SPEC
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(view_spec(sweep_dir), indent=2) + "\n")
    tmp.replace(path)
    return path


def offline_runs(sweep_dir) -> list[Path]:
    """The sweep's W&B runs, each a folder with its .wandb log, as `wandb leet SWEEP/wandb` lists them."""
    return sorted(p for p in (Path(sweep_dir) / "wandb").glob("*run-*") if p.is_dir() and any(p.glob("*.wandb")))


def workspace(spec: dict, entity: str, project: str):
    """The view as a `wandb_workspaces` Workspace (not saved)."""
    import wandb_workspaces.reports.v2 as wr
    import wandb_workspaces.workspaces as ws
    from wandb_workspaces import expr

    def panel(p):
        if p["kind"] == "bar":
            return wr.BarPlot(title=p["title"], metrics=list(p["summary"]))
        return wr.LinePlot(title=p["title"], x=p["x"], y=list(p["y"]))

    # And(...), not a plain list: wandb-workspaces 0.4.13 deprecates a list of filters (DeprecationWarning)
    group = expr.And(expr.Metric("Group") == spec["group"]) if spec["group"] else []
    return ws.Workspace(
        entity=entity, project=project, name=spec["name"],
        sections=[ws.Section(name=s["name"], panels=[panel(p) for p in s["panels"]], is_open=True)
                  for s in spec["sections"]],
        runset_settings=ws.RunsetSettings(filters=group, groupby=[expr.Config(k) for k in spec["groupby"]]))


def _logged_in() -> bool:
    import wandb

    try:
        return bool(wandb.Api(timeout=10).api_key)
    except Exception:  # noqa: BLE001  (no key, no settings: not logged in)
        return False


def publish(sweep_dir, target: str) -> str:
    """Sync the sweep's runs to ENTITY/PROJECT and save its view; returns the view's URL."""
    sweep_dir = Path(sweep_dir)
    entity, _, project = target.partition("/")
    if not entity or not project or "/" in project:
        raise PublishError(f"--publish takes ENTITY/PROJECT, got {target!r}")
    runs = offline_runs(sweep_dir)
    if not runs:
        raise PublishError(f"no W&B runs under {sweep_dir / 'wandb'} (was the sweep run with logger=none?)")
    try:
        import wandb_workspaces  # noqa: F401
    except ImportError:
        raise PublishError('saving a W&B view needs the wandb-workspaces package: pip install -e ".[dev]"') from None
    if not _logged_in():
        raise PublishError("not logged in to W&B (wandb login, or WANDB_API_KEY): nothing was uploaded")
    try:
        import wandb

        wandb.Api(timeout=10).viewer  # noqa: B018  (a request: is the server reachable?)
    except Exception as exc:  # noqa: BLE001
        raise PublishError(f"W&B's server cannot be reached ({type(exc).__name__}): nothing was uploaded") from None
    spec = view_spec(sweep_dir)
    done = subprocess.run([sys.executable, "-m", "wandb", "sync", "--entity", entity, "--project", project,
                           *map(str, runs)], capture_output=True, text=True)
    if done.returncode != 0:
        raise PublishError(f"wandb sync failed: {(done.stderr or done.stdout).strip().splitlines()[-1:]}")
    view = workspace(spec, entity, project)
    view.save()
    return view.url

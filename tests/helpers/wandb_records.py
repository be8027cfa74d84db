"""Read back an offline W&B run (`run-*.wandb`) so tests can check what was logged.

The file is W&B's transaction log: a 7-byte header (':W&B', magic, version), then LevelDB-style
records in 32 KiB blocks (crc32 4 bytes, length 2 bytes, type 1 byte: full/first/middle/last),
each payload a `wandb_internal_pb2.Record`. wandb 0.31 no longer ships a Python reader for it.
"""

from __future__ import annotations

import json
import struct

from wandb.proto import wandb_internal_pb2

BLOCK = 32 * 1024
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def _payloads(data: bytes):
    pos, pending = HEADER, b""
    while pos + HEADER <= len(data):
        room = BLOCK - pos % BLOCK
        if room < HEADER:  # block trailer padding
            pos += room
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        chunk = data[pos + HEADER:pos + HEADER + length]
        pos += HEADER + length
        if kind == FULL:
            yield chunk
        elif kind == FIRST:
            pending = chunk
        elif kind == MIDDLE:
            pending += chunk
        elif kind == LAST:
            yield pending + chunk
        else:
            break


def read_run(path) -> dict:
    """{'history': [row dicts], 'summary': dict, 'config': dict, 'run': Record.run}."""
    out = {"history": [], "summary": {}, "config": {}, "run": None}
    with open(path, "rb") as f:
        data = f.read()
    for payload in _payloads(data):
        rec = wandb_internal_pb2.Record()
        rec.ParseFromString(payload)
        kind = rec.WhichOneof("record_type")
        if kind == "history":
            out["history"].append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                                   for item in rec.history.item})
        elif kind == "summary":
            for item in rec.summary.update:
                out["summary"][item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
        elif kind == "config":
            for item in rec.config.update:
                out["config"][item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
        elif kind == "run":
            out["run"] = rec.run
            for item in rec.run.config.update:
                out["config"][item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return out


def run_file_of_job(job_dir) -> str:
    """The .wandb log of the job's offline run: under the sweep's folder (SWEEP/wandb, every job of a
    sweep) or the job's own (a single run), found by the job folder its notes name."""
    from pathlib import Path

    job_dir = Path(job_dir).absolute()
    for folder in (job_dir / "wandb", job_dir.parent / "wandb"):
        for path in sorted(folder.glob("*run-*/run-*.wandb")):
            run = read_run(path)["run"]
            if run is not None and run.notes == f"job folder: {job_dir}":
                return str(path)
    raise FileNotFoundError(f"no W&B run of {job_dir}")

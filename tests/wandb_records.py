"""Read an offline wandb run (`run-<id>.wandb`) without the wandb service: what a test needs to check
what a run logged. The file is a LevelDB-style log (wandb's datastore format): a 7-byte header, then
32 KiB blocks of records, each with a 7-byte header (crc32, length, type: full/first/middle/last) and
a protobuf `Record` payload, split across blocks when it does not fit.
"""
from __future__ import annotations

import json
import struct
from pathlib import Path

from wandb.proto import wandb_internal_pb2 as pb

BLOCK = 32768
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def _payloads(data: bytes):
    assert data[:4] == b":W&B", "not a wandb datastore file"
    pos, parts = 7, []
    while pos + 7 <= len(data):
        room = BLOCK - pos % BLOCK
        if room < 7:  # block tail too short for a header: padding
            pos += room
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:
            pos += room  # zero padding up to the next block
            continue
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == FULL:
            yield chunk
        elif kind == FIRST:
            parts = [chunk]
        elif kind == MIDDLE:
            parts.append(chunk)
        elif kind == LAST:
            parts.append(chunk)
            yield b"".join(parts)


def read_run(path: str | Path) -> dict:
    """{"run": {id, group, job_type}, "history": [{key: value}], "summary": {key: value}} of one file."""
    out = {"run": {}, "history": [], "summary": {}}
    for payload in _payloads(Path(path).read_bytes()):
        rec = pb.Record()
        rec.ParseFromString(payload)
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            out["run"] = {"id": rec.run.run_id, "group": rec.run.run_group, "job_type": rec.run.job_type}
        elif kind == "history":
            out["history"].append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json)
                                   for i in rec.history.item})
        elif kind == "summary":
            for i in rec.summary.update:
                out["summary"][i.key or "/".join(i.nested_key)] = json.loads(i.value_json)
    return out

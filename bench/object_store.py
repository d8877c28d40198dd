"""Checkpoints straight into an object store: a local S3 server (moto), two gloo ranks, sharded state.

    python bench/object_store.py [--params 100M] [--width 4096] [--repeats 3] [--start-method spawn]
                                 [--json PATH]

The sharded benchmark's model (bench/sharded.py: FSDP2 over square nn.Linear blocks, AdamW, two gloo ranks on
the CPU, spawned or with ``--start-method fork`` forked) saves its state registry into ``s3://`` on a moto
server started here:

  dcp into the store    our Checkpointer, mode dcp: every rank streams its shards into its own object
                        (ObjectStoreWriter: multipart as it fills, CRC32 on the way), rank 0 writes
                        ``extra.pt``, DCP's ``.metadata`` and, once the listing shows every file, the marker
  multipart upload      the same number of bytes per rank, already in memory, put by both ranks at once
                        with s3fs's ``pipe_file`` (concurrent multipart parts): the store's own rate, with
                        nothing of ours and no serialisation
  async into the store  mode async: the time ``save`` blocks training, against one in-memory copy
                        (``clone``) of this rank's part of the state, timed on the same rank

Ratios: ``dcp bytes/s over multipart bytes/s`` (target >= 0.7) and ``async blocking over one in-memory
copy`` (target <= 0.1). The time from SIGTERM to the agreed step committed in the store is measured by
bench/preemption.py. moto keeps objects in memory: what this measures is our path to the store (HTTP,
serialisation, checksums, the commit), not a real store's network.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from a source checkout

from bench.checkpoint import parse_count  # noqa: E402
from bench.s3_server import local_s3  # noqa: E402
from bench.sharded import Run, run_ranks, steady  # noqa: E402
from bench.tables import markdown_table  # noqa: E402
from traincore.checkpoint import Checkpointer, Store  # noqa: E402
from traincore.config.schema import CheckpointConfig  # noqa: E402

TARGETS = {"dcp bytes/s over multipart bytes/s": ">= 0.7", "async blocking over one in-memory copy": "<= 0.1"}


def _saves(run: Run, root: Store, mode: str, repeats: int, rank: int
           ) -> tuple[list[float], list[float], int]:
    """``repeats`` saves in ``mode``: the seconds each blocked, the seconds each took to commit, the bytes
    of the last checkpoint (rank 0)."""
    checkpointer = Checkpointer(root, CheckpointConfig(mode=mode, keep_last=1), run.registry, rank, 2)
    blocked, committed = [], []
    try:
        for _ in range(repeats):
            run.train(1, checkpointer.wait_for_snapshot)
            dist.barrier()
            start = time.perf_counter()
            checkpointer.save(run.progress.step)
            blocked.append(time.perf_counter() - start)
            checkpointer.wait()
            committed.append(time.perf_counter() - start)
    finally:
        checkpointer.close()
    return blocked, committed, checkpointer.last_save.num_bytes if rank == 0 else 0


def _multipart(root: Store, num_bytes: int, repeats: int) -> list[float]:
    """Seconds for both ranks to put ``num_bytes`` each (already in memory) as one object each."""
    data = torch.randint(0, 256, (num_bytes,), dtype=torch.uint8).numpy().tobytes()
    seconds = []
    for index in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        root.fs.pipe_file(root.uri_of(f"upload-{index}/rank-{dist.get_rank()}"), data)
        dist.barrier()
        seconds.append(time.perf_counter() - start)
    return seconds


def store_phase(rank: int, opts: dict) -> dict:
    """On this rank: dcp saves, the plain uploads of as many bytes, async saves, one in-memory copy."""
    run = Run(opts["params"], opts["width"], "fsdp", rank, keep_grads=True)
    run.train(1)
    root = Store(opts["root"], opts["storage_options"])
    _, dcp_committed, checkpoint_bytes = _saves(run, root.child("dcp"), "dcp", opts["repeats"], rank)
    own = next(entry for name, entry in _marker_files(root.child("dcp")).items()
               if name == f"__{rank}_0.distcp")["bytes"]
    uploads = _multipart(root.child("plain"), own, opts["repeats"])
    async_blocked, async_committed, _ = _saves(run, root.child("async"), "async", opts["repeats"], rank)
    local = [t.to_local() if hasattr(t, "to_local") else t for t in run.state_tensors()]
    copies = []
    for _ in range(opts["repeats"]):
        start = time.perf_counter()
        [tensor.clone() for tensor in local]
        copies.append(time.perf_counter() - start)
    return {"checkpoint_bytes": checkpoint_bytes, "shard_bytes": own, "dcp_committed": dcp_committed,
            "uploads": uploads, "async_blocked": async_blocked, "async_committed": async_committed,
            "copy": copies, "local_bytes": sum(t.numel() * t.element_size() for t in local)}


def _marker_files(root: Store) -> dict:
    from traincore.checkpoint import complete_steps, read_marker, step_store

    return read_marker(step_store(root, complete_steps(root)[-1]))["files"]


def rows_of(ranks: list[dict]) -> tuple[list[dict], dict[str, float]]:
    zero = ranks[0]
    both_shards = sum(rank["shard_bytes"] for rank in ranks)
    dcp_s, upload_s = steady(zero["dcp_committed"]), steady(zero["uploads"])
    rows = [
        {"case": "dcp into the store (ours)", "bytes_mb": zero["checkpoint_bytes"] / 1e6,
         "seconds": dcp_s, "mb_per_s": zero["checkpoint_bytes"] / dcp_s / 1e6, "blocks_s": None},
        {"case": "multipart upload of the shards' bytes (s3fs pipe_file)", "bytes_mb": both_shards / 1e6,
         "seconds": upload_s, "mb_per_s": both_shards / upload_s / 1e6, "blocks_s": None},
        {"case": "async into the store (ours)", "bytes_mb": zero["checkpoint_bytes"] / 1e6,
         "seconds": steady(zero["async_committed"]), "mb_per_s": None,
         "blocks_s": steady(zero["async_blocked"])},
        {"case": "one in-memory copy of rank 0's state", "bytes_mb": zero["local_bytes"] / 1e6,
         "seconds": steady(zero["copy"]), "mb_per_s": zero["local_bytes"] / steady(zero["copy"]) / 1e6,
         "blocks_s": None},
    ]
    ratios = {"dcp bytes/s over multipart bytes/s": rows[0]["mb_per_s"] / rows[1]["mb_per_s"],
              "async blocking over one in-memory copy": rows[2]["blocks_s"] / rows[3]["seconds"]}
    return rows, ratios


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=parse_count, default=100_000_000, help="model parameters, e.g. 100M")
    parser.add_argument("--width", type=int, default=4096, help="width of each square nn.Linear block")
    parser.add_argument("--repeats", type=int, default=3, help="saves per mode (the first one shown apart)")
    parser.add_argument("--timeout", type=float, default=1200, help="seconds the two ranks may take")
    parser.add_argument("--start-method", choices=("spawn", "fork"), default="spawn",
                        help="how the ranks start: fresh interpreters (spawn, as measured) or forked from "
                             "this process (fork: seconds less start-up, for smoke runs)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results to this JSON file")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-object-store-") as tmp, local_s3(Path(tmp)) as s3:
        opts = {"params": args.params, "width": args.width, "repeats": args.repeats,
                "root": f"s3://{s3.bucket}/bench-{uuid.uuid4().hex[:8]}",
                "storage_options": s3.storage_options}
        ranks = run_ranks(store_phase, opts, Path(tmp), args.timeout, args.start_method)
    rows, ratios = rows_of(ranks)
    print(markdown_table(rows) + "\n")
    print(markdown_table([{"ratio": name, "value": value, "target": TARGETS[name]}
                          for name, value in ratios.items()]), flush=True)
    if args.json:
        shard_mb = statistics.median(rank["shard_bytes"] for rank in ranks) / 1e6
        notes = [f"Medians of {args.repeats} rounds without the first; {shard_mb:.0f} MB per rank."]
        args.json.write_text(json.dumps({"benchmark": "object_store", "results": rows, "ratios": ratios,
                                         "targets": TARGETS, "notes": notes}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Checkpoints straight into an object store: a local S3 server (moto), two gloo ranks, sharded state.

    python bench/object_store.py [--params 100M] [--width 4096] [--repeats 3] [--start-method spawn]
                                 [--json PATH]

The sharded benchmark's model (bench/sharded.py: FSDP2 over square nn.Linear blocks, AdamW, two gloo ranks on
the CPU, spawned or with ``--start-method fork`` forked) saves its state registry into ``s3://`` on a moto
server started here:

  dcp into the store    our Checkpointer, mode dcp: every rank streams its shards into its own object
                        (ObjectStoreWriter over traincore.checkpoint.upload: 8 MiB parts, 8 at once, CRC32
                        on the way), rank 0 writes ``extra.pt``, DCP's ``.metadata`` and, once the listing
                        shows every file, the marker
  boto3 upload_file     the baseline: the same number of bytes per rank, from a local file, put by both ranks
                        at once with boto3's ``upload_file`` and its default transfer config (8 MiB parts, 10
                        threads): the fastest plain client, with nothing of ours and no serialisation
  dcp load (ours)       ``Checkpointer.load`` of the last dcp save: every rank reads its shards back from the
                        store (concurrent ranged GETs) into the run's tensors
  boto3 download_file   the baseline for loading: each rank downloads its own shard object to a local file
  async into the store  mode async: the time ``save`` blocks training, against one in-memory copy
                        (``clone``) of this rank's part of the state, timed on the same rank

Ratios: ``dcp bytes/s over boto3 upload_file bytes/s`` and ``dcp load bytes/s over boto3 download_file
bytes/s`` (targets >= 0.8), ``async blocking over one in-memory copy`` (target <= 0.1). The time from SIGTERM
to the agreed step committed in the store is measured by bench/preemption.py. moto keeps objects in memory:
what this measures is our path to the store (HTTP, serialisation, checksums, the commit), not a real store's
network.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from a source checkout

from bench.checkpoint import parse_count  # noqa: E402
from bench.s3_server import local_s3  # noqa: E402
from bench.sharded import Run, run_ranks, steady  # noqa: E402
from bench.tables import markdown_table  # noqa: E402
from traincore.checkpoint import Checkpointer, Store  # noqa: E402
from traincore.config.schema import CheckpointConfig  # noqa: E402

TARGETS = {"dcp bytes/s over boto3 upload_file bytes/s": ">= 0.8",
           "dcp load bytes/s over boto3 download_file bytes/s": ">= 0.8",
           "async blocking over one in-memory copy": "<= 0.1"}


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


def _client(opts: dict):
    """A boto3 S3 client on the bench's store, with the credentials the checkpoints use."""
    import boto3

    options = opts["storage_options"]
    return boto3.client("s3", endpoint_url=options["client_kwargs"]["endpoint_url"], region_name="us-east-1",
                        aws_access_key_id=options["key"], aws_secret_access_key=options["secret"])


def _timed_on_both(action: Callable[[int], Any], repeats: int) -> list[float]:
    """Seconds for both ranks to do ``action(round)`` at once, ``repeats`` rounds."""
    seconds = []
    for index in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        action(index)
        dist.barrier()
        seconds.append(time.perf_counter() - start)
    return seconds


def _boto3(opts: dict, root: Store, own: Store, num_bytes: int, scratch: Path
           ) -> tuple[list[float], list[float]]:
    """Seconds of boto3's upload_file of ``num_bytes`` (a local file) and of its download_file of this
    rank's shard object (``own``), both ranks at once."""
    client, rank = _client(opts), dist.get_rank()
    bucket, _, prefix = root.uri.removeprefix("s3://").partition("/")
    source = scratch / f"upload-{rank}.bin"
    source.write_bytes(torch.randint(0, 256, (num_bytes,), dtype=torch.uint8).numpy().tobytes())
    uploads = _timed_on_both(lambda i: client.upload_file(str(source), bucket, f"{prefix}/plain-{i}/{rank}"),
                             opts["repeats"])
    key = own.uri.removeprefix(f"s3://{bucket}/")
    downloads = _timed_on_both(lambda i: client.download_file(bucket, key, str(scratch / f"down-{rank}.bin")),
                               opts["repeats"])
    return uploads, downloads


def _loads(run: Run, root: Store, repeats: int, rank: int) -> list[float]:
    """Seconds for both ranks to load the last checkpoint under ``root`` into the run's tensors."""
    checkpointer = Checkpointer(root, CheckpointConfig(mode="dcp", verify_on_load=False), run.registry,
                                rank, 2)
    try:
        return _timed_on_both(lambda _: checkpointer.load(), repeats)
    finally:
        checkpointer.close()


def store_phase(rank: int, opts: dict) -> dict:
    """On this rank: dcp saves and loads, boto3's transfers of as many bytes, async saves, one in-memory
    copy."""
    run = Run(opts["params"], opts["width"], "fsdp", rank, keep_grads=True)
    run.train(1)
    root = Store(opts["root"], opts["storage_options"])
    _, dcp_committed, checkpoint_bytes = _saves(run, root.child("dcp"), "dcp", opts["repeats"], rank)
    shard, own = _own_shard(root.child("dcp"), rank)
    loads = _loads(run, root.child("dcp"), opts["repeats"], rank)
    with tempfile.TemporaryDirectory(prefix="bench-boto3-") as scratch:
        uploads, downloads = _boto3(opts, root, shard, own, Path(scratch))
    async_blocked, async_committed, _ = _saves(run, root.child("async"), "async", opts["repeats"], rank)
    local = [t.to_local() if hasattr(t, "to_local") else t for t in run.state_tensors()]
    copies = []
    for _ in range(opts["repeats"]):
        start = time.perf_counter()
        [tensor.clone() for tensor in local]
        copies.append(time.perf_counter() - start)
    return {"checkpoint_bytes": checkpoint_bytes, "shard_bytes": own, "dcp_committed": dcp_committed,
            "loads": loads, "uploads": uploads, "downloads": downloads, "async_blocked": async_blocked,
            "async_committed": async_committed, "copy": copies,
            "local_bytes": sum(t.numel() * t.element_size() for t in local)}


def _own_shard(root: Store, rank: int) -> tuple[Store, int]:
    """This rank's data file in the last committed step under ``root`` (a Store of it) and its size."""
    from traincore.checkpoint import complete_steps, read_marker, step_store

    step = step_store(root, complete_steps(root)[-1])
    name = f"__{rank}_0.distcp"
    return step.child(name), read_marker(step)["files"][name]["bytes"]


def rows_of(ranks: list[dict]) -> tuple[list[dict], dict[str, float]]:
    zero = ranks[0]
    both_shards = sum(rank["shard_bytes"] for rank in ranks)
    dcp_s, upload_s = steady(zero["dcp_committed"]), steady(zero["uploads"])
    load_s, download_s = steady(zero["loads"]), steady(zero["downloads"])

    def transfer(case: str, num_bytes: int, seconds: float) -> dict:
        return {"case": case, "bytes_mb": num_bytes / 1e6, "seconds": seconds,
                "mb_per_s": num_bytes / seconds / 1e6, "blocks_s": None}

    rows = [
        transfer("dcp into the store (ours)", zero["checkpoint_bytes"], dcp_s),
        transfer("boto3 upload_file of the shards' bytes", both_shards, upload_s),
        transfer("dcp load from the store (ours)", both_shards, load_s),
        transfer("boto3 download_file of the shards", both_shards, download_s),
        {"case": "async into the store (ours)", "bytes_mb": zero["checkpoint_bytes"] / 1e6,
         "seconds": steady(zero["async_committed"]), "mb_per_s": None,
         "blocks_s": steady(zero["async_blocked"])},
        transfer("one in-memory copy of rank 0's state", zero["local_bytes"], steady(zero["copy"])),
    ]
    ratios = {"dcp bytes/s over boto3 upload_file bytes/s": rows[0]["mb_per_s"] / rows[1]["mb_per_s"],
              "dcp load bytes/s over boto3 download_file bytes/s": rows[2]["mb_per_s"] / rows[3]["mb_per_s"],
              "async blocking over one in-memory copy": rows[4]["blocks_s"] / rows[5]["seconds"]}
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

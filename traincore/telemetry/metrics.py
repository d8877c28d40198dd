"""What the training loop measures: FLOPs per sample, device peak FLOP/s, memory, interval meters.

Nothing here writes anywhere; :mod:`traincore.telemetry.reporting` turns these figures into log lines and sink
records.
"""

from __future__ import annotations

import logging
import os
import re
import resource
import sys
import time

import torch
from torch import nn

from traincore.data import DIGEST_MODULUS

logger = logging.getLogger(__name__)

GIB = float(2**30)
PEAK_FLOPS_ENV = "TRAINCORE_PEAK_FLOPS"


def training_flops_per_sample(model: nn.Module, shape: tuple[int, int, int]) -> float:
    """Training FLOPs of one sample of ``shape`` (C, H, W): 3x the forward FLOPs.

    Convention (as in PaLM and TorchTitan): only matrix multiplies and convolutions are counted,
    2 FLOPs per multiply-accumulate, so bias adds, activations and norms are left out; the backward
    pass costs twice the forward (input and weight gradients). The forward runs on meta tensors, so
    it is instant, allocates nothing and leaves the model's weights and buffers (BatchNorm running
    stats) untouched. Pass the model before ``torch.compile`` / DDP wrapping.
    """
    from torch.func import functional_call
    from torch.utils.flop_counter import FlopCounterMode

    meta_state = {name: torch.empty_like(t, device="meta")
                  for name, t in model.state_dict(keep_vars=True).items()}
    dtype = next((p.dtype for p in model.parameters()), torch.float32)
    sample = torch.empty((1, *shape), dtype=dtype, device="meta")
    with FlopCounterMode(display=False) as counter:
        functional_call(model, meta_state, (sample,))
    return 3.0 * counter.get_total_flops()


# Dense (no 2:4 sparsity) tensor-core peaks per GPU, from NVIDIA's datasheets, which print the
# sparse figure: dense = sparse / 2. Checked in order, so the more specific names come first.
# There is no NVIDIA datasheet for the AWS A10G (its tensor rate differs from the A10), so it is
# deliberately absent: it takes the unknown-device path and TRAINCORE_PEAK_FLOPS.
_BF16_FP16 = (torch.bfloat16, torch.float16)
_PEAK_TABLE: list[tuple[str, dict[torch.dtype, float]]] = [
    # H100 datasheet: BF16/FP16 SXM 1,979 / NVL 1,671 / PCIe 1,513 TFLOPS with sparsity.
    (r"\bH100\b.*\bNVL\b", dict.fromkeys(_BF16_FP16, 835.5e12)),
    (r"\bH100\b.*\bPCIE\b", dict.fromkeys(_BF16_FP16, 756.5e12)),
    (r"\bH100\b", dict.fromkeys(_BF16_FP16, 989.5e12)),
    # H200 datasheet: BF16/FP16 SXM 1,979 / NVL 1,671 TFLOPS with sparsity; GH200 datasheet: 1,979.
    (r"\bH200\b.*\bNVL\b", dict.fromkeys(_BF16_FP16, 835.5e12)),
    (r"\bG?H200\b", dict.fromkeys(_BF16_FP16, 989.5e12)),
    # A100 datasheet (SXM and PCIe, 40 and 80 GB): BF16/FP16 624 TFLOPS with sparsity.
    (r"\bA100\b", dict.fromkeys(_BF16_FP16, 312e12)),
    # A10 datasheet: BF16/FP16 250 TFLOPS with sparsity.
    (r"\bA10\b", dict.fromkeys(_BF16_FP16, 125e12)),
    # L40S datasheet: 733 TFLOPS with sparsity; L40: 362.1; L4: 242.
    (r"\bL40S\b", dict.fromkeys(_BF16_FP16, 362.05e12)),
    (r"\bL40\b", dict.fromkeys(_BF16_FP16, 181.05e12)),
    (r"\bL4\b", dict.fromkeys(_BF16_FP16, 121e12)),
    # V100 datasheet: FP16 tensor 130 (V100S) / 112 (PCIe) / 125 (SXM2) TFLOPS, no sparsity, no BF16.
    (r"\bV100S\b", {torch.float16: 130e12}),
    (r"\bV100\b.*\bPCIE\b", {torch.float16: 112e12}),
    (r"\bV100\b", {torch.float16: 125e12}),
    # T4 datasheet: FP16 mixed precision 65 TFLOPS, no BF16.
    (r"\bT4\b", {torch.float16: 65e12}),
]
_warned_devices: set[str] = set()


def peak_flops(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> float | None:
    """Dense peak FLOP/s of one ``device`` for ``dtype``, or None when it is not known.

    ``TRAINCORE_PEAK_FLOPS`` (e.g. ``989.5e12``) overrides the table for any device. An unknown
    device, an unsupported dtype or a CPU returns None with a one-time warning: MFU against another
    device's peak would be a wrong number that looks right.
    """
    override = os.environ.get(PEAK_FLOPS_ENV)
    if override:
        return _parse_peak_override(override)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    for pattern, peaks in _PEAK_TABLE:
        if re.search(pattern, name.upper()):
            if dtype in peaks:
                return peaks[dtype]
            _warn_once(f"{name}/{dtype}", f"device {name!r} has no tensor-core peak for {dtype}")
            return None
    _warn_once(name, f"peak FLOP/s of device {name!r} is unknown")
    return None


def _parse_peak_override(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0 or value == float("inf"):
        raise ValueError(f"{PEAK_FLOPS_ENV}={text!r} is not a positive number of FLOP/s; "
                         f"set the device's dense peak, e.g. {PEAK_FLOPS_ENV}=989.5e12, or unset it")
    return value


def _warn_once(key: str, reason: str) -> None:
    if key not in _warned_devices:
        _warned_devices.add(key)
        logger.warning("%s: MFU is not reported; set %s=<dense FLOP/s> to enable it", reason, PEAK_FLOPS_ENV)


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[int, int]:
    """Bytes of the parameters and of the optimizer state this rank holds: its own shards under FSDP
    (about 1/N of the whole each), a full copy under DDP."""
    def local(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to_local() if hasattr(tensor, "to_local") else tensor

    params = sum(local(p).nbytes for p in model.parameters())
    optim = sum(local(value).nbytes for state in optimizer.state.values() for value in state.values()
                if isinstance(value, torch.Tensor))
    return params, optim


def host_rss_gib() -> float:
    """Resident set size of this process in GiB (peak RSS where /proc is unavailable)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / GIB
    except OSError:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak / GIB if sys.platform == "darwin" else peak * 1024 / GIB  # bytes on macOS, KiB elsewhere


def memory_metrics(device: torch.device) -> dict[str, float]:
    """Host RSS and, on CUDA, the allocator's peaks since the last reset, retries and OOM count.

    Allocation retries mean the caching allocator had to free cached blocks and try again: the
    run is close to the memory limit and pays for it in speed long before an OOM.
    """
    metrics = {"host_rss_gib": host_rss_gib()}
    if device.type == "cuda":
        stats = torch.cuda.memory_stats(device)
        metrics.update(
            cuda_max_allocated_gib=torch.cuda.max_memory_allocated(device) / GIB,
            cuda_max_reserved_gib=torch.cuda.max_memory_reserved(device) / GIB,
            cuda_alloc_retries=float(stats.get("num_alloc_retries", 0)),
            cuda_ooms=float(stats.get("num_ooms", 0)),
        )
    return metrics


class WaitTimer:
    """Context manager adding the seconds spent inside it to ``seconds``; reused every step."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.first_entry: float | None = None
        self._entered = 0.0

    def __enter__(self) -> WaitTimer:
        self._entered = time.perf_counter()
        if self.first_entry is None:
            self.first_entry = self._entered
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.seconds += time.perf_counter() - self._entered


class IntervalMeter:
    """Loss sum, step count and sample digest of one logging interval; the loss stays on its device until
    reduced."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.reset()

    def reset(self) -> None:
        """Start a new interval."""
        self.steps = 0
        self.digest = 0
        self._loss_sum = torch.zeros((), dtype=torch.float32, device=self.device)

    def add(self, loss: torch.Tensor, digest: int = 0) -> None:
        """Record one step's mean batch loss (one device add, no host sync: no ``.item()``) and the digest
        of the samples this rank took in it (traincore.data.loader.sample_digest)."""
        self._loss_sum += loss.detach().float()
        self.digest = (self.digest + digest) % DIGEST_MODULUS
        self.steps += 1

    def reduce(self) -> tuple[float, int]:
        """Mean loss of the interval and the digest of its samples, over all ranks: one all-reduce when a
        process group exists. The digest travels as two 31-bit halves, which float64 sums exactly."""
        halves = (self.digest >> 31, self.digest & (2**31 - 1))
        total = torch.tensor([0.0, float(self.steps), *map(float, halves)], dtype=torch.float64,
                             device=self.device)
        total[0] = self._loss_sum  # stays on the device: no sync before the all-reduce
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(total)
        loss_sum, count, high, low = total.tolist()
        return loss_sum / max(count, 1.0), ((int(high) << 31) + int(low)) % DIGEST_MODULUS


class RunTotals:
    """Whole-run counters behind ``Telemetry.summary``; checkpointable so a resumed run keeps them."""

    def __init__(self) -> None:
        self.steps = 0
        self.samples = 0.0
        self.seconds = 0.0
        self.wait_seconds = 0.0
        self.steady_samples = 0.0
        self.steady_seconds = 0.0
        self.final_loss = float("nan")

    def add_interval(self, steps: int, samples: float, seconds: float, wait_seconds: float,
                     loss: float, warmup: bool) -> None:
        """Fold in one interval; warm-up intervals (compilation, autotuning) skip the throughput mean."""
        self.steps += steps
        self.samples += samples
        self.seconds += seconds
        self.wait_seconds += wait_seconds
        self.final_loss = loss
        if not warmup:
            self.steady_samples += samples
            self.steady_seconds += seconds

    def state_dict(self) -> dict[str, float]:
        """The counters as plain numbers."""
        return dict(vars(self))

    def load_state_dict(self, state: dict[str, float]) -> None:
        """Restore counters saved by ``state_dict``; unknown keys are rejected by name."""
        unknown = set(state) - set(vars(self))
        if unknown:
            raise ValueError(f"telemetry state has unknown keys {sorted(unknown)}; "
                             "it was saved by a different version: resume without it")
        vars(self).update(state)

"""One tree of config dataclasses, shared by the CLIs, the Flyte tasks and the tests.

Every dataclass validates itself in ``__post_init__`` and raises :class:`ConfigError` with a message that
names the field, the bad value and what is allowed. Each field's attribute docstring is its documentation
(``traincore.config.doc`` renders them into docs/config.md). Presets live in ``traincore.config.presets``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass, field
from typing import Any


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field and the fix."""


def _check(ok: bool, name: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ConfigError(f"{name}={value!r} is invalid: {allowed}")


_EXPECTED = {
    "bool": "true or false (a JSON boolean)",
    "int": "an integer (a JSON number without a fraction)",
    "float": "a number",
    "str": "a string",
    "dict": "a JSON object",
    "list": "a JSON list",
}


_TRUE, _FALSE = ("true", "yes", "on", "1"), ("false", "no", "off", "0")


def _meant(value: Any, kind: str) -> tuple[bool, Any]:
    """(True, the value of ``kind`` that ``value`` means), or (False, None): "8" -> 8, "no" -> False."""
    try:
        if kind == "bool" and isinstance(value, (str, int)) and str(value).strip().lower() in _TRUE + _FALSE:
            return True, str(value).strip().lower() in _TRUE
        if kind == "int" and isinstance(value, str):
            return True, int(value.strip())
        if kind == "int" and isinstance(value, float) and value.is_integer():
            return True, int(value)
        if kind == "float" and isinstance(value, str):
            number = float(value.strip())
            return math.isfinite(number), number
        if kind == "str" and isinstance(value, (int, float)) and not isinstance(value, bool):
            return True, str(value)
    except ValueError:
        pass
    return False, None


def _type_error(name: str, value: Any, kind: str) -> ConfigError:
    """The ConfigError for ``value`` not being of ``kind``, with the spelling that would have worked."""
    known, meant = _meant(value, kind)
    hint = f"; write e.g. {{{json.dumps(name)}: {json.dumps(meant)}}}" if known else ""
    return ConfigError(f"{name}={value!r} is invalid: expected {_EXPECTED[kind]}, got "
                       f"{type(value).__name__}{hint}")


def _check_types(section: Any, prefix: str) -> None:
    """Every field of ``section`` must hold its annotated type: bool is bool (not "no" or 1), int is int (not
    bool, not 8.0), float is int or float (finite, not bool), str is str. Runs before any range check."""
    for spec in dataclasses.fields(section):
        kind = spec.type if isinstance(spec.type, str) else spec.type.__name__
        value, name = getattr(section, spec.name), f"{prefix}.{spec.name}"
        if kind == "bool":
            ok = isinstance(value, bool)
        elif kind == "int":
            ok = isinstance(value, int) and not isinstance(value, bool)
        elif kind == "float":
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
            if ok and not math.isfinite(value):
                raise ConfigError(f"{name}={value!r} is invalid: expected a finite number")
        elif kind == "str":
            ok = isinstance(value, str)
        elif kind == "dict":
            ok = isinstance(value, dict)
        elif kind == "list":
            ok = isinstance(value, list)
        else:  # a new field type must be added here, not silently skipped
            raise TypeError(f"{type(section).__name__}.{spec.name}: no type check for {kind!r}")
        if not ok:
            raise _type_error(name, value, kind)


def _at_most(section: Any, prefix: str, **highs: int) -> None:
    """Each named (already type-checked) field of ``section`` must be <= its given upper bound."""
    for name, high in highs.items():
        value = getattr(section, name)
        _check(value <= high, f"{prefix}.{name}", value, f"must be <= {high}")


def _digits(text: str) -> bool:
    """True for a non-empty run of ASCII digits ("12"); "²" and "١٢" are digits to str.isdigit, not to int."""
    return text.isascii() and text.isdigit()


def _ints(section: Any, prefix: str, **lows: int) -> None:
    """Each named field of ``section`` must be an integer (not a bool) >= its given lower bound."""
    for name, low in lows.items():
        value = getattr(section, name)
        _check(isinstance(value, int) and not isinstance(value, bool) and value >= low, f"{prefix}.{name}",
               value, f"must be an integer >= {low}")


def _json_object(name: str, value: Any) -> None:
    """``value`` must be a JSON object: a dict with string keys whose values JSON can write."""
    _check(isinstance(value, dict) and all(isinstance(key, str) for key in value), name, value,
           "expected a JSON object with string keys")
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{name}={value!r} is invalid: it must hold JSON values only ({exc})") from exc


def _one_of(name: str, value: Any, choices: tuple[str, ...]) -> None:
    _check(value in choices, name, value, f"must be one of {', '.join(choices)}")


SOURCE_KINDS = ("digits", "synthetic", "imagefolder", "python")
IMAGENET_MEAN = [0.485, 0.456, 0.406]
IMAGENET_STD = [0.229, 0.224, 0.225]
"""The normalisation torchvision's ImageNet weights were trained with (data.mean, data.std)."""
MODEL_NAMES = ("small_cnn", "resnet18", "resnet34", "resnet50", "vit_b_16", "vit_tiny", "mlp")
_IMPORT_PATH = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")
FACTORY_ARGUMENTS = ("num_classes", "in_channels", "image_size")
"""What an imported model factory is called with, from the staged data, besides model.kwargs."""
OWN_MODELS = ("small_cnn", "mlp")
"""The models traincore.model.build defines itself (they take model.width); the others come from
torchvision."""
CHECKPOINT_MODES = ("sync", "dcp", "async")
WANDB_MODES = ("disabled", "offline", "online")
DIST_BACKENDS = ("auto", "gloo", "nccl", "cpu:gloo,cuda:nccl")
PARALLELISMS = ("ddp", "fsdp")
OPTIMIZERS = ("adamw", "sgd")
LR_SCHEDULES = ("cosine", "linear", "step", "constant", "onecycle")
VALIDATION_METRICS = ("val_accuracy", "val_loss")
"""What train.metric may name; accuracy is better higher, loss lower."""
MAX_SEED = 2**63 - 1  # seed + rank must fit torch.manual_seed's 64 bits
MAX_TIMEOUT_S = 2**31 - 1  # process-group timeouts travel as int64 milliseconds


def parse_source(source: str) -> tuple[str, str]:
    """Split ``"imagefolder:/path"`` into ``("imagefolder", "/path")`` and ``"python:pkg.data:build"`` into
    ``("python", "pkg.data:build")``; other kinds have no argument."""
    kind, _, arg = source.partition(":")
    if kind not in SOURCE_KINDS:
        raise ConfigError(f"data.source={source!r} is unknown: use 'digits', 'synthetic', "
                          "'imagefolder:<path-or-URI>' or 'python:<module>:<callable>'")
    if kind in ("imagefolder", "python") and not arg:
        where = "<path-or-URI>" if kind == "imagefolder" else "<module>:<callable>"
        raise ConfigError(f"data.source={kind!r} needs a location: write '{kind}:{where}'")
    if kind == "python" and not _IMPORT_PATH.match(arg):
        raise ConfigError(f"data.source={source!r}: {arg!r} is not '<module>:<callable>' (dotted names, "
                          "e.g. 'python:mypkg.data:build')")
    if kind not in ("imagefolder", "python") and arg:
        raise ConfigError(f"data.source={source!r}: only 'imagefolder' and 'python' take a ':<location>' "
                          "part")
    return kind, arg


@dataclass
class DataConfig:
    """What to stage and how: source, image size, split fractions, synthetic parameters."""
    source: str = "digits"
    """``digits`` (bundled with scikit-learn), ``synthetic``, ``imagefolder:<path-or-URI>`` or
    ``python:<module>:<callable>`` (a dataset factory of yours, docs/own-model.md)."""
    image_size: int = 32
    """Side in pixels of the square images staging writes (1 to 4096); vit_b_16 needs a multiple of 16."""
    channels: int = 3
    """1 (grayscale) or 3 (RGB): staging converts every image to this."""
    seed: int = 0
    """Seed of the split assignment and the synthetic images: the same seed stages the same data."""
    val_fraction: float = 0.1
    """Share of the samples in the validation split, in [0, 1)."""
    test_fraction: float = 0.1
    """Share of the samples in the test split, in [0, 1); val + test must leave a training split."""
    synthetic_samples: int = 2048
    """Images the ``synthetic`` source generates; other sources ignore it."""
    synthetic_classes: int = 10
    """Classes (>= 2) the ``synthetic`` source generates; other sources ignore it."""
    samples_per_shard: int = 8192
    """Samples per staged uint8 memmap shard file; the loader reads across shard boundaries."""
    decode_workers: int = 0
    """Processes that decode and resize ImageFolder images while staging; 0 = one per CPU core."""
    mean: list = field(default_factory=list)
    """Per-channel mean (of pixel values in [0, 1]) that training, validation and the exported model
    subtract; empty = the staged data's own. Set it with std, e.g. to ImageNet's ([0.485, 0.456, 0.406],
    the imagenet_like preset's) when starting from weights trained with it."""
    std: list = field(default_factory=list)
    """Per-channel standard deviation to divide by, beside mean (ImageNet's: [0.229, 0.224, 0.225]); empty =
    the staged data's own."""

    def __post_init__(self) -> None:
        _check_types(self, "data")
        parse_source(self.source)
        _ints(self, "data", image_size=1, seed=0, synthetic_samples=1, synthetic_classes=2,
              samples_per_shard=1, decode_workers=0)
        _check(self.image_size <= 4096, "data.image_size", self.image_size, "must be <= 4096")
        _check(self.channels in (1, 3), "data.channels", self.channels, "must be 1 or 3")
        for name in ("val_fraction", "test_fraction"):
            value = getattr(self, name)
            _check(isinstance(value, (int, float)) and 0.0 <= value < 1.0, f"data.{name}", value,
                   "must be a fraction in [0, 1)")
        _check(self.val_fraction + self.test_fraction < 1.0, "data.val_fraction + data.test_fraction",
               self.val_fraction + self.test_fraction, "must leave a training split (sum < 1)")
        self._check_normalization()

    def _check_normalization(self) -> None:
        example = f"e.g. {IMAGENET_MEAN} and {IMAGENET_STD} (ImageNet's)"
        _check(bool(self.mean) == bool(self.std), "data.mean/data.std", (self.mean, self.std),
               f"set both or neither, {example}")
        # Statistics of pixels scaled to [0, 1] (0-255 figures are the usual slip): a mean in [0, 1], a std in
        # (0, 1]
        for name, fits in (("mean", lambda v: 0.0 <= v <= 1.0), ("std", lambda v: 0.0 < v <= 1.0)):
            values = getattr(self, name)
            numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                          and fits(v) for v in values)
            within = "[0, 1]" if name == "mean" else "(0, 1]"
            _check(numbers, f"data.{name}", values,
                   f"expected a list of numbers in {within}, one per channel, of pixels scaled to [0, 1] "
                   f"(not 0-255), {example}")
            _check(not values or len(values) == self.channels, f"data.{name}", values,
                   f"needs one value per channel: data.channels is {self.channels} (set data.channels "
                   "to the staged data's channels too)")


@dataclass
class LoaderConfig:
    """Per-rank batch size and the DataLoader knobs; ``autotune`` probes the best worker settings."""
    batch_size: int = 64
    """Samples per rank per step; the global batch is batch_size x world size."""
    num_workers: int = 0
    """DataLoader worker processes; 0 = gather in the training process (batched memmap reads keep up)."""
    prefetch_factor: int = 2
    """Batches each DataLoader worker loads ahead; used only when num_workers > 0."""
    persistent_workers: bool = True
    """Keep DataLoader workers alive across epochs; used only when num_workers > 0."""
    pin_memory: bool = True
    """Pin host batches in page-locked memory for faster copies; takes effect only on CUDA."""
    drop_last: bool = True
    """Drop each epoch's last incomplete global batch, so every step has the same shape."""
    shuffle: bool = True
    """A fresh global permutation of the training split every epoch; off = the staged order."""
    block_samples: int = 1
    """Samples the shuffle keeps together: each epoch permutes runs of this many consecutive staged samples
    (1: every sample on its own). A streamed dataset (data.stream) reads a run in one request, so 16 cuts
    its requests 16x; the built-in sources stage their samples in a shuffled, class-mixed order, so a run
    is not one class, but a ``python:`` dataset staged in class order would give batches of few classes.
    The order stays the same on every world size; effect on accuracy: docs/data.md."""
    device_prefetch: bool = True
    """Copy the next batch to the GPU on a CUDA side stream while the current step runs."""
    autotune: bool = False
    """Probe num_workers x prefetch_factor on the real data before training and keep the fastest."""
    eval_batch_size: int = 256
    """Samples per batch in validation and test evaluation (no gradients, so it can exceed batch_size)."""
    random_resized_crop: bool = False
    """Augment training batches on the device: crop a random box of [crop_scale, 1] of the area and aspect
    ratio in [3/4, 4/3], resized back to the staged size (torchvision's RandomResizedCrop)."""
    crop_scale: float = 0.08
    """Smallest area fraction random_resized_crop keeps, in (0, 1]."""
    horizontal_flip: bool = False
    """Augment training batches on the device: mirror half of the images left to right."""
    cache_bytes: int = 0
    """Node-local disk, in bytes, each process may use to cache a dataset streamed from an object store
    (data.stream); 0 = the node's cache shared by its processes: on a Flyte train node its ephemeral-storage
    request less 2 GiB (the ``resources`` input; 10 GiB by default), elsewhere 8 GiB at most half the free
    space where the cache is. It must hold the batches in flight and an evaluation batch: 5 x batch_size +
    eval_batch_size samples; room for 17 x batch_size lets a stream that waits on the store fetch up to 16
    batches ahead."""

    def __post_init__(self) -> None:
        _check_types(self, "loader")
        _ints(self, "loader", batch_size=1, num_workers=0, prefetch_factor=1, eval_batch_size=1,
              cache_bytes=0, block_samples=1)
        _check(0 < self.crop_scale <= 1, "loader.crop_scale", self.crop_scale, "must be in (0, 1]")


@dataclass
class ModelConfig:
    """Architecture by name; input shape and class count come from the staged manifest."""
    name: str = "small_cnn"
    """small_cnn, mlp, resnet18, resnet34, resnet50, vit_b_16 or vit_tiny (a 4-layer ViT for small images),
    or a factory of your own as ``"<module>:<callable>"`` (docs/own-model.md); random init unless
    init_from (nothing is downloaded)."""
    kwargs: dict = field(default_factory=dict)
    """Keyword arguments for an imported factory (model.name ``"<module>:<callable>"``), a JSON object; it
    is called as ``callable(num_classes=..., in_channels=..., image_size=..., **kwargs)``, each of the first
    three where the callable takes it (docs/own-model.md)."""
    init_from: str = ""
    """Weights to start from (docs/own-model.md): a safetensors or torch state-dict (.pt/.pth) file, a path
    or an object-store URI, loaded before the first step; ignored by a run that resumes. Empty: random."""
    init_exclude: list = field(default_factory=list)
    """fnmatch patterns over the model's state_dict names that keep their fresh values (a new head, e.g.
    ``["fc.*"]``)."""
    init_strict: bool = True
    """Refuse an init_from file that lacks a tensor of the model, or holds one of another shape or kind
    (integers for floats), unless excluded; false loads what fits and reports the rest."""
    width: int = 32
    """Channels of the first conv layer (small_cnn) or hidden size (mlp); the torchvision models ignore it."""
    dropout: float = 0.0
    """Dropout probability in [0, 1) for small_cnn and mlp; 0 = no dropout."""
    compile: bool = False
    """Wrap the model in torch.compile: slower start-up, faster steps; pays off on long GPU runs."""

    def __post_init__(self) -> None:
        _check_types(self, "model")
        _check(self.name in MODEL_NAMES or is_imported_model(self.name), "model.name", self.name,
               f"must be one of {', '.join(MODEL_NAMES)}, or \"<module>:<callable>\" naming a model factory "
               "of yours, e.g. \"mypkg.models:build\" (docs/own-model.md)")
        _json_object("model.kwargs", self.kwargs)
        patterns = self.init_exclude
        _check(isinstance(patterns, list) and all(isinstance(p, str) and p for p in patterns),
               "model.init_exclude", self.init_exclude, 'expected a list of fnmatch patterns, e.g. ["fc.*"]')
        _check(not self.init_exclude or bool(self.init_from), "model.init_exclude", self.init_exclude,
               "it applies to model.init_from, which is empty: set it, or leave init_exclude empty")
        reserved = sorted(set(self.kwargs) & set(FACTORY_ARGUMENTS))
        _check(not reserved, "model.kwargs", self.kwargs, f"{', '.join(reserved)} come from the staged data: "
               "leave them out")
        _check(not self.kwargs or is_imported_model(self.name), "model.kwargs", self.kwargs,
               f"it is for an imported factory (model.name \"<module>:<callable>\"); {self.name} takes none: "
               "leave it empty")
        _ints(self, "model", width=1)
        _check(isinstance(self.dropout, (int, float)) and 0.0 <= self.dropout < 1.0, "model.dropout",
               self.dropout, "must be in [0, 1)")


def is_imported_model(name: str) -> bool:
    """Whether model.name names a factory of the user's (``"<module>:<callable>"``)."""
    return bool(_IMPORT_PATH.match(name))


def model_identity(model: dict[str, Any]) -> dict[str, Any]:
    """The fields of a model config (as ``to_dict`` writes it) that decide the model's tensors: its name,
    its width for the models that take one, its kwargs for an imported one. Two runs with equal identities
    build the same tensors."""
    identity = {"name": model.get("name")}
    if model.get("name") in OWN_MODELS:
        identity["width"] = model.get("width")
    if isinstance(model.get("name"), str) and is_imported_model(model["name"]):
        identity["kwargs"] = model.get("kwargs", {})
    return identity


def optimizer_identity(optim: dict[str, Any]) -> dict[str, Any]:
    """The fields of an optim config (as ``to_dict`` writes it) that decide the optimizer's state tensors:
    its name and the parameters it leaves out (frozen param_groups' patterns)."""
    frozen = sorted(group.get("pattern", "") for group in optim.get("param_groups", [])
                    if isinstance(group, dict) and group.get("freeze"))
    return {"name": optim.get("name"), "frozen": frozen}


@dataclass
class OptimConfig:
    """AdamW or SGD, with linear warmup then a schedule (cosine decay to ``lr * min_lr_ratio`` by default)."""
    name: str = "adamw"
    """adamw (decoupled weight decay, beta1/beta2) or sgd (momentum, nesterov; L2 weight decay), as in
    torchvision's classification reference."""
    lr: float = 1e-3
    """Peak learning rate, reached after warmup_steps; in (0, 10)."""
    weight_decay: float = 0.01
    """Weight decay, >= 0: decoupled for adamw, added to the gradient (L2) for sgd."""
    momentum: float = 0.9
    """sgd only: momentum, in [0, 1)."""
    nesterov: bool = False
    """sgd only: Nesterov momentum (needs momentum > 0)."""
    beta1: float = 0.9
    """adamw only: first-moment (momentum) decay, in [0, 1)."""
    beta2: float = 0.999
    """adamw only: second-moment decay, in [0, 1)."""
    warmup_steps: int = 20
    """Steps of linear warmup from 0 to lr (onecycle: its rise from lr/25); 0 = start at the peak."""
    schedule: str = "cosine"
    """The lr after warmup (traincore/run/schedule.py): ``cosine`` or ``linear`` decay to lr x min_lr_ratio
    at the last step, ``step`` (x step_gamma at each of step_milestones), ``constant``, or ``onecycle``
    (a cosine rise from lr/25 over warmup_steps, or 30% of the run when 0, then a cosine fall)."""
    min_lr_ratio: float = 0.1
    """Floor of the decay: the lr ends at lr x min_lr_ratio (cosine, linear, onecycle) or never goes under
    it (step); in [0, 1]."""
    step_milestones: list = field(default_factory=lambda: [0.5, 0.75])
    """``step`` schedule: the fractions of the steps after warmup at which the lr is multiplied by
    step_gamma, ascending, each in (0, 1)."""
    step_gamma: float = 0.1
    """``step`` schedule: the factor at each milestone, in (0, 1]."""
    ema_decay: float = 0.0
    """An exponential moving average of the weights, e.g. 0.999 (in (0, 1); 0 = off): each step the
    average moves 1 - ema_decay of the way to the live weights. When on, validation and export use the
    average, and checkpoints hold it beside the live weights."""
    param_groups: list = field(default_factory=list)
    """Parameters by name with a learning-rate multiplier or frozen (traincore/run/param_groups.py), e.g.
    ``[{"pattern": "fc.*", "lr_mult": 10}, {"pattern": "conv1.*", "freeze": true}]``: fnmatch patterns
    over the model's parameter names, the first match wins, the rest keep lr; a pattern that matches no
    parameter is refused before training starts."""
    grad_clip: float = 1.0
    """Maximum global gradient L2 norm; 0 disables clipping."""

    def __post_init__(self) -> None:
        _check_types(self, "optim")
        _one_of("optim.name", self.name, OPTIMIZERS)
        _check(0 <= self.momentum < 1, "optim.momentum", self.momentum, "must be in [0, 1)")
        _check(not self.nesterov or self.momentum > 0, "optim.nesterov", self.nesterov,
               "needs optim.momentum > 0")
        _check(isinstance(self.lr, (int, float)) and 0 < self.lr < 10, "optim.lr", self.lr,
               "must be in (0, 10)")
        _check(self.weight_decay >= 0, "optim.weight_decay", self.weight_decay, "must be >= 0")
        for name in ("beta1", "beta2"):
            _check(0 <= getattr(self, name) < 1, f"optim.{name}", getattr(self, name), "must be in [0, 1)")
        _ints(self, "optim", warmup_steps=0)
        _check(0 <= self.min_lr_ratio <= 1, "optim.min_lr_ratio", self.min_lr_ratio, "must be in [0, 1]")
        _one_of("optim.schedule", self.schedule, LR_SCHEDULES)
        _check(self.ema_decay == 0 or 0 < self.ema_decay < 1, "optim.ema_decay", self.ema_decay,
               "must be in (0, 1), e.g. 0.999, or 0 to turn the average off")
        for index, group in enumerate(self.param_groups):
            _check_param_group(f"optim.param_groups[{index}]", group)
        milestones = self.step_milestones
        _check(all(isinstance(m, (int, float)) and not isinstance(m, bool) and 0 < m < 1 for m in milestones)
               and milestones == sorted(milestones), "optim.step_milestones", milestones,
               "expected ascending fractions of the run in (0, 1), e.g. [0.5, 0.75]")
        _check(0 < self.step_gamma <= 1, "optim.step_gamma", self.step_gamma, "must be in (0, 1]")
        _check(self.grad_clip >= 0, "optim.grad_clip", self.grad_clip, "must be >= 0 (0 disables clipping)")


def _check_param_group(name: str, group: Any) -> None:
    example = '{"pattern": "fc.*", "lr_mult": 10} or {"pattern": "conv1.*", "freeze": true}'
    _check(isinstance(group, dict) and set(group) <= {"pattern", "lr_mult", "freeze"} and
           isinstance(group.get("pattern"), str) and bool(group["pattern"]), name, group,
           f"expected {example}")
    freeze, lr_mult = group.get("freeze", False), group.get("lr_mult")
    _check(isinstance(freeze, bool), f"{name}.freeze", freeze, "expected true or false")
    _check(freeze != (lr_mult is not None), name, group,
           "give either lr_mult (a frozen group has no learning rate) or freeze: true")
    if lr_mult is not None:
        _check(isinstance(lr_mult, (int, float)) and not isinstance(lr_mult, bool) and 0 < lr_mult < 1e6,
               f"{name}.lr_mult", lr_mult, "must be a number > 0 (the group's lr is optim.lr x lr_mult)")


@dataclass
class TrainConfig:
    """How long to train and the loop's housekeeping intervals. Give max_steps or epochs."""
    max_steps: int = 0
    """Optimizer steps to train for; 0 = derive from epochs."""
    epochs: int = 1
    """Full passes over the training split; used only when max_steps is 0."""
    seed: int = 0
    """Seed of the initial weights (the same on every rank) and of the per-epoch data order."""
    overfit: int = 0
    """Train on the first N samples of the training split only, and validate on those same N: the first
    check of a new model or dataset (a model that cannot fit a few hundred samples to ~100% has a bug: a
    label mapping, a frozen layer, a learning rate that cannot learn). 0 = the whole split."""
    stop_after: int = 0
    """Stop after this step, validated and saved as a last step is, with everything else (the schedule's
    horizon, the epochs) as for the whole run: a rung of a hyperparameter search, which a later run with a
    larger stop_after (or 0, to the end) continues exactly. 0 = train to the end."""
    eval_every: int = 0
    """Steps between validation passes on the val split; 0 = validate only at the end. Each validated step
    is also saved, its checkpoint recording the metrics, so export can pick the best one
    (``--select best``). Its cost scales with val samples / (eval_every x global batch): the digits preset
    (once an epoch, a val split an eighth of the training split: a worst case) takes 1.08x the time of a
    run validated only at its end on 2 CPU cores (bench/validation.py); ImageNet's preset, under 1%."""
    metric: str = "val_accuracy"
    """The validation metric that ranks checkpoints (the best is kept past checkpoint.keep_last and is what
    export takes by default) and that early stopping watches: ``val_accuracy`` (higher is better) or
    ``val_loss`` (lower is better)."""
    early_stopping: dict = field(default_factory=dict)
    """Stop when ``metric`` has not improved by more than ``min_delta`` for ``patience`` validations in a
    row, e.g. ``{"patience": 3, "min_delta": 0.001}`` (needs eval_every); empty = train to the end."""
    gc_every: int = 50
    """Python's garbage collector runs only every this many steps in the loop (no random stalls)."""
    bf16: bool = True
    """bfloat16 autocast on CUDA; ignored on CPU."""
    deterministic: bool = True
    """Forces deterministic algorithms (slow cuDNN convolutions on GPU); bitwise resume needs it on."""
    profile_steps: str = ""
    """``START:END`` records a torch.profiler trace of that step window; empty = no profiling."""
    label_smoothing: float = 0.0
    """Label smoothing of the training loss, in [0, 1): the target puts this mass evenly on every class.
    Validation reports the plain cross-entropy."""
    grad_accum_steps: int = 1
    """Batches (loader.batch_size per rank each) whose gradients add up to one optimizer step: the step
    sees grad_accum_steps x the global batch, with one batch's activation memory. A step larger than the
    training split is refused."""
    global_batch: int = 0
    """Samples per optimizer step over all ranks, kept whatever the world size: each rank accumulates
    global_batch / (loader.batch_size x world size) batches per step, so a run whose nodes come and go (a
    node range, docs/reliability.md) trains on the same steps. It must be a whole number of batches at every
    world size the run may take (one at each, at the most); needs loader.drop_last and grad_accum_steps 1.
    0 = loader.batch_size x world size x grad_accum_steps, at whatever world size the run has."""

    def __post_init__(self) -> None:
        _check_types(self, "train")
        _check(0 <= self.label_smoothing < 1, "train.label_smoothing", self.label_smoothing,
               "must be in [0, 1)")
        _ints(self, "train", max_steps=0, epochs=0, seed=0, eval_every=0, gc_every=1, grad_accum_steps=1,
              stop_after=0, overfit=0, global_batch=0)
        _check(not self.global_batch or self.grad_accum_steps == 1, "train.grad_accum_steps",
               self.grad_accum_steps, "must be 1 with train.global_batch set (it decides the accumulation)")
        _at_most(self, "train", seed=MAX_SEED)
        _one_of("train.metric", self.metric, VALIDATION_METRICS)
        self._check_early_stopping()
        _check(self.max_steps > 0 or self.epochs > 0, "train.max_steps/train.epochs",
               (self.max_steps, self.epochs), "set max_steps >= 1 or epochs >= 1")
        if self.profile_steps:
            parts = self.profile_steps.split(":")
            ok = len(parts) == 2 and all(_digits(p) for p in parts) and int(parts[0]) < int(parts[1])
            _check(ok, "train.profile_steps", self.profile_steps,
                   "must look like 'START:END' with START < END")
            # Steps count from 0: a window from max_steps on would record nothing.
            _check(not self.max_steps or int(parts[0]) < self.max_steps, "train.profile_steps",
                   self.profile_steps, f"starts after the run's last step ({self.max_steps - 1}; steps count "
                   f"from 0 to train.max_steps - 1): choose a window that starts below {self.max_steps}")

    def _check_early_stopping(self) -> None:
        stopping, example = self.early_stopping, '{"patience": 3, "min_delta": 0.001}'
        _check(isinstance(stopping, dict) and set(stopping) <= {"patience", "min_delta"},
               "train.early_stopping", stopping, f"expected {example} (or {{}} to train to the end)")
        if not stopping:
            return
        patience, min_delta = stopping.get("patience"), stopping.get("min_delta", 0.0)
        _check(isinstance(patience, int) and not isinstance(patience, bool) and patience >= 1,
               "train.early_stopping.patience", patience,
               f"must be an integer >= 1 (validations), e.g. {example}")
        _check(isinstance(min_delta, (int, float)) and not isinstance(min_delta, bool) and
               math.isfinite(min_delta) and min_delta >= 0, "train.early_stopping.min_delta", min_delta,
               "must be a number >= 0")
        _check(self.eval_every > 0, "train.early_stopping", stopping,
               "it compares validations, and train.eval_every is 0: set train.eval_every (e.g. 100)")

    def profile_window(self) -> tuple[int, int] | None:
        """The (start, end) steps to profile, or None."""
        if not self.profile_steps:
            return None
        start, end = self.profile_steps.split(":")
        return int(start), int(end)


@dataclass
class CheckpointConfig:
    """Where and how often to save; ``resume`` is 'latest', 'none' or a step number."""
    mode: str = "sync"
    """``sync`` (rank 0 writes one file), ``dcp`` (each rank writes a part) or ``async`` (background dcp)."""
    every: int = 0
    """Steps between saves; 0 = none by step count (the end, ``every_s`` and a preemption still save)."""
    every_s: float = 300.0
    """Seconds of wall clock between saves, agreed across ranks (the step after any rank's interval ran
    out), so a hard failure with no signal to save on (a lost node, the OOM killer) loses at most about
    this much work; 0 turns it off. 300 s costs a default ``sync`` save of 1.2 GB about 0.4% of the run and
    an ``async`` one well under 0.01% (docs/checkpoints.md)."""
    max_save_share: float = 0.01
    """The most of the run's wall clock that saves may block training: when a save blocks longer than
    ``every_s`` x this share (a large state written synchronously into an object store: 0.5 GB into S3
    takes seconds), the wall-clock interval grows to that save's blocking time over this share, with a log
    line naming ``async``, which blocks far less; 0 keeps ``every_s`` whatever a save costs."""
    keep_last: int = 3
    """Complete checkpoints to keep; older ones (and torn ones older than the newest) are deleted."""
    resume: str = "latest"
    """``latest`` (the newest complete checkpoint, if any), ``none`` (start fresh) or a step number."""
    verify_on_load: bool = True
    """Check every file's size and CRC32 against the commit marker before resuming from it."""
    overlap_copy: bool = True
    """``async`` only: copy the large tensors (parameters, optimizer state) while the next forward and
    backward run; an optimizer step waits for the copy. Tensors up to 1 MiB (BatchNorm statistics, step
    counters) are copied before ``save`` returns. Turn off (copy everything before ``save`` returns) for a
    model whose forward changes large tensors in place."""
    preemption_grace_s: float = 20.0
    """Seconds a run has, from SIGTERM, SIGINT or SIGUSR1, to finish its step, save it and exit (exit code
    75, "preempted at step N"). Keep it under what the platform waits before SIGKILL: Kubernetes' default
    termination grace and torchrun's shutdown timeout are 30 s, a GKE spot node gives about 25 s. A save
    that cannot finish in time is abandoned: the last complete checkpoint stays the one a resume loads. A
    run warns at start when this is not under the launcher's limit (TORCH_ELASTIC_SHUTDOWN_TIMEOUT)."""

    def __post_init__(self) -> None:
        _check_types(self, "checkpoint")
        _check(self.preemption_grace_s > 0, "checkpoint.preemption_grace_s", self.preemption_grace_s,
               "must be > 0 seconds (e.g. 20, under the platform's SIGKILL deadline)")
        _check(self.every_s >= 0, "checkpoint.every_s", self.every_s,
               "must be >= 0 seconds (e.g. 300; 0 turns the wall-clock cadence off)")
        _check(0 <= self.max_save_share < 1, "checkpoint.max_save_share", self.max_save_share,
               "must be a share in [0, 1) (e.g. 0.01 for 1% of the run; 0 keeps every_s as given)")
        _one_of("checkpoint.mode", self.mode, CHECKPOINT_MODES)
        _ints(self, "checkpoint", every=0, keep_last=1)
        _check(self.resume in ("latest", "none") or _digits(self.resume), "checkpoint.resume",
               self.resume, "must be 'latest', 'none' or a step number")


@dataclass
class TelemetryConfig:
    """Metric sinks (JSONL always; TensorBoard and W&B optional) and logging cadence."""
    log_every: int = 10
    """Steps between metric intervals; each costs one all-reduce and one device sync."""
    tensorboard: bool = True
    """Also write metrics as TensorBoard events under ``<output>/tensorboard``."""
    tb_max_queue: int = 100
    """Events that may wait for TensorBoard's writer thread; when that many wait, logging blocks."""
    tb_flush_secs: int = 30
    """Seconds between flushes of TensorBoard's writer: how stale a remote event file may get (a local one
    gets each event as the writer thread takes it)."""
    records_every_s: float = 30.0
    """Seconds between copies of the run's records (metrics.jsonl, TensorBoard events, workers' stderr
    tails) into ``<checkpoint root>/records/attempt-<N>/`` while it runs, when that root is not inside the
    output directory (an object store, a shared filesystem); a last copy is made when the run ends,
    however it ends. 0: only that last one."""
    wandb_mode: str = "disabled"
    """Weights & Biases: ``disabled``, ``offline`` (local files only) or ``online``."""
    wandb_project: str = "flyte-torch-pipeline"
    """W&B project the run is logged under."""
    wandb_entity: str = ""
    """W&B team or user the project belongs to; empty = the key's default entity."""
    wandb_run_name: str = ""
    """The W&B run's display name; empty = one W&B makes up."""
    wandb_tags: list = field(default_factory=list)
    """Tags of the W&B run (strings of 1 to 64 characters), e.g. ``["digits", "baseline"]``."""
    progress: str = "auto"
    """Progress bar: ``on``, ``off`` or ``auto`` (only when stdout is a terminal)."""
    level: str = "INFO"
    """Log level: DEBUG, INFO, WARNING or ERROR."""

    def __post_init__(self) -> None:
        _check_types(self, "telemetry")
        _ints(self, "telemetry", log_every=1, tb_max_queue=1, tb_flush_secs=1)
        _check(self.records_every_s >= 0, "telemetry.records_every_s", self.records_every_s,
               "must be >= 0 seconds (e.g. 30; 0 copies the records only when the run ends)")
        _one_of("telemetry.wandb_mode", self.wandb_mode, WANDB_MODES)
        _check(all(isinstance(tag, str) and 0 < len(tag) <= 64 for tag in self.wandb_tags),
               "telemetry.wandb_tags", self.wandb_tags, 'expected a list of 1-64 character strings, e.g. '
               '["digits", "baseline"] (W&B\'s limit)')
        _one_of("telemetry.progress", self.progress, ("auto", "on", "off"))
        _one_of("telemetry.level", self.level, ("DEBUG", "INFO", "WARNING", "ERROR"))


@dataclass
class DistConfig:
    """Process-group backend and timeouts: generous for start-up, tighter once training runs."""
    backend: str = "auto"
    """``auto`` (``cpu:gloo,cuda:nccl`` with CUDA, else gloo), ``gloo``, ``nccl``, ``cpu:gloo,cuda:nccl``."""
    init_timeout_s: int = 900
    """Seconds to wait at start-up for all ranks to join (rendezvous, process group); pods may start late."""
    step_timeout_s: int = 300
    """Process-group timeout in seconds once the first step has run: a hung rank fails the run sooner."""
    parallelism: str = "ddp"
    """``ddp``: every rank holds the whole model and optimizer state (replicated); ``fsdp``: FSDP2 shards
    parameters, gradients and optimizer state across the ranks (about 1/N each), one unit per block of the
    model plus the root. Any checkpoint resumes under either, on any number of ranks."""
    reshard_after_forward: bool = True
    """fsdp: free each unit's gathered parameters after its forward (least memory; backward gathers them
    again); false keeps them until the backward (one all-gather fewer per unit and step, more memory)."""

    def __post_init__(self) -> None:
        _check_types(self, "dist")
        _one_of("dist.backend", self.backend, DIST_BACKENDS)
        _one_of("dist.parallelism", self.parallelism, PARALLELISMS)
        _ints(self, "dist", init_timeout_s=1, step_timeout_s=1)
        _at_most(self, "dist", init_timeout_s=MAX_TIMEOUT_S, step_timeout_s=MAX_TIMEOUT_S)


@dataclass
class Config:
    """The whole tree. ``with_overrides`` rejects unknown keys by name."""
    data: DataConfig = field(default_factory=DataConfig)
    """What to stage: source, image size, splits."""
    loader: LoaderConfig = field(default_factory=LoaderConfig)
    """How training batches are read."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """Which architecture to train."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer and learning-rate schedule."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Training length and loop housekeeping."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Saving and resuming."""
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)
    """Metrics, logs and the progress bar."""
    dist: DistConfig = field(default_factory=DistConfig)
    """Process-group backend and timeouts."""

    def __post_init__(self) -> None:
        for spec in dataclasses.fields(self):
            section, kind = getattr(self, spec.name), spec.default_factory
            _check(isinstance(section, kind), spec.name, section, f"must be a {kind.__name__}")
        # Options that are valid alone but not together.
        if self.checkpoint.mode == "async" and self.dist.backend == "nccl":
            raise ConfigError(
                "checkpoint.mode='async' with dist.backend='nccl' is invalid: async checkpoints commit in "
                "the background over a CPU (gloo) backend, which 'nccl' alone lacks; set dist.backend to "
                "'auto' or 'cpu:gloo,cuda:nccl', or checkpoint.mode to 'sync' or 'dcp'")
        if self.train.global_batch and not self.loader.drop_last:
            raise ConfigError(
                "train.global_batch with loader.drop_last=false is invalid: an epoch's last, partial step "
                "would be cut into batches differently at each world size; set loader.drop_last true")

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Plain nested dicts (what a checkpoint and the telemetry record); ``with_overrides`` reads them."""
        return dataclasses.asdict(self)

    def with_overrides(self, overrides: dict[str, Any] | str) -> Config:
        """A new Config with nested overrides applied, e.g. ``{"loader": {"batch_size": 32}}``.

        Also accepts a JSON string, and dotted keys (``{"loader.batch_size": 32}``).
        """
        if isinstance(overrides, str):
            try:
                overrides = json.loads(overrides) if overrides.strip() else {}
            except json.JSONDecodeError as exc:
                raise ConfigError(f"config overrides are not valid JSON ({exc}); pass e.g. "
                                  '\'{"loader": {"batch_size": 32}}\'') from exc
        if not isinstance(overrides, dict):
            raise ConfigError(f"config overrides must be a JSON object, got {type(overrides).__name__}")
        merged = self.to_dict()
        for key, value in _nest(overrides).items():
            known = {f.name for f in dataclasses.fields(_SECTIONS[key])}
            for name, item in value.items():
                if name not in known:
                    fields = ", ".join(sorted(known))
                    raise ConfigError(f"unknown config field {key}.{name}; fields are {fields}")
                merged[key][name] = item
        return Config(**{name: _SECTIONS[name](**values) for name, values in merged.items()})


def _nest(overrides: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Dotted keys into sections: ``{"loader.batch_size": 8}`` -> ``{"loader": {"batch_size": 8}}``."""
    nested: dict[str, dict[str, Any]] = {}
    for key, value in overrides.items():
        section, dot, name = key.partition(".") if isinstance(key, str) else (key, "", "")
        if section not in _SECTIONS:
            raise ConfigError(f"unknown config section {section!r}; sections are {', '.join(_SECTIONS)}")
        if not dot and not isinstance(value, dict):
            raise ConfigError(f"config section {key!r} must be an object of fields, got {value!r}; write "
                              'e.g. {"loader": {"batch_size": 32}}')
        fields = {name: value} if dot else value
        # {"optim.lr": 0.01, "optim": {"lr": 0.02}} gives one field twice: which one won would be an
        # accident of the JSON's key order
        twice = sorted(set(fields) & set(nested.get(section, {})))
        if twice:
            raise ConfigError(f"{section}.{twice[0]} is given twice (as a dotted key and inside "
                              f"{section!r}): give it once")
        nested.setdefault(section, {}).update(fields)
    return nested


_SECTIONS: dict[str, Any] = {f.name: f.default_factory for f in dataclasses.fields(Config)}

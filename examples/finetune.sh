#!/usr/bin/env bash
# A team's package trained end to end: stage its datasets, pretrain its model on one task, export it, then
# fine-tune it on another task from those weights with a new head. Run from the project root:
#   examples/finetune.sh [WORKDIR]          (STEPS=300 by default; the test runs it with fewer)
set -euo pipefail
work=${1:-runs/example}
steps=${STEPS:-300}
export PYTHONPATH="$(cd "$(dirname "$0")" && pwd)${PYTHONPATH:+:$PYTHONPATH}"
python=${PYTHON:-python}
model='"model": {"name": "teamnet.models:resnet_tiny", "kwargs": {"width": 16, "depth": 2}}'

$python -m traincore.stage --source python:teamnet.data:digits --output "$work/digits" --image-size 16 \
    --channels 1
$python -m traincore.stage --source python:teamnet.data:parity --output "$work/parity" --image-size 16 \
    --channels 1
$python -m traincore.train --data "$work/digits" --output "$work/pretrain" --max-steps "$steps" \
    --config "{$model}"
$python -m traincore.export --checkpoint "$work/pretrain/checkpoints" \
    --output "$work/pretrained/model.safetensors" --model-name teamnet.models:resnet_tiny
$python -m traincore.train --data "$work/parity" --output "$work/finetune" --max-steps "$((steps / 5))" \
    --config "{$model, \"model.init_from\": \"$work/pretrained/model.safetensors\",
               \"model.init_exclude\": [\"head.*\"], \"optim\": {\"name\": \"sgd\", \"lr\": 0.02},
               \"train\": {\"label_smoothing\": 0.1}}"
$python -m traincore.export --checkpoint "$work/finetune/checkpoints" \
    --output "$work/finetuned/model.safetensors" --model-name teamnet.models:resnet_tiny
$python -m traincore.evaluate --model "$work/finetuned/model.safetensors" --data "$work/parity" \
    --model-name teamnet.models:resnet_tiny

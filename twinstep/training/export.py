"""``twinstep weights RUN_DIR``: a run's latest weights as a timm model folder — the state dict
in timm's names and the ``config.json`` timm reads beside it, with the preprocessing the run
evaluated with — so that timm's own data config and transforms evaluate the weights as twinstep
did (docs/training.md#weights-for-timm).

The folder is what ``timm.create_model("local-dir:FOLDER", pretrained=True)`` loads (Hugging
Face's layout, as timm's ``push_to_hf_hub`` writes it): ``model.safetensors`` (or
``pytorch_model.pth``) and ``config.json``, whose ``pretrained_cfg`` holds the input size, the
interpolation, the crop, mean and std, the classes and their names.
"""

from __future__ import annotations

import json
import os

import numpy as np

from twinstep.data import transforms
from twinstep.errors import UsageError
from twinstep.nets import get_net
from twinstep.processes import disk
from twinstep.training.checkpoint import FOLDER, load_state
from twinstep.training.state_dict import encoded

# --format: the state dict's file in the folder, a name timm's local-dir loader looks for
FILES = {"safetensors": "model.safetensors", "pth": "pytorch_model.pth"}
CONFIG = "config.json"


def write_from_run(run_dir: str, fmt: str = "safetensors", ema: bool = False,
                   out: str | None = None) -> tuple[str, int]:
    """Write RUN_DIR's latest weights — parameters and BN running statistics, or their EMA — as
    a timm model folder (``out``, default RUN_DIR/timm[_ema]): the float32 state dict and
    `timm_config`. Returns (the folder, the step whose weights it holds)."""
    if fmt not in FILES:
        raise UsageError(f"unknown --format {fmt!r}; choose from {', '.join(FILES)}")
    if not os.path.isdir(os.path.join(run_dir, FOLDER)):
        raise UsageError(f"{run_dir}: no checkpoints/ here (a RUN_DIR of 'twinstep train')")
    with open(os.path.join(run_dir, "config.json")) as f:
        run = json.load(f)
    state = load_state(run_dir)
    if ema:
        if not state.get("ema"):
            raise UsageError(f"{run_dir}: this run has no EMA (its recipe has no 'ema' token)")
        averaged = state["ema"]
        params, buffers = averaged if isinstance(averaged, (list, tuple)) else (
            averaged["0"], averaged["1"])
    else:
        params, buffers = state["params"], state["buffers"]
    folder = out or os.path.join(run_dir, "timm_ema" if ema else "timm")
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise UsageError(f"--out {folder}: exists and is not a folder")
    os.makedirs(folder, exist_ok=True)
    disk.check_writable_folder(folder, "--out")
    step = int(np.asarray(state["step"]))
    weights = os.path.join(folder, FILES[fmt])
    stale = [os.path.join(folder, f) for f in FILES.values() if f != FILES[fmt]]
    for path in stale:  # one state dict per folder: timm's loader takes the first it finds
        if os.path.exists(path):
            os.unlink(path)
    disk.publish({
        weights: encoded(weights, {k: np.asarray(v, np.float32)
                                   for k, v in {**params, **buffers}.items()}),
        os.path.join(folder, CONFIG): json.dumps(
            timm_config(run, step, "ema" if ema else "raw"), indent=1).encode()})
    return folder, step


def timm_config(run: dict, step: int, weights: str) -> dict:
    """timm's ``config.json`` for a run's weights (``run``: the run's config.json): the timm
    architecture, its classes and their names, and the evaluation the run made — timm's eval
    transform at the run's eval resolution, bilinear, a centre crop of
    `twinstep.data.transforms.CROP_PCT`, ImageNet's mean and std. ``twinstep`` says where the
    weights come from."""
    net = get_net(run["net"])
    names = list(net.param_shapes(run["classes"]))  # the stem's conv first, the head's last
    size = run["eval_res"]
    pretrained = {"input_size": [3, size, size], "fixed_input_size": False,
                  "interpolation": "bilinear", "crop_pct": transforms.CROP_PCT,
                  "crop_mode": "center", "mean": [round(float(m), 6) for m in transforms.MEAN],
                  "std": [round(float(s), 6) for s in transforms.STD],
                  "num_classes": run["classes"],
                  "first_conv": names[0].rsplit(".", 1)[0],
                  "classifier": names[-2].rsplit(".", 1)[0]}
    config = {"architecture": net.TIMM_NAME, "num_classes": run["classes"],
              "pretrained_cfg": pretrained,
              "twinstep": {"run": os.path.abspath(run["out"]), "recipe": run["recipe"],
                           "step": step, "weights": weights, "data": run["data"]}}
    if run.get("class_names"):
        config["label_names"] = run["class_names"]
    return config

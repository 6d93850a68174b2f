"""Does the recipe matter on the embedded default's generated set? One stage of the
default config (smallcnn, 32 px, 8192 training images, 5 epochs) under a few recipes.

    python bench/default_ablation.py

Each run is a real `ddpflow prepare` + `ddpflow launch` of the default config with one
change; the figure is the test split's accuracy (val chose nothing: one stage, no early
stop), with the validation curve over the epochs.
"""

from __future__ import annotations

import copy
import json
import tempfile
from pathlib import Path

import yaml
from common import launch_stage

REPO = Path(__file__).resolve().parents[1]
VARIANTS = {
    "no augmentation": ({"crop_padding": 0, "flip": False}, {}),
    "default (pad-and-crop 4 + flip)": ({}, {}),
    "default + random erasing 0.25": ({}, {"random_erasing": 0.25}),
    "default + EMA 0.99": ({}, {"ema": {"decay": 0.99}}),
}


def main() -> None:
    base = yaml.safe_load((REPO / "config/config.yaml").read_text())
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        for i, (label, (aug, stage)) in enumerate(VARIANTS.items()):
            cfg = copy.deepcopy(base)
            cfg.update(run=f"v{i}", results_dir=str(tmp / "results"))
            cfg["data"]["augment"].update(aug)
            st = {**cfg["stages"][0], "name": f"v{i}", "epochs": 5, **stage}
            cfg["stages"] = [st]
            s = launch_stage(tmp, f"v{i}", cfg)
            recs = [json.loads(x) for x in
                    (tmp / f"results/v{i}/stages/v{i}/metrics.jsonl").open()]
            curve = ", ".join(f"{r['val_acc']:.3f}" for r in recs if r["kind"] == "val")
            print(f"{label:34s} test_acc {s['test_acc']:.4f}  val_acc by epoch: {curve}",
                  flush=True)


if __name__ == "__main__":
    main()

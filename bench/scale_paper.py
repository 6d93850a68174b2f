"""ImageNet-1k on 8 nodes x 8 H100, on paper: the figures measured here by the other
bench/scale_*.py scripts, and published ones, put through the formulas of docs/SCALE.md.

    python bench/scale_paper.py [--core-ms-per-image 13.66] [--bytes-jpeg 16651] ...

Nothing here is measured: every input is an argument (defaults: this commit's measured
figures, and the published ones named in --help), and every output is arithmetic on them.
"""

from __future__ import annotations

import argparse

IMAGES = 1_281_167  # ImageNet-1k training images
PARAMS = 25.557e6  # ResNet-50


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # measured here (bench/scale_data.py, bench/scale_costs.py)
    ap.add_argument("--core-ms-per-image", type=float, default=13.66,
                    help="prepare, 224 px jpeg: fitted ms per image x 2 cores")
    ap.add_argument("--bytes-jpeg", type=float, default=16651, help="per image, 224 px")
    ap.add_argument("--bytes-raw", type=float, default=199700, help="per image, 224 px")
    ap.add_argument("--decode-per-core", type=float, default=2405,
                    help="images/s, one core, 258 px shards")
    ap.add_argument("--ckpt-mb-s", type=float, default=217, help="checkpoint write MB/s")
    ap.add_argument("--pipeline-eff", type=float, default=0.975,
                    help="ddpflow step with its device augmentation / compute only "
                         "(bench/augment.py)")
    # published or assumed (docs/SCALE.md names the sources)
    ap.add_argument("--pixels", type=float, default=1.2,
                    help="ImageNet originals' pixels / this benchmark's source images'")
    ap.add_argument("--gpu-img-s", type=float, nargs=2, default=[3000, 6000],
                    help="ResNet-50 AMP images/s per GPU, low and high")
    ap.add_argument("--ddp-eff", type=float, default=0.9, help="per-GPU efficiency at 64")
    ap.add_argument("--busbw-gb-s", type=float, default=400, help="NCCL all-reduce busbw")
    ap.add_argument("--batch", type=int, default=256, help="per GPU")
    ap.add_argument("--cores", type=int, default=112, help="CPU cores per node")
    ap.add_argument("--nodes", type=int, default=8)
    ap.add_argument("--gpus", type=int, default=8, help="per node")
    a = ap.parse_args()
    gpus = a.nodes * a.gpus
    prep_s = IMAGES * a.core_ms_per_image / 1e3 * a.pixels / a.cores
    print(f"ImageNet-1k ({IMAGES:,} training images), ResNet-50, {a.nodes} nodes x {a.gpus} "
          f"GPUs, {a.cores} cores per node")
    print(f"prepare on one node: {prep_s / 60:.1f} min "
          f"({a.core_ms_per_image} core-ms/image x {a.pixels} pixels / {a.cores} cores)")
    print(f"disk: jpeg {IMAGES * a.bytes_jpeg / 1e9:.1f} GB, raw "
          f"{IMAGES * a.bytes_raw / 1e9:.1f} GB")
    grad = 4 * PARAMS
    ar_ms = 2 * (gpus - 1) / gpus * grad / (a.busbw_gb_s * 1e9) * 1e3
    ckpt_mb = 2 * grad / 1e6  # weights + SGD momentum
    for rate in a.gpu_img_s:
        eff = rate * a.pipeline_eff * a.ddp_eff
        epoch = IMAGES / (gpus * eff)
        step_ms = a.batch / eff * 1e3
        cores = eff / a.decode_per_core
        print(f"at {rate:.0f} images/s per GPU: epoch {epoch:.1f} s, step {step_ms:.0f} ms "
              f"(batch {a.batch} per GPU); "
              f"decode {cores:.2f} cores per GPU ({cores * a.gpus:.0f} of {a.cores} per node);"
              f" first-epoch read jpeg {IMAGES * a.bytes_jpeg / epoch / 1e9:.1f} GB/s, raw "
              f"{IMAGES * a.bytes_raw / epoch / 1e9:.1f} GB/s (all nodes); all-reduce "
              f"{ar_ms:.2f} ms = {ar_ms / step_ms * 100:.1f}% of a step")
    print(f"checkpoint: {ckpt_mb:.0f} MB, {ckpt_mb / a.ckpt_mb_s:.1f} s in the background "
          f"writer at {a.ckpt_mb_s:.0f} MB/s")


if __name__ == "__main__":
    main()

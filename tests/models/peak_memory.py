"""Peak memory of a prepare run against the size of the checkpoint it prepares.

    python -m tests.models.peak_memory DIR [--rows 248320 --cols 5120]

makes (once, in a child process, so its allocations do not count) a checkpoint in DIR/source with an
`embed_tokens` and an `lm_head` of [rows, cols] bf16 in two shards, each beside a small tensor that is
copied, then prepares it into DIR/prepared (int8 lm_head + embed_tokens) and prints one JSON line:
the resident set before the run, the run's high-water mark (getrusage), their difference, and the
checkpoint's size. The defaults are the 27B's head shapes (2 x 2.54 GB).
"""
from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
from pathlib import Path


def make_source(src: Path, rows: int, cols: int) -> None:
    import torch
    from safetensors.torch import save_file

    src.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    shards = (("model.embed_tokens.weight", "model.layers.0.input_layernorm.weight"),
              ("lm_head.weight", "model.norm.weight"))
    for i, (big, small) in enumerate(shards, 1):
        w = torch.empty(rows, cols, dtype=torch.bfloat16)
        for r in range(0, rows, 4096):  # filled in slices: this child's own peak stays small too
            w[r:r + 4096] = torch.randn(min(4096, rows - r), cols, generator=gen) * 0.02
        shard = src / f"model-0000{i}-of-00002.safetensors"
        save_file({big: w, small: torch.ones(cols, dtype=torch.bfloat16)}, str(shard))
        del w
    (src / "config.json").write_text(json.dumps({"architectures": ["Qwen3NextForCausalLM"], "torch_dtype": "bfloat16",
                                                 "hidden_size": cols, "vocab_size": rows}))


def rss_bytes() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def measure(src: Path, out: Path) -> dict:
    import compressed_tensors.compressors.pack_quantized.helpers  # noqa: F401  (imported by the run)
    import rich.progress  # noqa: F401

    from backend.models import heads
    from backend.models.prepare import prepare_checkpoint

    shutil.rmtree(out, ignore_errors=True)
    before = rss_bytes()
    report = prepare_checkpoint(src, out, heads.Recipe(parts=("lm_head", "embed_tokens")))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    largest = max(e["source_bytes"] for e in report["tensors"].values())
    return {"rss_before": before, "peak_rss": peak, "run_peak_over_before": peak - before,
            "checkpoint_bytes": report["source_bytes"], "largest_tensor_bytes": largest,
            "prepared_bytes": report["prepared_bytes"],
            "rel_error": {k: e["rel_error"] for k, e in report["tensors"].items()}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dir", type=Path)
    ap.add_argument("--rows", type=int, default=248320)
    ap.add_argument("--cols", type=int, default=5120)
    ap.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)  # the measuring child
    a = ap.parse_args()
    src, out = a.dir / "source", a.dir / "prepared"
    if a.measure:
        print(json.dumps(measure(src, out)), flush=True)
        return
    if not (src / "config.json").is_file():
        make = f"from tests.models.peak_memory import make_source; from pathlib import Path; " \
               f"make_source(Path({str(src)!r}), {a.rows}, {a.cols})"
        subprocess.run([sys.executable, "-c", make], check=True)
    res = subprocess.run([sys.executable, "-m", "tests.models.peak_memory", str(a.dir), "--measure"],
                         check=True, capture_output=True, text=True)
    print(res.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    main()

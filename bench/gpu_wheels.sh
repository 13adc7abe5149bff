#!/usr/bin/env bash
# What a lent GPU needs beside the checkout for bench/train_speed.py (and the other bench/gpu_*.sh
# calls' training side), fetched here because the GPU machine reaches no registry:
#   .whl/  the wheels its image lacks or has at other versions (its own: torch 2.11, numpy,
#          pyarrow 25, pandas, scipy, jinja2, psutil, packaging, filelock), for CPython 3.12 on x86-64
#   gpu/rows1440.jsonl.gz  bench/data_prep.make_real_rows(1,440), the rows every train_speed run
#          since 2026-11-26 used (BLAKE3 b59f21d81782 on this project's Python 3.11.7 standard library)
#   gpu/shared/tokenizers/qwen3  Qwen3's tokenizer, from ../shared
# Both folders go into .git/info/exclude: they travel as the device call's carry [".whl", "gpu"],
# never in a commit. Run from the repository root with the project's venv active.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
grep -qx '/gpu/' .git/info/exclude || echo /gpu/ >> .git/info/exclude
mkdir -p .whl gpu/shared/tokenizers
names=(transformers tokenizers huggingface-hub safetensors regex accelerate peft trl datasets blake3 doit pydantic
       pyyaml datasketch tqdm fsspec httpx2 httpcore2 truststore h11 typing_extensions pydantic-core
       typing-inspection annotated-types dill multiprocess xxhash click cloudpickle)
# the venv's versions (pyproject's pins and what they resolved to), and Liger, which only TRL's GPU runs use
pins=($(python3 -c 'import sys; from importlib.metadata import version
print(" ".join(f"{n}=={version(n)}" for n in sys.argv[1:]))' "${names[@]}") liger-kernel==0.8.5)
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64; do platforms+=(--platform "$p"); done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]}" -d .whl "${pins[@]}"
[ -f gpu/rows1440.jsonl.gz ] || python3 - <<'EOF'
import gzip, shutil, tempfile
from pathlib import Path

import blake3

from bench.data_prep import make_real_rows

with tempfile.TemporaryDirectory() as tmp:
    rows = Path(tmp) / "rows.jsonl"
    make_real_rows(rows, 1440)
    digest = blake3.blake3(rows.read_bytes()).hexdigest()[:12]
    if digest != "b59f21d81782":
        print(f"rows1440: BLAKE3 {digest}, not the b59f21d81782 of earlier runs (another Python's standard library?)")
    with open(rows, "rb") as src, gzip.open("gpu/rows1440.jsonl.gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
EOF
[ -d gpu/shared/tokenizers/qwen3 ] || { cp -r ../shared/tokenizers/qwen3 gpu/shared/tokenizers/ && chmod -R u+w gpu/shared; }
echo "$(ls .whl | wc -l) wheels; carry [\".whl\", \"gpu\"]: $(du -shc .whl gpu | tail -1 | cut -f1) beside the checkout"

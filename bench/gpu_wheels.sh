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
pins=(transformers==5.23.0 tokenizers==0.23.3 huggingface-hub==2.4.0 safetensors==0.8.0 regex==2026.11.15
      accelerate==1.15.0 peft==0.21.2 trl==1.16.0 datasets==5.2.0 blake3==1.0.11 doit==0.37.0 pydantic==2.14.3
      pyyaml==6.0.3 datasketch==2.0.0 tqdm==4.70.1 fsspec==2026.9.0 httpx2==2.16.2 httpcore2==2.16.2
      truststore==0.10.5 h11==0.16.0 typing_extensions==4.16.0 pydantic-core==2.50.4 typing-inspection==0.4.5
      annotated-types==0.8.0 dill==0.4.1 multiprocess==0.70.19 xxhash==4.1.0 click==8.5.1 cloudpickle==3.1.3
      liger-kernel==0.8.5)
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

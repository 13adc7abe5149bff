# call 2 (kind nvidia-h200, carry .whl fa4a): stage part 1 of 3 and the project's wheels
mkdir -p /tmp/fa4stage && cp fa4a/fa4p00 /tmp/fa4stage/ && cp -r .whl /tmp/fa4stage/whl && ls -la /tmp/fa4stage /tmp/fa4stage/whl | tail -3 && nvidia-smi --query-gpu=name --format=csv

# call 3 (carry fa4b): parts 2-3, then fa4_attn.py and layer_sweep_fa4.py; the FA4 import failed (cutlass is put on sys.path by a .pth file, which PYTHONPATH skips)
mkdir -p /tmp/fa4stage && cp fa4b/fa4p01 fa4b/fa4p02 /tmp/fa4stage/ && ls -la /tmp/fa4stage
cat /tmp/fa4stage/fa4p00 /tmp/fa4stage/fa4p01 /tmp/fa4stage/fa4p02 > /tmp/fa4.tar.xz && mkdir -p /tmp/fa4site && tar -C /tmp/fa4site -xJf /tmp/fa4.tar.xz && du -sh /tmp/fa4site || exit 1
export PYTHONPATH=/tmp/fa4site PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/ind2 TRITON_CACHE_DIR=/tmp/tri2
python3 -c "import flash_attn.cute, cutlass; print('fa4 ok', cutlass.__file__)" 2>&1 | tail -3
timeout 220 python3 fa4b/fa4_attn.py > $OUT/fa4_attn.log 2>&1; echo rc=$?; grep -E "^(flex|fa4)" $OUT/fa4_attn.log | cut -c1-400; tail -5 $OUT/fa4_attn.log | cut -c1-300
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/fa4stage/whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:/tmp/fa4site:$PWD TORCHINDUCTOR_CACHE_DIR=/tmp/ind3 TRITON_CACHE_DIR=/tmp/tri3 HF_HUB_OFFLINE=1
timeout 330 python3 fa4b/layer_sweep.py > $OUT/layer_fa4.log 2>&1; echo "layer rc=$?"
grep -E "^(ours|fa4|flex)" $OUT/layer_fa4.log | cut -c1-600

# call 4 (carry fa4b): the same with cutlass's folder on PYTHONPATH
P=/tmp/fa4site:/tmp/fa4site/nvidia_cutlass_dsl/dsl_packages
export PYTHONPATH=$P PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/ind2 TRITON_CACHE_DIR=/tmp/tri2
python3 -c "import flash_attn.cute, cutlass; print('fa4 ok', cutlass.__file__)" 2>&1 | tail -3
timeout 200 python3 fa4b/fa4_attn.py > $OUT/fa4_attn.log 2>&1; echo rc=$?; grep -E "^(flex|fa4)" $OUT/fa4_attn.log | cut -c1-700
export PYTHONPATH=/tmp/site:$P:$PWD TORCHINDUCTOR_CACHE_DIR=/tmp/ind3 TRITON_CACHE_DIR=/tmp/tri3 HF_HUB_OFFLINE=1
sed -i 's/^variant("flex_eager_layers", compile=False)$//' fa4b/layer_sweep.py
timeout 300 python3 fa4b/layer_sweep.py > $OUT/layer_fa4.log 2>&1; echo "layer rc=$?"
grep -E "^(ours|fa4|flex)" $OUT/layer_fa4.log | cut -c1-900

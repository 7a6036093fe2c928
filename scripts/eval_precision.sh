#!/usr/bin/env bash
# The head-of-record evaluation in both precisions (issue 26; docs/precision_eval.md):
#   1. bf16: speculative bf16 against bf16 vanilla, every divergence accounted for (near tie or failure);
#   2. fp32: speculative fp32 against fp32 vanilla, exact parity (the losslessness proof);
# both on MT-bench, 8 categories, both turns; then one line per run and each run's speedup against the
# fastest vanilla it timed on the same prompts, interleaved (eval.fastest_vanilla; docs/precision_eval.md).
#
#   scripts/eval_precision.sh HEADS CHECKPOINT [OUT_DIR] [extra eval overrides...]
#   e.g. nice -n 5 scripts/eval_precision.sh falcon outputs/runs/falcon/r1/best outputs/eval/record eval.threads=2
# Exit status: 0 when both pass, else the first failing run's status (1 = parity failure, 2 = input error).
set -u
HEADS=${1:?heads option, e.g. falcon}
CKPT=${2:?head checkpoint directory}
OUT=${3:-outputs/eval/record-$HEADS}
shift $(( $# >= 3 ? 3 : $# ))
PY=${PYTHON:-.venv/bin/python}
PROMPTS=${MT_BENCH:-/work/shared/data/mt_bench_questions.jsonl}
status=0
for DT in bfloat16 float32; do
  "$PY" -m evaluation "heads=$HEADS" "checkpoint=$CKPT" "eval.prompts=$PROMPTS" eval.turns=2 eval.num_prompts=80 \
    eval.max_new_tokens=128 "eval.dtype=$DT" "eval.output_dir=$OUT/$DT" resume=auto "$@"
  rc=$?
  echo "eval.dtype=$DT: exit $rc ($OUT/$DT/report.json)"
  if [ "$status" -eq 0 ] && [ "$rc" -ne 0 ]; then status=$rc; fi
done
"$PY" - "$OUT" <<'EOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
reps = {dt: json.loads((out / dt / "report.json").read_text()) for dt in ("bfloat16", "float32")
        if (out / dt / "report.json").is_file()}
for dt, r in reps.items():
    acc = r["parity"].get("accounting")
    par = (f"{acc['diverged']}/{acc['prompts']} diverged: {acc['near_ties']} near ties, {acc['real_errors']} real errors, "
           f"{100 * acc['share_before_first_divergence']:.1f}% of tokens before the first divergence") if acc else \
          f"exact parity {r['parity']['matched']}/{r['parity']['total']}"
    print(f"{dt}: tau {r['tau']}, vanilla {r['vanilla']['tokens_per_s']:.2f} tok/s, method {r['method']['tokens_per_s']:.2f} "
          f"tok/s, speedup {r['speedup']:.3f}x; {par}")
for dt, r in reps.items():  # each run timed the other vanillas on the same prompts (eval.fastest_vanilla)
    fv = r.get("fastest_vanilla") or {}
    if fv.get("speedup") is not None:
        print(f"{dt} method vs the fastest vanilla of its run ({fv['label']}, {fv['tokens_per_s']:.2f} tok/s; "
              f"{', '.join(f'{k} {v:.2f}' for k, v in fv['candidates'].items() if v)}): {fv['speedup']:.3f}x")
EOF
exit $status

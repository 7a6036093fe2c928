#!/usr/bin/env bash
# Issue 14's grid: for every trained tree head of a comparison run (scripts/compare.sh), fixed trees of
# 4/8/16/32/64 nodes (the search's best shape at that size) against eval.tree=auto, auto with
# eval.tree_fallback=true and, for Falcon heads, eval.tree=dynamic; all variants of a head against ONE
# vanilla pass per prompt, on all cores.  The comparison's cost model and calibrations are reused
# (output_root), so the trees are the ones its timing runs chose.
#   bash benchmarks/tree_grid.sh [COMPARE_DIR=outputs/compare] [OUT=outputs/trees] [PER_CATEGORY=1]
# Writes OUT/<head>/{summary.json,summary.md,<variant>/report.json}; resumes (finished heads are skipped,
# an interrupted one keeps its decoded prompts).  MT-bench first turns, PER_CATEGORY questions per category.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
CMP=${1:-outputs/compare}
OUT=${2:-outputs/trees}
PER=${3:-1}
THREADS=$("$PY" -c "import os; print(len(os.sched_getaffinity(0)))")
FIXED='{name: n4, tree_nodes: 4}, {name: n8, tree_nodes: 8}, {name: n16, tree_nodes: 16}, {name: n32, tree_nodes: 32}, {name: n64, tree_nodes: 64}'
FALLBACK='{name: auto_fallback, tree: auto, tree_fallback: true}'
COMMON=(eval.prompts=../shared/data/mt_bench_questions.jsonl eval.turns=1 "eval.prompts_per_category=$PER"
        eval.max_new_tokens=128 "eval.threads=$THREADS" "output_root=$CMP" resume=auto)
mkdir -p "$OUT"
for pair in falcon_k1:falcon_k1 ctc:ctc falcon:falcon eagle3:eagle3; do   # name in the comparison : heads= option
  name=${pair%%:*}; head=${pair##*:}
  ckpt="$CMP/runs/$head/compare-$name/best"
  [ -d "$ckpt" ] || { echo "skip $name: no $ckpt"; continue; }
  [ -f "$OUT/$name/summary.json" ] && { echo "skip $name: done ($OUT/$name/summary.json)"; continue; }
  variants="$FIXED, {name: auto, tree: auto}"
  case $head in falcon*) variants="$variants, {name: dynamic, tree: dynamic}";; esac
  variants="$variants, $FALLBACK"
  "$PY" -m evaluation "heads=$head" "eval.checkpoint=$ckpt" "${COMMON[@]}" "eval.variants=[$variants]" \
      "eval.output_dir=$OUT/$name"
done

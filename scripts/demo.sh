#!/usr/bin/env bash
# The main job on the packaged defaults, end to end (what `make demo` runs):
#   1. data prep: SmolLM2-135M-Instruct (packaged GGUF) over packaged ShareGPT -> cache, with
#      teacher-forced labels (labels=regenerate is the full pipeline's default and would take longer)
#   2. train the CTC-drafter head on the cache
#   3. lossless speculative decoding on held-out ShareGPT prompts vs vanilla greedy decoding
# Every stage resumes: re-running skips finished cache shards and continues the training run.
# Extra key=value arguments go to every stage (e.g. data.max_conversations=50); the stages'
# paths follow them: output_root=/x puts the run under /x/runs/ctc/<run name> and evaluates that
# head into /x/eval/<run name>; train.run_name=r2 names the run (default: demo).
set -euo pipefail

usage() {
  cat <<'EOF_USAGE'
usage: bash scripts/demo.sh [key=value ...]      (what `make demo` runs)

The main job on the packaged defaults, end to end; every stage resumes when re-run:
  1. data prep: SmolLM2-135M-Instruct (packaged GGUF) over packaged ShareGPT -> cache
     (teacher-forced labels: the base's argmax on the real prefix; labels=regenerate
     regenerates the replies with the base instead, which takes longer)
  2. train the CTC-drafter head on the cache (run <output_root>/runs/ctc/<train.run_name>)
  3. lossless speculative decoding on held-out ShareGPT prompts vs vanilla greedy decoding
     (report in <output_root>/eval/<train.run_name>/report.json)

Every key=value argument goes to all three stages (python -m data_prep / train / evaluation),
after the demo's own settings, so it wins; e.g.
  bash scripts/demo.sh data.max_conversations=50 output_root=/tmp/demo train.run_name=r2
Defaults: output_root=outputs, train.run_name=demo, labels=teacher_forced.  Environment: PY (python to use,
default .venv/bin/python), WANDB_MODE (default offline).
A stage's own options: python -m data_prep --help, python -m train --help, python -m evaluation --help.
EOF_USAGE
}
for arg in "$@"; do
  case "$arg" in
    -h|--help) usage; exit 0 ;;
  esac
done

cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
export WANDB_MODE=${WANDB_MODE:-offline}

ROOT=outputs
RUN=demo
for arg in "$@"; do  # the last value wins, as in the config composition
  case "$arg" in
    output_root=*) ROOT=${arg#output_root=} ;;
    train.run_name=*) RUN=${arg#train.run_name=} ;;
  esac
done

# Teacher-forced labels keep the demo inside its time budget (regeneration: docs/data_prep.md); every stage
# gets the same labels= so training and evaluation find the cache data prep wrote.
DEMO=(labels=teacher_forced)
START=$(date +%s)
echo "demo: data prep -> train the CTC head (150 steps) -> lossless evaluation; expected about ${DEMO_MINUTES:-12} minutes" \
  "on 2 CPU cores, plus set-up and the base model's one-time conversion (docs/demo.md)"
"$PY" -m data_prep "${DEMO[@]}" "$@"
"$PY" -m train heads=ctc train.run_name="$RUN" resume=auto \
  train.max_steps=150 train.batch_size=4 train.val_every_n_steps=50 train.scheduler.warmup_steps=20 train.optimizer.lr=3e-4 \
  "${DEMO[@]}" "$@"
# A 150-step demo head accepts little, so on a CPU no tree pays for its drafter and eval.tree=auto would size
# the tree to the smallest one: the demo exists to test the head, so it evaluates at the best 8-node tree that
# the calibration (4 held-out prompts) finds (eval.tree_nodes=8); the report's `tree` says which and predicts tau.
echo "demo: evaluating the CTC head at the best 8-node tree (eval.tree_nodes=8): a tree that exercises the head"
"$PY" -m evaluation heads=ctc checkpoint="$ROOT/runs/ctc/$RUN/best" eval.tree_nodes=8 eval.calibration_prompts=4 \
  eval.num_prompts=8 eval.max_new_tokens=64 eval.output_dir="$ROOT/eval/$RUN" resume=auto "${DEMO[@]}" "$@"
echo "demo done in $(( ($(date +%s) - START + 30) / 60 )) min: cache in $ROOT/cache, run in $ROOT/runs/ctc/$RUN," \
  "report in $ROOT/eval/$RUN/report.json"
cat <<EOF_NEXT
The summary above: parity (speculative output = vanilla greedy, token for token), tau (tokens per
base forward), "speedup" against vanilla decoding in the evaluation's own dtype (fp32, exact parity),
and the "speed headline", the figure to quote: against the fastest vanilla this machine has (bf16 where
it is native). A 150-step head is a smoke test, not a drafter: the heads trained at budget, their tau
and speedups are in docs/results.md.
Next: train another head on this cache ($PY -m train heads=falcon_k1 labels=teacher_forced), evaluate it on MT-bench
(docs/evaluation.md, docs/glossary.md for the questions' file), or plan the comparison of record (bash scripts/compare.sh --dry-run eval.prompts=/path/to/mt_bench_questions.jsonl).
EOF_NEXT

#!/usr/bin/env bash
# A recall head for a real base and its held-out evaluation, with the library's public commands only.
# The base's settings live in a profile (benchmarks/heads/<profile>.env); every step is resumable: rerun the
# script and finished work is skipped or continued. Long; run it in the background, one thread:
#   PROFILE=gemma3-270m RUN=runs/gemma nohup bash benchmarks/heads/pipeline.sh > gemma.log 2>&1 &
# STEPS selects steps (default: all), e.g. STEPS="cache train". (benchmarks/smollm2/pipeline.sh made the
# shipped SmolLM2 head before this script existed; it is kept as the record of that run.)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=/dev/null
source "$here/${PROFILE:?set PROFILE, e.g. gemma3-270m}.env"
RUN=${RUN:-runs/$PROFILE}; STEPS=${STEPS:-"fetch data cache train calibrate test diagnose"}
export OMP_NUM_THREADS=1  # one thread per job is faster than two on a busy 2-core machine
oda=(oda); py=(python)
cap=(); [ -n "${MAX_NEW:-}" ] && cap=(--max-new-tokens "$MAX_NEW")  # output cap of every prompt, if the profile sets one
width=(); [ -n "${HEAD_WIDTH:-}" ] && width=(--head-width "$HEAD_WIDTH")  # head tower width, if not hidden / 2
chat=(); plain=(--no-chat-template)  # evaluation flag / prompt-writing flag
[ "$CHAT" = 1 ] && { chat=(--chat-template); plain=(); }
mkdir -p "$RUN"
has() { [[ " $STEPS " == *" $1 "* ]]; }
has fetch && "${oda[@]}" fetch "$BASE"
if has data; then
  [ -f "$RUN/train.jsonl" ] || "${py[@]}" "$here/../smollm2/head_data.py" --tokenizer "$BASE" "${plain[@]}" \
    --lengths $TRAIN_LENGTHS --n $TRAIN_N --prose "$TRAIN_PROSE" --prose-tokens "$SEQ_LEN" \
    --max-position-embeddings "$CONTEXT" --answers "${ANSWERS:-gold}" "${cap[@]}" --out "$RUN/train.jsonl"
  [ -f "$RUN/test_references.jsonl" ] || "${py[@]}" "$here/../smollm2/head_data.py" --tokenizer "$BASE" \
    "${plain[@]}" --split test --reference-window 32 --lengths $TRAIN_LENGTHS --n 1 1 --prose 4 \
    --prose-tokens "$SEQ_LEN" --max-position-embeddings "$CONTEXT" --out "$RUN/test_references.jsonl"
  [ -f "$RUN/ruler-dev/kjv/manifest.json" ] || "${oda[@]}" ruler --tokenizer "$BASE" "${plain[@]}" \
    --lengths "$DEV_LENGTH" --split dev --n "$DEV_N" --haystack kjv --out "$RUN/ruler-dev/kjv" --no-progress
  [ -f "$RUN/ruler-test/kjv/manifest.json" ] || "${oda[@]}" ruler --tokenizer "$BASE" "${plain[@]}" \
    --lengths $TEST_LENGTHS --split test --n "$TEST_N" --haystack kjv --out "$RUN/ruler-test/kjv" --no-progress
fi
# Rows of SEQ_LEN + 256 tokens: a RULER training document is a prompt of up to SEQ_LEN tokens plus its answer; packed
# at SEQ_LEN, the 2,048-token prompts' answers fell into dropped last pieces (cache-supervision now warns of splits).
has cache && "${oda[@]}" cache-supervision --base "$BASE" --data "$RUN/train.jsonl" --output "$RUN/cache" \
  --sinks "$SINKS" --window "$WINDOW" --tau-hist 0.001 --seq-len "$((SEQ_LEN + 256))" --rows-per-shard 8 --threads 1
also=(${ALSO_TRAIN_ON:-})  # caches of other runs the head also trains on, if the profile names any
has train && { [ -f "$RUN/head/model.safetensors" ] || "${oda[@]}" train-head --base "$BASE" --from-cache "$RUN/cache" "${also[@]}" \
  --output "$RUN/head" --epochs "$EPOCHS" --batch-size 4 --warmup-steps 20 --save-steps 64 "${width[@]}" \
  --threads "${TRAIN_THREADS:-1}"; }
has calibrate && "${oda[@]}" calibrate --base "$BASE" --head "$RUN/head" --data "$RUN/ruler-dev/kjv/$DEV_LENGTH" \
  --within-full 2 --grid $GRID "${chat[@]}" "${cap[@]}" --out "$RUN/calibrate-dev" --threads 1
# The dev-calibrated threshold (the calibrate step's choice)
calibrated() { python -c "import json,sys; print(json.load(open(sys.argv[1]))['chosen']['threshold'])" \
  "$RUN/calibrate-dev/calibration.json"; }
head=${HEAD:-$RUN/head}  # HEAD: evaluate another head, e.g. the shipped one (HEAD=$BASE)
if has test; then  # every policy of a prompt shares one Full prefill
  theta=$(calibrated)
  for L in $TEST_LENGTHS; do
    "${oda[@]}" eval --base "$BASE" --head "$head" --suite jsonl "${chat[@]}" "${cap[@]}" --data "$RUN/ruler-test/kjv/$L" \
      --policies full local oda random --thresholds "$theta" --seeds 42 43 44 --primary-threshold "$theta" \
      --sinks "$SINKS" --window "$WINDOW" --limit "${LIMIT:-$TEST_N}" --out "$RUN/oda-test/$L"
  done
fi
if has budget; then  # not a default step: a Full-call budget that holds (BudgetPolicy at the calibrated threshold)
  # against Random at the same rates, on the first test length (BUDGET_LENGTH to pick another)
  L=${BUDGET_LENGTH:-${TEST_LENGTHS%% *}}; theta=${THETA:-$(calibrated)}
  "${oda[@]}" eval --base "$BASE" --head "$head" --suite jsonl "${chat[@]}" "${cap[@]}" --data "$RUN/ruler-test/kjv/$L" \
    --policies budget:0.25 budget:0.4 random:0.25 random:0.4 --thresholds "$theta" --seeds 42 43 \
    --sinks "$SINKS" --window "$WINDOW" --limit "${LIMIT:-$TEST_N}" --out "$RUN/budget-test/$L"
fi
has diagnose && "${oda[@]}" diagnose --base "$BASE" --head "$head" --data "$RUN/test_references.jsonl" \
  --positions 128 --out "$RUN/diagnose-test" --no-progress
exit 0

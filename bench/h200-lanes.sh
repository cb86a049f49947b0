#!/usr/bin/env bash
# Two GPUs, two lanes of `bench/h200.sh` stages at once, then an optional third list run alone
# (for stages that time the host and must not share the CPU):
#   bench/h200-lanes.sh "STAGES ON GPU 0" "STAGES ON GPU 1" ["STAGES AFTER, GPU 0"]
# A list may hold its own settings, each for the stages after it:
#   "REFERENCE=1 TRAFFIC=chat plans DECODE_PLANS=triton,bench/plans/x.json decode-bs1".
# Each lane writes under $OUT/gpuN; everything is packed into $OUT/results.tgz at the end. Under a
# call's time limit, wrap it: `timeout 550 bench/h200-lanes.sh ...; bench/h200-lanes.sh --pack`
# packs whatever the stages had written when the limit struck.
set -uo pipefail
OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT"
here=$(dirname "$0")
pack() {
  tar czf /tmp/results.tgz -C "$OUT" . && rm -rf "${OUT:?}"/* && mv /tmp/results.tgz "$OUT/results.tgz"
  echo "packed into $OUT/results.tgz"
}
if [ "${1:-}" = --pack ]; then
  [ -f "$OUT/results.tgz" ] || pack
  exit 0
fi

stages() {  # stages GPU OUTDIR LOG "[NAME=VALUE...] STAGE...": each NAME=VALUE applies to the stages after it
  local w vars=()
  for w in $4; do
    if [[ $w == *=* ]]; then vars+=("$w"); continue; fi
    env CUDA_VISIBLE_DEVICES="$1" OUT="$2" PACK=0 "${vars[@]}" bash "$here/h200.sh" "$w" >> "$3" 2>&1
  done
}
lane() {  # lane GPU "[NAME=VALUE...] STAGES"
  stages "$1" "$OUT/gpu$1" "$OUT/lane$1.log" "$2"
}
lane 0 "$1" &
lane 1 "${2:-}" &
wait
after() {  # the third list, alone on GPU 0
  stages 0 "$OUT/after" "$OUT/after.log" "$1"
}
[ -n "${3:-}" ] && after "$3"
for f in "$OUT"/lane*.log "$OUT"/after.log; do
  [ -f "$f" ] && { echo "##### $f"; grep -E "^=== " "$f"; }
done
pack

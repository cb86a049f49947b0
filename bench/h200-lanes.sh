#!/usr/bin/env bash
# Two GPUs, two lanes of `bench/h200.sh` stages at once, then an optional third list run alone
# (for stages that time the host and must not share the CPU):
#   bench/h200-lanes.sh "STAGES ON GPU 0" "STAGES ON GPU 1" ["STAGES AFTER, GPU 0"]
# A lane may start with its own settings: "REFERENCE=1 TRAFFIC=chat plans".
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

lane() {  # lane GPU "[NAME=VALUE...] STAGES": the assignments are this lane's environment only
  local w vars=() stages=()
  for w in $2; do [[ $w == *=* ]] && vars+=("$w") || stages+=("$w"); done
  env CUDA_VISIBLE_DEVICES="$1" OUT="$OUT/gpu$1" PACK=0 "${vars[@]}" bash "$here/h200.sh" "${stages[@]}" \
    > "$OUT/lane$1.log" 2>&1
}
lane 0 "$1" &
lane 1 "${2:-}" &
wait
after() {  # the third list, alone on GPU 0; "NAME=VALUE" words apply to the stages after them
  local w vars=()
  for w in $1; do
    if [[ $w == *=* ]]; then vars+=("$w"); continue; fi
    env CUDA_VISIBLE_DEVICES=0 OUT="$OUT/after" PACK=0 "${vars[@]}" bash "$here/h200.sh" "$w" >> "$OUT/after.log" 2>&1
  done
}
[ -n "${3:-}" ] && after "$3"
for f in "$OUT"/lane*.log "$OUT"/after.log; do
  [ -f "$f" ] && { echo "##### $f"; grep -E "^=== " "$f"; }
done
pack

#!/usr/bin/env bash
# Fast-tier wall-clock spread with the process unpinned, pinned to the CPUs of the GPU's NUMA node,
# and pinned to one of those CPUs, side by side (session 4: unpinned run medians jumped between two
# host-time levels, 0.78 vs 1.0 ms at bs=1, which reads like the thread landing on another node).
#   OUT=/tmp/out bash bench/spread_affinity.sh
set -uo pipefail
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
bus=$(nvidia-smi --query-gpu=pci.bus_id --format=csv,noheader -i 0 | sed 's/^0000//' | tr 'A-F' 'a-f')
node_cpus=$(cat "/sys/bus/pci/devices/$bus/local_cpulist")
one_cpu=${node_cpus%%[-,]*}
echo "GPU 0 at $bus, its NUMA node's CPUs: $node_cpus; one CPU: $one_cpu; machine: $(nproc) CPUs"
run() {  # run NAME [taskset args...]
  local name=$1; shift
  CUDA_VISIBLE_DEVICES=0 timeout 150 "$@" python3 bench/spread.py --model random:llama-3.1-8b --layers 2 \
    --plan bench/plans/triton.json --runs 20 --steps 20 --name "spread-llama-3.1-8b-k2-$name" --out "$OUT" \
    2>&1 | grep -E "ranked step|wrote|Error"
}
run unpinned env
run node taskset -c "$node_cpus"
run one-cpu taskset -c "$one_cpu"

#!/usr/bin/env bash
# The speed figures of docs/BENCHMARKS.md in one sequential run (machine otherwise idle, ~12 min): roofline and
# mixed64 against its ideal-schedule ceiling (3 plain and 3 speculative runs, alternating; the best run's plot),
# where a run's step time goes, speculative vs plain decoding, and the HF transformers peers on mixed64.
# Output: this script's stdout (kept as docs/bench/speed_report.txt), JSON in docs/bench/, plot in docs/img/;
# the figures are copied into docs/BENCHMARKS.md by hand.
set -euo pipefail
cd "$(dirname "$0")/.."
COBATCH=${COBATCH:-.venv/bin/cobatch}
PY=${PY:-.venv/bin/python}
MIXED=(--num-prompts 64 --input-len 64-256 --output-len 8-32,128-256)
uptime
$COBATCH bench roofline --dtype bfloat16 --max-num-seqs 64 --batch-sizes 1,8,32,64 --contexts 64,256 \
    --num-speculative-tokens 3 --workload mixed64 --runs 3 --output-json docs/bench/roofline.json \
    --plot docs/img/run_vs_ceiling.png
uptime
$COBATCH bench offline --workload mixed64 --max-num-seqs 64 --dtype bfloat16 --profile
uptime
$PY -m benchmarks.spec_decode_ab --num-speculative-tokens 3 --output-json docs/bench/spec_decode.json
uptime
$PY -m benchmarks.peers --dtype bfloat16 --max-num-seqs 64 "${MIXED[@]}" --hf-static-batch-sizes 32,64
uptime

#!/usr/bin/env bash
# The issue-5 speed figures in one sequential run (machine otherwise idle): roofline + mixed64 vs its
# ideal-schedule ceiling (best and median of 3 engine runs, plain and with 3 speculative tokens, alternating),
# speculative vs plain decoding on mixed64 and chat answers, peers on mixed64 (cobatch continuous/static, HF static at 32 and 64, HF CB), and
# where the step time goes. JSON lands in docs/bench/; figures are copied into docs/BENCHMARKS.md by hand.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/cobatch}
MIXED=(--num-prompts 64 --input-len 64-256 --output-len 8-32,128-256)
uptime
$PY bench roofline --dtype bfloat16 --max-num-seqs 64 --batch-sizes 1,8,32,64 --contexts 64,256 --num-speculative-tokens 3 \
    --workload mixed64 --runs 3 --output-json docs/bench/roofline.json --plot docs/img/run_vs_ceiling.png
uptime
$PY bench offline --workload mixed64 --max-num-seqs 64 --dtype bfloat16 --profile
uptime
.venv/bin/python scripts/spec_decode_ab.py --num-speculative-tokens 3 --output-json docs/bench/spec_decode.json
uptime
$PY bench peers --dtype bfloat16 --max-num-seqs 64 "${MIXED[@]}" --hf-static-batch-sizes 32,64
uptime

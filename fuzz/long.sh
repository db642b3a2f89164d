#!/usr/bin/env bash
# `make fuzz-long`: every fuzz target for at least RUNS executions (default 10 million), one
# after another, with the counts libFuzzer reports written to docs/fuzz-long.md. A crash stops
# the run and leaves its input in fuzz/artifacts/ as libFuzzer does.
set -euo pipefail
cd "$(dirname "$0")"
runs=${RUNS:-10000000}
out=../docs/fuzz-long.md
rows=()
for t in "$@"; do
  echo "fuzz-long: $t for $runs runs"
  log=$(mktemp)
  # -runs counts executions; libFuzzer prints "Done N runs in S second(s)" at the end.
  if ! RUSTC_BOOTSTRAP=1 ${CARGO:-cargo} fuzz run -O "$t" -- -runs="$runs" >"$log" 2>&1; then
    grep -E '^(==[0-9]+==|SUMMARY|thread .* panicked)|ERROR' "$log" || tail -20 "$log"
    rm -f "$log"
    exit 1
  fi
  done_line=$(grep -E '^Done [0-9]+ runs in [0-9]+ second' "$log" | tail -1)
  cov=$(grep -oE 'cov: [0-9]+' "$log" | tail -1 | cut -d' ' -f2)
  rm -f "$log"
  n=$(echo "$done_line" | awk '{print $2}')
  s=$(echo "$done_line" | awk '{print $5}')
  echo "  $done_line"
  rows+=("| \`$t\` | $n | $s | ${cov:-?} |")
done
{
  echo "# Long fuzz runs"
  echo
  echo "Written by \`make fuzz-long\` (fuzz/long.sh) on $(date -u +%Y-%m-%d) at commit"
  echo "$(git rev-parse --short HEAD), $(nproc) cores. Each target ran under libFuzzer with"
  echo "AddressSanitizer (\`cargo fuzz run -O\`) from the corpus it had, for the executions below,"
  echo "and found nothing. \`make test\` runs the same targets for a few seconds each (the smoke)."
  echo
  echo "| target | executions | seconds | coverage (edges) |"
  echo "|---|---:|---:|---:|"
  printf '%s\n' "${rows[@]}"
} >"$out"
echo "wrote docs/fuzz-long.md"

#!/usr/bin/env bash
# `make fuzz-long`: every fuzz target named on the command line for at least RUNS executions
# (default 10 million), one after another, with the counts libFuzzer reports written to
# docs/fuzz-long.md; the targets of fuzz/fuzz_targets that were not run are listed there too.
# A crash stops the run and leaves its input in fuzz/artifacts/ as libFuzzer does.
set -euo pipefail
cd "$(dirname "$0")"
runs=${RUNS:-10000000}
out=../docs/fuzz-long.md
log=$(mktemp)
trap 'rm -f "$log"' EXIT
rows=()
for t in "$@"; do
  echo "fuzz-long: $t for $runs runs"
  if ! RUSTC_BOOTSTRAP=1 ${CARGO:-cargo} fuzz run -O "$t" -- -runs="$runs" >"$log" 2>&1; then
    grep -E '^(==[0-9]+==|SUMMARY|thread .* panicked)|ERROR' "$log" || tail -20 "$log"
    exit 1
  fi
  # libFuzzer ends with "Done N runs in S second(s)"; its status lines carry "cov: N".
  done_line=$(grep -E '^Done [0-9]+ runs in [0-9]+ second' "$log" | tail -1 || true)
  if [ -z "$done_line" ]; then
    echo "fuzz-long: $t ended without libFuzzer's summary line:" >&2
    tail -20 "$log" >&2
    exit 1
  fi
  cov=$(grep -oE 'cov: [0-9]+' "$log" | tail -1 | cut -d' ' -f2 || true)
  echo "  $done_line"
  rows+=("| \`$t\` | $(echo "$done_line" | awk '{print $2}') | $(echo "$done_line" | awk '{print $5}') | ${cov:-?} |")
done
not_run=()
for f in fuzz_targets/*.rs; do
  name=$(basename "$f" .rs)
  [[ " $* " == *" $name "* ]] || not_run+=("\`$name\`")
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
  if [ ${#not_run[@]} -gt 0 ]; then
    printf -v list '%s, ' "${not_run[@]}"
    echo
    echo "Not run this time: ${list%, }."
  fi
} >"$out"
echo "wrote docs/fuzz-long.md"

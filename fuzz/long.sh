#!/usr/bin/env bash
# `make fuzz-long`: every fuzz target named on the command line for at least RUNS executions
# (default 10 million), one after another, with the counts libFuzzer reports written to
# docs/fuzz-long.md. Each target's row is written as soon as it finishes, with its commit and
# date, and rows of targets not run this time are kept: a long run may be done in parts (OUT
# names another file). The targets of fuzz/fuzz_targets that have no row yet are listed too.
# A crash stops the run and leaves its input in fuzz/artifacts/ as libFuzzer does.
set -euo pipefail
cd "$(dirname "$0")"
runs=${RUNS:-10000000}
out=${OUT:-../docs/fuzz-long.md}
log=$(mktemp)
trap 'rm -f "$log"' EXIT

# Rows by target (a row of the table, "| `name` | …"): this run's, and those the file has
# (read again before each write, so that two runs at once keep each other's rows).
declare -A rows mine
read_rows() {
  [ -f "$out" ] || return 0
  local line name
  while IFS= read -r line; do
    name=$(echo "$line" | sed -nE 's/^\| `([a-z0-9_]+)` \|.*/\1/p')
    if [ -n "$name" ] && [ -z "${mine[$name]:-}" ]; then rows[$name]=$line; fi
  done <"$out"
}

write() {
  local never=()
  read_rows
  {
    echo "# Long fuzz runs"
    echo
    echo "Written by \`make fuzz-long\` (fuzz/long.sh) on $(nproc) cores. Each target ran under"
    echo "libFuzzer with AddressSanitizer (\`cargo fuzz run -O\`) from the corpus it had, for the"
    echo "executions below, at the commit and on the day its row gives, and found nothing."
    echo "\`make test\` runs the same targets for a few seconds each (the smoke)."
    echo
    echo "| target | executions | seconds | coverage (edges) | commit | date |"
    echo "|---|---:|---:|---:|---|---|"
    for f in fuzz_targets/*.rs; do
      name=$(basename "$f" .rs)
      if [ -n "${rows[$name]:-}" ]; then echo "${rows[$name]}"; else never+=("\`$name\`"); fi
    done
    if [ ${#never[@]} -gt 0 ]; then
      printf -v list '%s, ' "${never[@]}"
      echo
      echo "Not run yet: ${list%, }."
    fi
  } >"$out"
}

commit=$(git rev-parse --short HEAD)
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
  mine[$t]=1
  rows[$t]="| \`$t\` | $(echo "$done_line" | awk '{print $2}') | $(echo "$done_line" | awk '{print $5}') | ${cov:-?} | $commit | $(date -u +%Y-%m-%d) |"
  write
done
write
echo "wrote $out"

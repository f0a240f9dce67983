#!/usr/bin/env bash
# Build and run enginescope's fuzz targets (fuzz/, docs/fuzzing.md) with libFuzzer on stable
# Rust: libfuzzer-sys links libFuzzer, and the SanitizerCoverage instrumentation it needs is
# asked of LLVM through stable codegen flags (the same ones `cargo fuzz` passes). No sanitizer:
# the code under test is safe Rust, and -Zsanitizer needs nightly.
#
#   scripts/fuzz.sh build                 build every target (fuzz/target, release + debug assertions)
#   scripts/fuzz.sh run TARGET SECONDS    run one target that long from its committed seeds
#   scripts/fuzz.sh smoke SECONDS         every target SECONDS each (CI: scripts/test.sh)
#   scripts/fuzz.sh list                  the targets
#
# New inputs go to fuzz/work/TARGET (not committed; the committed seeds stay small), crashes
# to fuzz/artifacts/TARGET; a crash, a hang (-timeout) or an out-of-memory fails the run.
set -euo pipefail
cd "$(dirname "$0")/../fuzz"
TARGETS=(recording prom_text linetable opcodes walker elf debug_offsets http_request)
TRIPLE=$(rustc -vV | sed -n 's/^host: //p')
BIN=target/$TRIPLE/release

build() {
  # --target keeps these flags off build scripts and proc macros.
  RUSTFLAGS="-Cpasses=sancov-module -Cllvm-args=-sanitizer-coverage-level=4 \
-Cllvm-args=-sanitizer-coverage-inline-8bit-counters -Cllvm-args=-sanitizer-coverage-pc-table \
-Cllvm-args=-sanitizer-coverage-trace-compares --cfg fuzzing -Cdebug-assertions -Coverflow-checks" \
    cargo build --release --locked --target "$TRIPLE" --bins
}

max_len() {
  case $1 in
    # The real /metrics page is 54 KB; mutating inputs of that size is slow (~20 exec/s here),
    # and every construct in it appears in its first 16 KB.
    http_request | prom_text) echo 16384 ;;
    linetable | opcodes) echo 8192 ;;
    *) echo 131072 ;;
  esac
}

run() {
  local t=$1 secs=$2
  shift 2
  mkdir -p "work/$t" "artifacts/$t"
  echo "==> fuzz $t for ${secs}s"
  "$BIN/$t" "work/$t" "corpus/$t" -max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 \
    -malloc_limit_mb=1024 -max_len="$(max_len "$t")" -print_final_stats=1 \
    -artifact_prefix="artifacts/$t/" "$@"
}

case ${1:-} in
  build) build ;;
  list) printf '%s\n' "${TARGETS[@]}" ;;
  run)
    [ $# -ge 3 ] || { echo "usage: $0 run TARGET SECONDS [libFuzzer flags]" >&2; exit 2; }
    build # a no-op when the targets are up to date; a stale binary would fuzz old code
    t=$2 s=$3
    shift 3
    run "$t" "$s" "$@"
    ;;
  smoke)
    secs=${2:-15}
    build
    mkdir -p work # ignored by git: absent on a fresh clone
    for t in "${TARGETS[@]}"; do
      rc=0
      run "$t" "$secs" > "work/$t.log" 2>&1 || rc=$?
      grep -E "^(==>|#[0-9]+ *DONE|stat::number_of_executed_units)" "work/$t.log" || true
      if [ "$rc" != 0 ]; then
        tail -40 "work/$t.log" >&2
        echo "fuzz smoke: $t failed (rc $rc; the input is in fuzz/artifacts/$t)" >&2
        exit 1
      fi
    done
    ;;
  *) echo "usage: $0 build | run TARGET SECONDS | smoke SECONDS | list" >&2; exit 2 ;;
esac

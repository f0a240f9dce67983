#!/usr/bin/env bash
# Build the BPF objects from ebpf/*.bpf.c with Debian's clang-14 (`apt-get install clang llvm
# libbpf-dev`). The output must not depend on where the checkout lives: debug paths are mapped
# to a fixed prefix and DWARF is stripped (BTF stays). CI rebuilds and compares with the
# committed objects (scripts/check-bpf-objects.sh).
set -euo pipefail
cd "$(dirname "$0")"
out=${1:-.}
for src in *.bpf.c; do
  obj="$out/${src%.c}.o"
  clang -O2 -g -target bpf -D__TARGET_ARCH_x86 -I. -I/usr/include/x86_64-linux-gnu \
    -fdebug-prefix-map="$(pwd)"=ebpf -fno-ident \
    -Wall -Werror -c "$src" -o "$obj"
  llvm-strip -g "$obj"
done

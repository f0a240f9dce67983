"""Print one interpreter's opcode facts for src/cpython/opcodes.rs.

enginescope walks a code object's adaptive bytecode (co_code_adaptive) from outside to find the
instructions that return (where `record --probe` puts its exit breakpoints). The walk needs, for
every opcode byte that can appear there (specialized forms included), the number of inline cache
code units that follow it, and whether it returns. These tables come from the interpreter's own
`opcode`/`dis` modules; run this with each supported minor version and paste the output.

    python3.X tools/opcodes.py
"""
import dis
import opcode
import sys

ver = sys.version_info[:2]
opmap = dict(opcode.opmap)
spec_map = {}
for mod in (dis, opcode):
    for name in ("_specialized_opmap", "_all_opmap"):
        m = getattr(mod, name, None)
        if hasattr(m, "keys"):
            spec_map.update(m)
try:
    import _opcode_metadata  # 3.13+

    spec_map.update(getattr(_opcode_metadata, "_specialized_opmap", {}))
    specializations = dict(getattr(_opcode_metadata, "_specializations", {}))
except ImportError:
    specializations = {}
if not specializations:
    specializations = dict(getattr(opcode, "_specializations", {}) or getattr(dis, "_specializations", {}))
if ver <= (3, 11) and hasattr(opcode, "_specialized_instructions"):
    # 3.11 numbers specialized instructions into the free opcode slots, in order.
    free = [i for i in range(256) if opcode.opname[i].startswith("<")]
    for name, num in zip(opcode._specialized_instructions, free):
        spec_map.setdefault(name, num)
allmap = {**spec_map, **opmap}
base_of = {}
for base, specs in specializations.items():
    for s in specs:
        base_of[s] = base

caches_raw = opcode._inline_cache_entries
def caches(name):
    if hasattr(caches_raw, "keys"):
        if name in caches_raw:
            return caches_raw[name]
        return caches_raw.get(allmap.get(name), 0)
    num = opmap.get(name)
    return caches_raw[num] if num is not None else 0

table = []
for name, num in sorted(allmap.items(), key=lambda kv: kv[1]):
    if not 0 <= num < 256:
        continue
    base = base_of.get(name, name)
    kind = "R" if base in ("RETURN_VALUE", "RETURN_CONST") else "G" if base == "RETURN_GENERATOR" else "-"
    if name.startswith("INSTRUMENTED_") or name == "ENTER_EXECUTOR":
        kind = "X"
    table.append((num, caches(base), kind, name))
print(f"// {sys.version.split()[0]}")
print(f"(3, {ver[1]}, &[" + ", ".join(f"({n}, {c}, b'{k}')" for n, c, k, _ in table) + "]),")

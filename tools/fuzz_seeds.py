"""Write line-table and bytecode seeds for the fuzz targets from this interpreter's own code
objects (docs/fuzzing.md). Usage: python3.X tools/fuzz_seeds.py OUTDIR

OUTDIR/linetable/py3X-N: kind byte (0: 3.10 table, 1: 3.11+), co_firstlineno (i32 LE), a byte
address inside the code (i32 LE), co_linetable.
OUTDIR/opcodes/py3X-N (3.11+): minor - 10, then the adaptive bytecode (after the code ran, so
it holds specialized instructions and inline caches as the walker sees them live).
"""
import json.decoder
import os
import struct
import sys
import threading

out = sys.argv[1]
minor = sys.version_info[1]
for d in ("linetable", "opcodes"):
    os.makedirs(os.path.join(out, d), exist_ok=True)

# Warm the code up so the adaptive bytecode is specialized.
for _ in range(200):
    json.decoder.JSONDecoder().decode('{"a": [1, 2.5, "x", null, true]}')
    threading.Event().is_set()


def gen():
    yield 1
    yield 2


picked = [
    json.decoder.JSONDecoder.decode.__code__,
    json.decoder.JSONDecoder.raw_decode.__code__,
    threading.Condition.wait.__code__,
    threading.Thread.__init__.__code__,
    threading.Event.wait.__code__,
    gen.__code__,
]
for n, co in enumerate(picked):
    name = "py3%d-%d" % (minor, n)
    kind = 0 if minor == 10 else 1
    addr = len(co.co_code) // 2 & ~1
    with open(os.path.join(out, "linetable", name), "wb") as f:
        f.write(bytes([kind]) + struct.pack("<ii", co.co_firstlineno, addr) + co.co_linetable)
    if minor >= 11:
        code = getattr(co, "_co_code_adaptive", co.co_code)
        with open(os.path.join(out, "opcodes", name), "wb") as f:
            f.write(bytes([minor - 10]) + code)
print("wrote %d code objects from 3.%d" % (len(picked), minor))

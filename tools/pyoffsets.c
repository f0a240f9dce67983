/* Prints the CPython struct offsets enginescope's static tables (src/cpython/offsets.rs) rely on,
 * computed by the compiler from the interpreter's own internal headers. Used by
 * tests/offsets_match_headers.rs: build once per installed interpreter with
 *   cc -DPy_BUILD_CORE -I$PREFIX/include/python3.X -I$PREFIX/include/python3.X/internal
 * and compare the `name=value` lines with `enginescope doctor --offsets-table 3.X`. */
#define Py_BUILD_CORE 1
#include <Python.h>
#include <stddef.h>
#include <stdio.h>
#include "internal/pycore_runtime.h"
#include "internal/pycore_interp.h"
#include "internal/pycore_pystate.h"
#if PY_VERSION_HEX >= 0x030B0000
#include "internal/pycore_frame.h"
#include "internal/pycore_code.h"
#else
#include "frameobject.h"
#endif
#include "internal/pycore_gc.h"
#include "internal/pycore_gil.h"

#define P(name, val) printf("%s=%lu\n", name, (unsigned long)(val))

int main(void) {
    P("runtime.interpreters_head", offsetof(_PyRuntimeState, interpreters.head));
#if PY_VERSION_HEX < 0x030C0000
    P("runtime.gil", offsetof(_PyRuntimeState, ceval.gil));
#else
    P("interp.ceval_gil", offsetof(PyInterpreterState, ceval.gil));
#endif
    P("gil.locked", offsetof(struct _gil_runtime_state, locked));
    P("gil.last_holder", offsetof(struct _gil_runtime_state, last_holder));
#if PY_VERSION_HEX >= 0x030B0000
    P("interp.threads_head", offsetof(PyInterpreterState, threads.head));
#else
    P("interp.threads_head", offsetof(PyInterpreterState, tstate_head));
#endif
    P("interp.next", offsetof(PyInterpreterState, next));
    P("interp.gc", offsetof(PyInterpreterState, gc));
    P("gc.collecting", offsetof(struct _gc_runtime_state, collecting));
    P("gc.generation_stats", offsetof(struct _gc_runtime_state, generation_stats));
    P("tstate.next", offsetof(PyThreadState, next));
    P("tstate.interp", offsetof(PyThreadState, interp));
    P("tstate.thread_id", offsetof(PyThreadState, thread_id));
#if PY_VERSION_HEX >= 0x030B0000
    P("tstate.native_thread_id", offsetof(PyThreadState, native_thread_id));
    P("tstate.cframe", offsetof(PyThreadState, cframe));
    P("cframe.current_frame", offsetof(_PyCFrame, current_frame));
    P("frame.previous", offsetof(_PyInterpreterFrame, previous));
    P("frame.code", offsetof(_PyInterpreterFrame, f_code));
    P("frame.prev_instr", offsetof(_PyInterpreterFrame, prev_instr));
#if PY_VERSION_HEX >= 0x030C0000
    /* 3.12+: owner == FRAME_OWNED_BY_CSTACK marks shim frames. 3.11 has none (is_entry marks
     * real frames entered from C), so enginescope reads neither field there. */
    P("frame.owner", offsetof(_PyInterpreterFrame, owner));
#endif
    P("code.qualname", offsetof(PyCodeObject, co_qualname));
    P("code.code_adaptive", offsetof(PyCodeObject, co_code_adaptive));
#else
    P("tstate.frame", offsetof(PyThreadState, frame));
    P("frame.previous", offsetof(PyFrameObject, f_back));
    P("frame.code", offsetof(PyFrameObject, f_code));
    P("frame.lasti", offsetof(PyFrameObject, f_lasti));
#endif
    P("code.filename", offsetof(PyCodeObject, co_filename));
    P("code.name", offsetof(PyCodeObject, co_name));
    P("code.linetable", offsetof(PyCodeObject, co_linetable));
    P("code.firstlineno", offsetof(PyCodeObject, co_firstlineno));
    P("unicode.length", offsetof(PyASCIIObject, length));
    P("unicode.state", offsetof(PyASCIIObject, state));
    P("unicode.ascii_size", sizeof(PyASCIIObject));
    P("unicode.compact_size", sizeof(PyCompactUnicodeObject));
    P("bytes.ob_size", offsetof(PyBytesObject, ob_base.ob_size));
    P("bytes.ob_sval", offsetof(PyBytesObject, ob_sval));
    P("runtime.main_thread", offsetof(_PyRuntimeState, main_thread));
#if PY_VERSION_HEX >= 0x030C0000
    P("interp.modules", offsetof(PyInterpreterState, imports.modules));
#else
    P("interp.modules", offsetof(PyInterpreterState, modules));
#endif
#if PY_VERSION_HEX >= 0x030B0000
    /* ≤3.10 reads instance dicts through tp_dictoffset, not the class's shared keys. */
    P("heaptype.cached_keys", offsetof(PyHeapTypeObject, ht_cached_keys));
#endif
    return 0;
}

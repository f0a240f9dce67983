//! `_Py_DebugOffsets` (3.13+): the struct at `_PyRuntime` that says where everything is, read
//! from fake memory (fuzz/src/fakeproc.rs; seeds are real interpreters' structs), checked and
//! turned into the walker's offsets, with and without an expected version.
#![no_main]

use enginescope::cpython::offsets::read_debug_offsets;
use enginescope::cpython::version::PyVersion;
use enginescope_fuzz::fakeproc;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some(fp) = fakeproc::decode(data) else {
        return;
    };
    if let Ok((v, d, o)) = read_debug_offsets(&fp.mem, fp.runtime_addr, None) {
        let _ = o.header_check_lines();
        let _ = enginescope::cpython::offsets::offsets_from_debug(&d, v);
    }
    let expected = PyVersion::new(3, fp.minor, 0);
    let _ = read_debug_offsets(&fp.mem, fp.runtime_addr, Some(expected));
});

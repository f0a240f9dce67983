//! The ELF reader that finds `_PyRuntime`, symbols, `.bss` and the build id in a mapped file
//! (the target's own binary or libpython: attacker-controlled), the version-string scan, and
//! the x86 decoders that read the collector's code from that file for the GC uprobes (the
//! input's first 4 KiB taken as code).
#![no_main]

use enginescope::cpython::binary::{
    call_start, first_direct_call, flag_stores, inspect_elf, sets_collecting,
};
use enginescope::cpython::version::{scan_for_version, PyVersion};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = inspect_elf(data);
    let _ = scan_for_version(data);
    let code = &data[..data.len().min(4096)];
    let _ = flag_stores(code, 0x40_0000, 0x350);
    let _ = call_start(code, 0x40_0000);
    let _ = first_direct_call(code, 0x40_0000);
    let _ = sets_collecting(code, 0x40_0000, 0x1db0);
    if let Ok(s) = std::str::from_utf8(&data[..data.len().min(64)]) {
        let _ = PyVersion::parse_version_string(s);
    }
});

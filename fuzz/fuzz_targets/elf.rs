//! The ELF reader that finds `_PyRuntime`, symbols, `.bss` and the build id in a mapped file
//! (the target's own binary or libpython: attacker-controlled), and the version-string scan.
#![no_main]

use enginescope::cpython::binary::inspect_elf;
use enginescope::cpython::version::{scan_for_version, PyVersion};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = inspect_elf(data);
    let _ = scan_for_version(data);
    if let Ok(s) = std::str::from_utf8(&data[..data.len().min(64)]) {
        let _ = PyVersion::parse_version_string(s);
    }
});

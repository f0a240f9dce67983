//! The opcode walker that finds return instructions in adaptive bytecode (exact probes), for
//! every minor version it knows and one it does not.
#![no_main]

use enginescope::cpython::opcodes::return_sites;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&m, code)) = data.split_first() else {
        return;
    };
    let minor = 10 + m % 7;
    if let Ok(sites) = return_sites(minor, code) {
        let mut last = None;
        for &s in &sites {
            assert!(s + 1 < code.len(), "site {s} outside {} bytes", code.len());
            assert!(s % 2 == 0, "odd site {s}");
            assert!(last.is_none_or(|l| l < s), "sites out of order");
            last = Some(s);
        }
    }
});

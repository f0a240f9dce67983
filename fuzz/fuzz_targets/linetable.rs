//! Line-table decoders: 3.10's `co_lnotab`-style table and 3.11+'s location table, at every
//! kind of address (negative, inside, past the end), with any first line number.
#![no_main]

use enginescope::cpython::linetable::{addr2line_310, addr2line_311};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if data.len() < 9 {
        return;
    }
    let first = i32::from_le_bytes([data[1], data[2], data[3], data[4]]);
    let addr = i32::from_le_bytes([data[5], data[6], data[7], data[8]]) as i64;
    let table = &data[9..];
    let f = if data[0] & 1 == 0 {
        addr2line_310
    } else {
        addr2line_311
    };
    let _ = f(table, first, addr);
    let _ = f(table, first.max(0), addr.abs());
    // Every address of a small table, like the sampler asking for each frame.
    for a in (0..table.len() as i64 * 2 + 4).step_by(2).take(512) {
        let _ = f(table, first, a);
    }
});

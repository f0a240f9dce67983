//! A fake CPython process in a byte string, for the walker and `_Py_DebugOffsets` targets.
//!
//! Layout (little-endian):
//! ```text
//! minor:u8  runtime_addr:u64  code_type:u64 (0: no PyCode_Type symbol)
//! then regions until the input ends: addr:u64 len:u16 bytes[len] (the last one may be cut)
//! ```
//! Seeds are real processes' memory as the reader read it (fuzz/seedgen records every read of
//! an attach and a snapshot), so the regions hold real interpreters' thread states, frames,
//! code objects and line tables; mutations make pointers into other regions, cycles, huge
//! lengths and garbage.

use enginescope::cpython::memory::FakeMemory;

pub struct FakeProc {
    pub minor: u8,
    pub runtime_addr: u64,
    pub code_type: u64,
    pub mem: FakeMemory,
    /// Start addresses of the regions, in input order.
    pub starts: Vec<u64>,
}

fn u64_at(d: &[u8], i: usize) -> Option<u64> {
    Some(u64::from_le_bytes(d.get(i..i + 8)?.try_into().ok()?))
}

pub fn decode(data: &[u8]) -> Option<FakeProc> {
    let minor = *data.first()?;
    let runtime_addr = u64_at(data, 1)?;
    let code_type = u64_at(data, 9)?;
    let mut mem = FakeMemory::new();
    let mut i = 17;
    let mut starts = Vec::new();
    while i + 10 <= data.len() {
        let addr = u64_at(data, i)?;
        let len = u16::from_le_bytes([data[i + 8], data[i + 9]]) as usize;
        let start = i + 10;
        let end = (start + len).min(data.len());
        mem.map(addr, data[start..end].to_vec());
        starts.push(addr);
        i = end;
    }
    Some(FakeProc {
        minor,
        runtime_addr,
        code_type,
        mem,
        starts,
    })
}

/// Encode regions in the format [`decode`] reads (regions longer than 65535 bytes are split).
pub fn encode(minor: u8, runtime_addr: u64, code_type: u64, regions: &[(u64, Vec<u8>)]) -> Vec<u8> {
    let mut out = vec![minor];
    out.extend_from_slice(&runtime_addr.to_le_bytes());
    out.extend_from_slice(&code_type.to_le_bytes());
    for (addr, bytes) in regions {
        for (k, chunk) in bytes.chunks(u16::MAX as usize).enumerate() {
            out.extend_from_slice(&(addr + (k * u16::MAX as usize) as u64).to_le_bytes());
            out.extend_from_slice(&(chunk.len() as u16).to_le_bytes());
            out.extend_from_slice(chunk);
        }
    }
    out
}

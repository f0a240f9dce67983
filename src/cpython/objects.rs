//! Decoding CPython objects (str, bytes, code objects) out of target memory, bounded.

use super::linetable;
use super::memory::{MemorySource, ReadError};
use super::offsets::{FrameKind, Offsets};

/// Longest string we decode (names and file paths). Anything longer is treated as garbage.
pub(crate) const MAX_STR_CHARS: u64 = 4096;
/// Largest line table we read.
pub(crate) const MAX_LINETABLE: u64 = 1 << 20;

#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum ObjectError {
    #[error(transparent)]
    Read(#[from] ReadError),
    #[error("not a plausible {what} at {addr:#x}: {why}")]
    Garbage {
        what: &'static str,
        addr: u64,
        why: String,
    },
}

/// Highest user-space address on x86-64 and aarch64 (with 5-level paging: 57 bits).
const MAX_USER_ADDR: u64 = 1 << 57;

/// A pointer read from the target that could point at an object: not NULL and in user space.
/// A stale pointer (freed object, exiting process) can hold anything; past this check adding a
/// struct offset cannot overflow.
fn object_addr(what: &'static str, addr: u64) -> Result<u64, ObjectError> {
    if addr == 0 {
        return Err(garbage(what, addr, "NULL"));
    }
    if addr >= MAX_USER_ADDR {
        return Err(garbage(what, addr, "not a user-space address"));
    }
    Ok(addr)
}

fn garbage(what: &'static str, addr: u64, why: impl Into<String>) -> ObjectError {
    ObjectError::Garbage {
        what,
        addr,
        why: why.into(),
    }
}

/// Read a `str` object. Handles compact ASCII, compact non-ASCII (kinds 1, 2, 4) and legacy
/// (non-compact, ≤3.11) strings.
pub(crate) fn read_unicode(
    mem: &dyn MemorySource,
    o: &Offsets,
    addr: u64,
) -> Result<String, ObjectError> {
    let addr = object_addr("str", addr)?;
    let len = mem.read_u64(addr.wrapping_add(o.unicode_length))?;
    if len > MAX_STR_CHARS {
        return Err(garbage("str", addr, format!("length {len}")));
    }
    let state = mem.read_u32(addr.wrapping_add(o.unicode_state))?;
    // state bitfield: interned:2, kind:3, compact:1, ascii:1 (cpython/unicodeobject.h)
    let kind = (state >> 2) & 7;
    let compact = (state >> 5) & 1 == 1;
    let ascii = (state >> 6) & 1 == 1;
    let data = if ascii && compact {
        addr.wrapping_add(o.unicode_ascii_size)
    } else if compact {
        addr.wrapping_add(o.unicode_compact_size)
    } else {
        // Legacy string: PyUnicodeObject.data.any follows the compact header.
        object_addr(
            "str data",
            mem.read_u64(addr.wrapping_add(o.unicode_compact_size))?,
        )?
    };
    let width = match kind {
        1 => 1,
        2 => 2,
        4 => 4,
        _ => return Err(garbage("str", addr, format!("kind {kind}"))),
    };
    if ascii && kind != 1 {
        return Err(garbage("str", addr, "ascii with wide kind"));
    }
    let bytes = mem.read_vec(data, (len * width) as usize)?;
    let s: String = match width {
        1 if ascii => {
            if !bytes.is_ascii() {
                return Err(garbage("str", addr, "non-ASCII byte in ASCII string"));
            }
            bytes.iter().map(|&b| b as char).collect()
        }
        1 => bytes.iter().map(|&b| b as char).collect(),
        2 => bytes
            .chunks_exact(2)
            .map(|c| char::from_u32(u16::from_le_bytes([c[0], c[1]]) as u32).unwrap_or('\u{fffd}'))
            .collect(),
        _ => bytes
            .chunks_exact(4)
            .map(|c| {
                char::from_u32(u32::from_le_bytes([c[0], c[1], c[2], c[3]])).unwrap_or('\u{fffd}')
            })
            .collect(),
    };
    Ok(s)
}

/// Read a `bytes` object's contents.
pub(crate) fn read_bytes(
    mem: &dyn MemorySource,
    o: &Offsets,
    addr: u64,
    max: u64,
) -> Result<Vec<u8>, ObjectError> {
    let addr = object_addr("bytes", addr)?;
    let size = mem.read_u64(addr.wrapping_add(o.bytes_size))?;
    if size > max {
        return Err(garbage("bytes", addr, format!("size {size}")));
    }
    Ok(mem.read_vec(addr.wrapping_add(o.bytes_data), size as usize)?)
}

/// What we keep of a code object: names, file, and its line table for later lookups.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CodeInfo {
    pub name: String,
    pub qualname: String,
    pub filename: String,
    pub firstlineno: i32,
    pub linetable: Vec<u8>,
}

impl CodeInfo {
    /// The line executing at byte offset `addr` into the bytecode.
    pub(crate) fn line_at(&self, kind: FrameKind, addr: i64) -> Option<i32> {
        match kind {
            FrameKind::FrameObject => {
                linetable::addr2line_310(&self.linetable, self.firstlineno, addr)
            }
            FrameKind::Interpreter => {
                linetable::addr2line_311(&self.linetable, self.firstlineno, addr)
            }
        }
    }
}

/// Read a code object.
pub fn read_code(mem: &dyn MemorySource, o: &Offsets, addr: u64) -> Result<CodeInfo, ObjectError> {
    let addr = object_addr("code", addr)?;
    let name = read_unicode(mem, o, mem.read_u64(addr.wrapping_add(o.code_name))?)?;
    let qualname = match o.code_qualname {
        Some(q) => read_unicode(mem, o, mem.read_u64(addr + q)?)?,
        None => name.clone(),
    };
    let filename = read_unicode(mem, o, mem.read_u64(addr.wrapping_add(o.code_filename))?)?;
    let firstlineno = mem.read_i32(addr.wrapping_add(o.code_firstlineno))?;
    if firstlineno < 0 {
        return Err(garbage(
            "code",
            addr,
            format!("co_firstlineno {firstlineno}"),
        ));
    }
    let linetable = read_bytes(
        mem,
        o,
        mem.read_u64(addr.wrapping_add(o.code_linetable))?,
        MAX_LINETABLE,
    )?;
    Ok(CodeInfo {
        name,
        qualname,
        filename,
        firstlineno,
        linetable,
    })
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::cpython::memory::FakeMemory;
    use crate::cpython::offsets::{PY310, PY312};

    /// A compact ASCII `str` object's bytes (refcount and type left 0).
    pub(crate) fn ascii_str(o: &Offsets, s: &str) -> Vec<u8> {
        let mut b = vec![0u8; o.unicode_ascii_size as usize];
        b[o.unicode_length as usize..o.unicode_length as usize + 8]
            .copy_from_slice(&(s.len() as u64).to_le_bytes());
        let state: u32 = (1 << 2) | (1 << 5) | (1 << 6);
        b[o.unicode_state as usize..o.unicode_state as usize + 4]
            .copy_from_slice(&state.to_le_bytes());
        b.extend_from_slice(s.as_bytes());
        b.push(0);
        b
    }

    /// Found by the `walker` fuzz target (issue 15): offsets taken from a corrupted
    /// `_Py_DebugOffsets` can be huge; `addr + offset` overflowed. Now an unreadable address.
    #[test]
    fn huge_offsets_are_read_errors() {
        let mut o = PY312;
        let mut m = FakeMemory::new();
        m.map(0x1000, ascii_str(&o, "hello"));
        // compact, not ASCII: the data follows the compact header
        m.put_u32(0x1000 + o.unicode_state, (1 << 2) | (1 << 5));
        for huge in [u64::MAX, u64::MAX - 0xfff] {
            o.unicode_compact_size = huge;
            o.unicode_ascii_size = huge;
            assert!(read_unicode(&m, &o, 0x1000).is_err());
            o.bytes_data = huge;
            let _ = read_bytes(&m, &o, 0x1000, 100);
        }
    }

    #[test]
    fn strings_of_each_kind() {
        let o = PY312;
        let mut m = FakeMemory::new();
        m.map(0x1000, ascii_str(&o, "hello"));
        assert_eq!(read_unicode(&m, &o, 0x1000).unwrap(), "hello");

        // UCS-2 compact: "函数"
        let mut b = vec![0u8; o.unicode_compact_size as usize];
        b[16..24].copy_from_slice(&2u64.to_le_bytes());
        b[32..36].copy_from_slice(&((2u32 << 2) | (1 << 5)).to_le_bytes());
        for c in "函数".encode_utf16() {
            b.extend_from_slice(&c.to_le_bytes());
        }
        m.map(0x2000, b);
        assert_eq!(read_unicode(&m, &o, 0x2000).unwrap(), "函数");

        // Garbage: huge length, bad kind, NULL, unmapped.
        let mut g = ascii_str(&o, "x");
        g[16..24].copy_from_slice(&u64::MAX.to_le_bytes());
        m.map(0x3000, g);
        assert!(read_unicode(&m, &o, 0x3000).is_err());
        let mut g = ascii_str(&o, "x");
        g[32..36].copy_from_slice(&(7u32 << 2).to_le_bytes());
        m.map(0x4000, g);
        assert!(read_unicode(&m, &o, 0x4000).is_err());
        assert!(read_unicode(&m, &o, 0).is_err());
        assert!(read_unicode(&m, &o, 0x9000).is_err());
        // Stale pointers near the top of the address space: an error, not an overflow.
        for addr in [u64::MAX, u64::MAX - 8, 1 << 63] {
            assert!(read_unicode(&m, &o, addr).is_err());
            assert!(read_bytes(&m, &o, addr, 100).is_err());
            assert!(read_code(&m, &o, addr).is_err());
        }
        // A 3.10 header is larger (wstr): same bytes read with 3.10 offsets land elsewhere.
        assert_ne!(read_unicode(&m, &PY310, 0x1000).ok(), Some("hello".into()));
    }
}

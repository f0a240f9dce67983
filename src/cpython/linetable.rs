//! Line numbers from CPython's line tables, as `PyCode_Addr2Line` computes them.
//!
//! 3.10: `co_linetable` is a list of `(bytecode delta: u8, line delta: i8)` pairs, line delta
//! -128 meaning "no line" (Objects/codeobject.c, Objects/lnotab_notes.txt).
//! 3.11+: the location table (Objects/locations.md): entries of a header byte `1cccclll`
//! (code `c`, length `l+1` code units) followed by varints that depend on the code.
//!
//! Input is untrusted bytes from the target: all loops are bounded by the table length and
//! every index is checked.

/// The line for byte offset `addr` into the bytecode (3.10 format). `None` = no line.
pub fn addr2line_310(table: &[u8], firstlineno: i32, addr: i64) -> Option<i32> {
    if addr < 0 {
        return Some(firstlineno);
    }
    let mut line = firstlineno as i64;
    let mut end: i64 = 0;
    let mut i = 0;
    while i + 1 < table.len() {
        let start = end;
        end += table[i] as i64;
        let ldelta = table[i + 1] as i8;
        i += 2;
        let this_line = if ldelta == -128 {
            None
        } else {
            line = line.saturating_add(ldelta as i64);
            Some(line)
        };
        if start <= addr && addr < end {
            return this_line.and_then(|l| i32::try_from(l).ok());
        }
    }
    None
}

struct Cursor<'a> {
    b: &'a [u8],
    i: usize,
}

impl Cursor<'_> {
    fn byte(&mut self) -> Option<u8> {
        let v = *self.b.get(self.i)?;
        self.i += 1;
        Some(v)
    }
    fn varint(&mut self) -> Option<u64> {
        let mut read = self.byte()?;
        let mut val = (read & 63) as u64;
        let mut shift = 0u32;
        while read & 64 != 0 {
            read = self.byte()?;
            shift += 6;
            if shift > 60 {
                return None;
            }
            val |= ((read & 63) as u64) << shift;
        }
        Some(val)
    }
    fn svarint(&mut self) -> Option<i64> {
        let u = self.varint()?;
        Some(if u & 1 != 0 {
            -((u >> 1) as i64)
        } else {
            (u >> 1) as i64
        })
    }
}

/// The line for byte offset `addr` into the bytecode (3.11+ location table). `None` = no line.
pub fn addr2line_311(table: &[u8], firstlineno: i32, addr: i64) -> Option<i32> {
    if addr < 0 {
        return Some(firstlineno);
    }
    let mut c = Cursor { b: table, i: 0 };
    let mut line = firstlineno as i64;
    let mut end: i64 = 0;
    while let Some(first) = c.byte() {
        if first & 0x80 == 0 {
            // Not at an entry start: corrupt table.
            return None;
        }
        let code = (first >> 3) & 15;
        let start = end;
        end += (((first & 7) as i64) + 1) * 2;
        let this_line = match code {
            15 => None,
            14 => {
                line = line.saturating_add(c.svarint()?);
                // end line, column, end column
                c.varint()?;
                c.varint()?;
                c.varint()?;
                Some(line)
            }
            13 => {
                line = line.saturating_add(c.svarint()?);
                Some(line)
            }
            10..=12 => {
                line = line.saturating_add((code - 10) as i64);
                c.byte()?;
                c.byte()?;
                Some(line)
            }
            _ => {
                c.byte()?;
                Some(line)
            }
        };
        if start <= addr && addr < end {
            return this_line.and_then(|l| i32::try_from(l).ok());
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_310() {
        // 0..6 -> line 10 (+0), 6..10 -> 12 (+2), 10..12 -> no line, 12..20 -> 11 (-1 from 12)
        let t = [6u8, 0, 4, 2, 2, 0x80, 8, 0xff];
        assert_eq!(addr2line_310(&t, 10, 0), Some(10));
        assert_eq!(addr2line_310(&t, 10, 7), Some(12));
        assert_eq!(addr2line_310(&t, 10, 10), None);
        assert_eq!(addr2line_310(&t, 10, 19), Some(11));
        assert_eq!(addr2line_310(&t, 10, 20), None);
        assert_eq!(addr2line_310(&t, 10, -1), Some(10));
        assert_eq!(addr2line_310(&[], 10, 0), None);
        assert_eq!(addr2line_310(&[5], 10, 0), None);
    }

    #[test]
    fn table_311() {
        // entry 1: short form (code 0), 1 unit: line +0 -> 5; addr 0..2
        // entry 2: one-line form code 11 (+1), 2 units: line 6; addr 2..6
        // entry 3: no-column form code 13, svarint -2 (=5 encoded), 1 unit: line 4; addr 6..8
        // entry 4: long form code 14, +40 (80), end 0, col 1, endcol 1, 3 units: line 44; 8..14
        // entry 5: none code 15, 1 unit; 14..16
        let t = [
            0x80,
            0x00, //
            0x80 | (11 << 3) | 1,
            4,
            8, //
            0x80 | (13 << 3),
            5, //
            0x80 | (14 << 3) | 2,
            0x40 | 16,
            1,
            0,
            1,
            1, //
            0x80 | (15 << 3),
        ];
        assert_eq!(addr2line_311(&t, 5, 0), Some(5));
        assert_eq!(addr2line_311(&t, 5, 4), Some(6));
        assert_eq!(addr2line_311(&t, 5, 6), Some(4));
        assert_eq!(addr2line_311(&t, 5, 13), Some(44));
        assert_eq!(addr2line_311(&t, 5, 14), None);
        assert_eq!(addr2line_311(&t, 5, 16), None);
        assert_eq!(addr2line_311(&t, 5, -2), Some(5));
    }

    /// Found by review while fuzzing (issue 15): after svarint deltas saturate the line at
    /// i64::MAX, a one-line-delta entry (codes 10-12) added to it overflowed (a panic in debug
    /// builds, a wrapped line in release).
    #[test]
    fn saturated_line_then_short_form_does_not_overflow() {
        fn varint(mut v: u64, out: &mut Vec<u8>) {
            while v >= 64 {
                out.push(64 | (v & 63) as u8);
                v >>= 6;
            }
            out.push(v as u8);
        }
        let mut t = Vec::new();
        for _ in 0..20 {
            t.push(0x80 | (13 << 3)); // no-column form, 1 code unit
            varint((1 << 60) - 2, &mut t); // line += 2^59 - 1
        }
        t.extend_from_slice(&[0x80 | (12 << 3), 0, 0]); // one-line form: line += 2
        assert_eq!(addr2line_311(&t, 1, 40), None); // beyond i32: no line, no panic
        assert_eq!(addr2line_311(&t, 1, 0), None);
    }

    #[test]
    fn garbage_never_panics() {
        let mut seed = 0x1234_5678_9abc_def0u64;
        for len in 0..300 {
            let t: Vec<u8> = (0..len)
                .map(|_| {
                    seed ^= seed << 13;
                    seed ^= seed >> 7;
                    seed ^= seed << 17;
                    seed as u8
                })
                .collect();
            for addr in [-1i64, 0, 2, 100, i64::MAX] {
                let _ = addr2line_310(&t, 1, addr);
                let _ = addr2line_311(&t, i32::MAX, addr);
            }
        }
        // A varint that never ends.
        assert_eq!(
            addr2line_311(&[0x80 | (13 << 3), 0x7f, 0x7f, 0x7f], 1, 0),
            None
        );
    }
}

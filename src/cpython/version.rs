//! Python versions and how to tell which one a binary is, from the binary and its memory
//! (never from its file name).

use std::fmt;

/// A CPython version, as `PY_VERSION_HEX` encodes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize)]
pub struct PyVersion {
    pub major: u8,
    pub minor: u8,
    pub micro: u8,
    /// 0xA alpha, 0xB beta, 0xC release candidate, 0xF final.
    pub level: u8,
    pub serial: u8,
}

impl PyVersion {
    pub const fn new(major: u8, minor: u8, micro: u8) -> Self {
        PyVersion {
            major,
            minor,
            micro,
            level: 0xF,
            serial: 0,
        }
    }

    pub(crate) fn from_hex(hex: u64) -> Self {
        PyVersion {
            major: ((hex >> 24) & 0xff) as u8,
            minor: ((hex >> 16) & 0xff) as u8,
            micro: ((hex >> 8) & 0xff) as u8,
            level: ((hex >> 4) & 0xf) as u8,
            serial: (hex & 0xf) as u8,
        }
    }

    pub(crate) fn hex(&self) -> u64 {
        ((self.major as u64) << 24)
            | ((self.minor as u64) << 16)
            | ((self.micro as u64) << 8)
            | ((self.level as u64) << 4)
            | self.serial as u64
    }

    pub(crate) fn minor_tuple(&self) -> (u8, u8) {
        (self.major, self.minor)
    }

    pub(crate) fn is_prerelease(&self) -> bool {
        self.level != 0xF
    }

    /// Parse the start of `sys.version`, e.g. `3.10.13 (main, ...` or `3.15.0rc1+ (...`.
    pub fn parse_version_string(s: &str) -> Option<Self> {
        let head = s.split([' ', '+']).next()?;
        let mut parts = head.splitn(3, '.');
        let major: u8 = parts.next()?.parse().ok()?;
        let minor: u8 = parts.next()?.parse().ok()?;
        let rest = parts.next()?;
        let digits: String = rest.chars().take_while(|c| c.is_ascii_digit()).collect();
        let micro: u8 = digits.parse().ok()?;
        let tail = &rest[digits.len()..];
        let (level, serial) = if tail.is_empty() {
            (0xF, 0)
        } else {
            let (lvl, num) = if let Some(n) = tail.strip_prefix("rc") {
                (0xC, n)
            } else if let Some(n) = tail.strip_prefix('a') {
                (0xA, n)
            } else if let Some(n) = tail.strip_prefix('b') {
                (0xB, n)
            } else {
                return None;
            };
            (lvl, num.parse().ok()?)
        };
        if major != 3 {
            return None;
        }
        Some(PyVersion {
            major,
            minor,
            micro,
            level,
            serial,
        })
    }
}

impl fmt::Display for PyVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}.{}", self.major, self.minor, self.micro)?;
        match self.level {
            0xA => write!(f, "a{}", self.serial),
            0xB => write!(f, "b{}", self.serial),
            0xC => write!(f, "rc{}", self.serial),
            _ => Ok(()),
        }
    }
}

/// Find a `sys.version`-style string (`3.X.Y (`) in a block of memory such as libpython's `.bss`,
/// where `Py_GetVersion` keeps its formatted buffer. Used where `Py_Version` does not exist (3.10).
pub fn scan_for_version(bytes: &[u8]) -> Option<PyVersion> {
    let mut i = 0;
    while i + 8 < bytes.len() {
        if bytes[i] == b'3' && bytes[i + 1] == b'.' && (i == 0 || bytes[i - 1] == 0) {
            let end = bytes[i..]
                .iter()
                .take(64)
                .position(|&b| b == 0 || b == b'(')
                .map(|p| i + p);
            if let Some(end) = end {
                if bytes[end] == b'(' {
                    if let Ok(s) = std::str::from_utf8(&bytes[i..end]) {
                        if let Some(v) = PyVersion::parse_version_string(s) {
                            return Some(v);
                        }
                    }
                }
            }
        }
        i += 1;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_roundtrip() {
        let v = PyVersion::from_hex(0x030e0af0);
        assert_eq!(v.to_string(), "3.14.10");
        assert_eq!(v.hex(), 0x030e0af0);
        assert_eq!(PyVersion::from_hex(0x030f00c1).to_string(), "3.15.0rc1");
    }

    #[test]
    fn parses_sys_version() {
        let v =
            PyVersion::parse_version_string("3.10.13 (main, May  9 2026, 07:34:08) [GCC 12.2.0]")
                .unwrap();
        assert_eq!(v, PyVersion::new(3, 10, 13));
        assert_eq!(
            PyVersion::parse_version_string("3.15.0rc1+ (heads/main)")
                .unwrap()
                .level,
            0xC
        );
        assert!(PyVersion::parse_version_string("2.7.18 (x)").is_none());
        assert!(PyVersion::parse_version_string("3.x").is_none());
    }

    #[test]
    fn scans_memory() {
        let mut mem = vec![0u8; 100];
        mem.extend_from_slice(b"3.10.13 (main, May  9 2026) [GCC]\0");
        mem.extend_from_slice(&[0xff; 20]);
        assert_eq!(scan_for_version(&mem), Some(PyVersion::new(3, 10, 13)));
        assert_eq!(scan_for_version(b"\x003.1"), None);
        assert_eq!(scan_for_version(&[0x33; 1000]), None);
    }
}

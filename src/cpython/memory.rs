//! Reading the target's memory. Everything the walker reads goes through [`MemorySource`], so the
//! same code runs against a live process and against fake memory in unit tests.
//!
//! The target's memory is untrusted: every read is checked, and a short read is an error.

use std::collections::BTreeMap;
use std::fs::File;
use std::os::unix::fs::FileExt;

/// Why a read failed. Callers mostly turn this into a counted, non-fatal error.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum ReadError {
    #[error("cannot read {len} bytes at {addr:#x}: {reason}")]
    Unreadable {
        addr: u64,
        len: usize,
        reason: String,
    },
    #[error("process {0} has exited")]
    Gone(i32),
    #[error("permission denied reading process {pid} memory: run as root or grant CAP_SYS_PTRACE")]
    Permission { pid: i32 },
}

/// A source of target memory.
pub trait MemorySource {
    /// Fill `buf` with the bytes at `addr`, all or nothing.
    fn read(&self, addr: u64, buf: &mut [u8]) -> Result<(), ReadError>;

    fn read_u64(&self, addr: u64) -> Result<u64, ReadError> {
        let mut b = [0u8; 8];
        self.read(addr, &mut b)?;
        Ok(u64::from_le_bytes(b))
    }
    fn read_u32(&self, addr: u64) -> Result<u32, ReadError> {
        let mut b = [0u8; 4];
        self.read(addr, &mut b)?;
        Ok(u32::from_le_bytes(b))
    }
    fn read_i32(&self, addr: u64) -> Result<i32, ReadError> {
        Ok(self.read_u32(addr)? as i32)
    }
    fn read_u16(&self, addr: u64) -> Result<u16, ReadError> {
        let mut b = [0u8; 2];
        self.read(addr, &mut b)?;
        Ok(u16::from_le_bytes(b))
    }
    fn read_u8(&self, addr: u64) -> Result<u8, ReadError> {
        let mut b = [0u8; 1];
        self.read(addr, &mut b)?;
        Ok(b[0])
    }
    fn read_vec(&self, addr: u64, len: usize) -> Result<Vec<u8>, ReadError> {
        let mut v = vec![0u8; len];
        self.read(addr, &mut v)?;
        Ok(v)
    }
}

/// A live process: `process_vm_readv` first, `/proc/PID/mem` when that syscall is not allowed
/// (some seccomp profiles block it while still allowing ptrace-mode reads of `/proc/PID/mem`).
pub struct ProcessMemory {
    pid: i32,
    mem_file: Option<File>,
    use_vm_readv: std::cell::Cell<bool>,
}

impl ProcessMemory {
    pub fn open(pid: i32) -> Result<Self, ReadError> {
        let mem_file = File::open(format!("/proc/{pid}/mem")).ok();
        let pm = ProcessMemory {
            pid,
            mem_file,
            use_vm_readv: std::cell::Cell::new(true),
        };
        if !std::path::Path::new(&format!("/proc/{pid}")).exists() {
            return Err(ReadError::Gone(pid));
        }
        Ok(pm)
    }

    pub fn pid(&self) -> i32 {
        self.pid
    }

    fn vm_readv(&self, addr: u64, buf: &mut [u8]) -> std::io::Result<usize> {
        let local = libc::iovec {
            iov_base: buf.as_mut_ptr() as *mut libc::c_void,
            iov_len: buf.len(),
        };
        let remote = libc::iovec {
            iov_base: addr as *mut libc::c_void,
            iov_len: buf.len(),
        };
        // SAFETY: `local` points at `buf`, which is valid for writes of `buf.len()` bytes for the
        // duration of the call; the remote iovec is only interpreted by the kernel.
        let n = unsafe { libc::process_vm_readv(self.pid, &local, 1, &remote, 1, 0) };
        if n < 0 {
            Err(std::io::Error::last_os_error())
        } else {
            Ok(n as usize)
        }
    }

    fn classify(&self, addr: u64, len: usize, e: std::io::Error) -> ReadError {
        match e.raw_os_error() {
            Some(libc::ESRCH) => ReadError::Gone(self.pid),
            Some(libc::EPERM) | Some(libc::EACCES) => {
                if std::path::Path::new(&format!("/proc/{}", self.pid)).exists() {
                    ReadError::Permission { pid: self.pid }
                } else {
                    ReadError::Gone(self.pid)
                }
            }
            _ => {
                if !std::path::Path::new(&format!("/proc/{}", self.pid)).exists() {
                    ReadError::Gone(self.pid)
                } else {
                    ReadError::Unreadable {
                        addr,
                        len,
                        reason: e.to_string(),
                    }
                }
            }
        }
    }
}

impl MemorySource for ProcessMemory {
    fn read(&self, addr: u64, buf: &mut [u8]) -> Result<(), ReadError> {
        if buf.is_empty() {
            return Ok(());
        }
        if self.use_vm_readv.get() {
            match self.vm_readv(addr, buf) {
                Ok(n) if n == buf.len() => return Ok(()),
                Ok(n) => {
                    return Err(ReadError::Unreadable {
                        addr,
                        len: buf.len(),
                        reason: format!("short read ({n} bytes)"),
                    })
                }
                Err(e) if e.raw_os_error() == Some(libc::ENOSYS) => {
                    self.use_vm_readv.set(false);
                }
                Err(e) if e.raw_os_error() == Some(libc::EPERM) && self.mem_file.is_some() => {
                    // Fall through to /proc/PID/mem, which some sandboxes still allow.
                    self.use_vm_readv.set(false);
                }
                Err(e) => return Err(self.classify(addr, buf.len(), e)),
            }
        }
        let Some(f) = &self.mem_file else {
            return Err(ReadError::Permission { pid: self.pid });
        };
        match f.read_at(buf, addr) {
            Ok(n) if n == buf.len() => Ok(()),
            Ok(n) => Err(ReadError::Unreadable {
                addr,
                len: buf.len(),
                reason: format!("short read ({n} bytes)"),
            }),
            Err(e) => Err(self.classify(addr, buf.len(), e)),
        }
    }
}

/// Fake memory for tests: a set of non-overlapping regions; anything else is unreadable.
#[derive(Default, Clone)]
pub struct FakeMemory {
    regions: BTreeMap<u64, Vec<u8>>,
}

impl FakeMemory {
    pub fn new() -> Self {
        Self::default()
    }
    /// Map `bytes` at `addr`.
    pub fn map(&mut self, addr: u64, bytes: Vec<u8>) -> &mut Self {
        self.regions.insert(addr, bytes);
        self
    }
    /// Write a little-endian u64 at `addr`, which must lie inside a mapped region.
    #[cfg(test)]
    pub(crate) fn put_u64(&mut self, addr: u64, v: u64) {
        self.put(addr, &v.to_le_bytes());
    }
    #[cfg(test)]
    pub(crate) fn put_u32(&mut self, addr: u64, v: u32) {
        self.put(addr, &v.to_le_bytes());
    }
    /// A test double's setup: an address outside every region is the test's own mistake.
    #[allow(clippy::expect_used)]
    pub fn put(&mut self, addr: u64, bytes: &[u8]) {
        let (base, region) = self
            .regions
            .range_mut(..=addr)
            .next_back()
            .expect("FakeMemory::put outside any region");
        let off = (addr - base) as usize;
        region[off..off + bytes.len()].copy_from_slice(bytes);
    }
}

impl MemorySource for FakeMemory {
    fn read(&self, addr: u64, buf: &mut [u8]) -> Result<(), ReadError> {
        let err = || ReadError::Unreadable {
            addr,
            len: buf.len(),
            reason: "unmapped".into(),
        };
        let (base, region) = self.regions.range(..=addr).next_back().ok_or_else(err)?;
        let off = usize::try_from(addr - base).map_err(|_| err())?;
        let end = off.checked_add(buf.len()).ok_or_else(err)?;
        if end > region.len() {
            return Err(err());
        }
        buf.copy_from_slice(&region[off..end]);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fake_memory_bounds() {
        let mut m = FakeMemory::new();
        m.map(0x1000, vec![1, 2, 3, 4, 5, 6, 7, 8]);
        assert_eq!(m.read_u32(0x1000).unwrap(), 0x04030201);
        assert!(m.read_u64(0x1001).is_err());
        assert!(m.read_u8(0xfff).is_err());
        assert!(m.read_u8(u64::MAX).is_err());
    }

    #[test]
    fn reads_own_process() {
        let x: u64 = 0x1122_3344_5566_7788;
        let m = ProcessMemory::open(std::process::id() as i32).unwrap();
        assert_eq!(m.read_u64(&x as *const u64 as u64).unwrap(), x);
        assert!(m.read_u64(8).is_err());
    }
}

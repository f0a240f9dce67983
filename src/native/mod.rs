//! Native (C/C++) and kernel frames for BPF samples (`record --native`, `--kernel-stacks`).
//!
//! The kernel side sends, with each sample and blocking switch-out of a target thread, a
//! `NATIVE_STACK` record: the kernel stack (return addresses from `bpf_get_stack`, unwound by
//! the kernel's ORC unwinder), the user registers (ip, sp, bp) and a window of up to 16 KiB of
//! the user stack from sp. Here, without touching the target:
//!
//! * kernel addresses are named from `/proc/kallsyms` ([`KernelSymbols`]);
//! * the user stack is unwound with `framehop` from each module's `.eh_frame` (libpython and
//!   most distribution libraries have no frame pointers), over the copied bytes only;
//! * each user address is named from the module's `.symtab`, else `.dynsym`, else a separate
//!   debug file found by build-id (`/usr/lib/debug/.build-id/xx/rest.debug`, in the target's
//!   root too), and C++ names are demangled;
//! * the native frames are merged with the Python frames the kernel walked ([`merge`]): each
//!   evaluation-loop frame (`_PyEval_EvalFrameDefault`) stands for the run of Python frames
//!   one C-level call of the loop executes (the kernel marks where those runs start).
//!
//! Module files are opened through `/proc/PID/map_files/` (the target's own file whatever its
//! mount namespace or chroot) and memory-mapped; only the symbol tables and unwind sections are
//! read. Everything read from the target or its files is untrusted: lookups are bounded and
//! failures give fewer frames, never an error that stops recording.
//!
//! Files: `kernel` (kallsyms), `elf` (a module's symbols and unwind sections), `loader` (a
//! process's mapped modules, symbol tables loaded off the drain thread), `unwind` (one stack
//! unwound and named), `state` (per-thread stack windows and the caches of one recording),
//! `merge` (native with Python frames), `builtins` (builtins named from the interpreter),
//! `backlog` (stacks waiting for their symbols).

pub mod backlog;
pub mod builtins;
mod elf;
mod kernel;
mod loader;
pub mod merge;
mod state;
mod unwind;

pub use elf::*;
pub use kernel::*;
pub use loader::*;
pub(crate) use state::*;
pub use unwind::*;

use std::collections::HashMap;
use std::ops::{Deref, Range};
use std::sync::Arc;

use framehop::x86_64::{CacheX86_64, UnwindRegsX86_64, UnwinderX86_64};
use framehop::{ExplicitModuleSectionInfo, FrameAddress, Module, Unwinder};
use object::{Object, ObjectSection, ObjectSymbol, SymbolKind};

use crate::cpython::Frame;
use crate::record::{NativeFrameInfo, FRAME_KERNEL, FRAME_NATIVE};

/// What `record` asks the kernel for.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NativeOptions {
    /// Kernel stacks on samples and blocking switch-outs.
    pub kernel: bool,
    /// User registers and stack window: native frames unwound in user space.
    pub user: bool,
}

impl NativeOptions {
    pub fn any(&self) -> bool {
        self.kernel || self.user
    }
}

#[cfg(test)]
mod tests {
    use super::elf::clean_c_name;
    use super::state::{ThreadWindow, WINDOW_EPOCH};
    use super::*;

    #[test]
    fn stack_windows() {
        assert_eq!(window_for(0), 1024);
        assert_eq!(window_for(800), 2048);
        assert_eq!(window_for(1300), 3072);
        assert_eq!(window_for(11_000), 0, "all of it");
        let mut w = ThreadWindow::default();
        // A thread starts with all 16 KiB; its first unwind sizes the window.
        assert_eq!(w.observe(900, USTACK_WINDOW_MAX, false), Some(2048));
        assert_eq!(w.observe(700, 2048, false), None);
        // Deeper for once: ran past the 2 KiB copied, so the next ones are sized for 4 KiB.
        assert_eq!(w.observe(2048, 2048, true), Some(7168));
        // The peak is kept for one to two epochs, then the window shrinks back.
        let mut last = None;
        for _ in 0..2 * WINDOW_EPOCH {
            if let Some(s) = w.observe(900, 7168, false) {
                last = Some(s);
            }
        }
        assert_eq!(last, Some(2048));
    }

    #[test]
    fn kallsyms_lookup() {
        let k = KernelSymbols::parse(
            "ffffffff81000000 T _stext\nffffffff81001000 t futex_wait\n0000000000000000 T hidden\nffffffff81002000 D data\nffffffff81002ff0 t __pfx_do_epoll_wait\nffffffff81003000 T do_epoll_wait\nffffffff81004000 t mod_fn\t[kvm]\n",
        );
        assert_eq!(k.lookup(0xffffffff81004001).unwrap().1, "mod_fn");
        assert_eq!(
            k.lookup(0xffffffff81002ff8).unwrap().1,
            "futex_wait",
            "padding symbols are left out"
        );
        assert_eq!(k.lookup(0xffffffff81001010).unwrap().1, "futex_wait");
        assert_eq!(k.lookup(0xffffffff81002010).unwrap().1, "futex_wait");
        assert_eq!(k.lookup(0xffffffff81003000).unwrap().1, "do_epoll_wait");
        assert!(k.lookup(0x1000).is_none());
        let (f, i) = k.frame(0xffffffff81001001, true);
        assert_eq!(f.function, "futex_wait");
        assert_eq!(i.kind, FRAME_KERNEL);
        let (f, _) = k.frame(0xffffffff81001000, true);
        assert_eq!(
            f.function, "_stext",
            "a return address names the call before it"
        );
    }

    #[test]
    fn module_names() {
        assert_eq!(
            short_module_name("/x/_pickle.cpython-311-x86_64-linux-gnu.so"),
            "_pickle"
        );
        assert_eq!(short_module_name("/lib/x86_64-linux-gnu/libc.so.6"), "libc");
        assert_eq!(short_module_name("/usr/bin/python3.13"), "python3.13");
        assert_eq!(
            short_module_name("/x/libpython3.11.so.1.0"),
            "libpython3.11"
        );
        assert_eq!(clean_c_name("save.lto_priv.0"), "save");
        assert_eq!(demangle("_ZN2at6native3addEv"), "at::native::add");
        assert_eq!(
            demangle("_RNvNtNtNtNtNtCsjrHSEGnQ3l9_3std3sys3pal4unix14stack_overflow11thread_info16set_current_info"),
            "std::sys::pal::unix::stack_overflow::thread_info::set_current_info"
        );
    }

    /// Name a function of this test binary from its address, through the same module table
    /// (maps, map_files, load bias, .symtab) the recorder uses for a target.
    #[test]
    fn names_own_function() {
        #[inline(never)]
        fn es_marker_function(x: u64) -> u64 {
            std::hint::black_box(x.wrapping_mul(31))
        }
        let addr = es_marker_function as *const () as u64;
        std::hint::black_box(es_marker_function(1));
        let mut cache = ModuleCache::default();
        let p = ProcessNative::new(std::process::id() as i32, &mut cache);
        let (f, info, eval) = p.frame(FrameAddress::from_instruction_pointer(addr + 1));
        assert!(f.function.contains("es_marker_function"), "{f:?} {info:?}");
        assert_eq!(info.kind, FRAME_NATIVE);
        assert!(!eval);
    }

    /// Mapping a process reads no symbol table: a frame unwound before its module's symbols
    /// are read stays raw (module, address) and is named once they are, the same as at once.
    #[test]
    fn raw_frames_wait_for_symbols() {
        #[inline(never)]
        fn es_marker_later(x: u64) -> u64 {
            std::hint::black_box(x.wrapping_mul(37))
        }
        let addr = es_marker_later as *const () as u64;
        std::hint::black_box(es_marker_later(1));
        let mut cache = ModuleCache::default();
        let p = ProcessNative::new(std::process::id() as i32, &mut cache);
        let raw = RawNative {
            kernel: Vec::new(),
            user: vec![p.raw_frame(FrameAddress::from_instruction_pointer(addr))],
            complete: true,
            ..RawNative::default()
        };
        assert!(!raw.ready(), "no symbol table is read when mapping");
        let mut native = Native::new(NativeOptions::default());
        let early = native.name(&raw, false);
        assert_eq!(early.user[0].0.function, SYMBOLS_NOT_LOADED);
        assert_eq!(native.unnamed_not_loaded, 1);
        // Read (what the loader thread does), then named without waiting.
        if let Some((m, _)) = &raw.user[0].module {
            m.load_symbols();
        }
        assert!(raw.ready());
        let named = native.name(&raw, false);
        assert!(
            named.user[0].0.function.contains("es_marker_later"),
            "{:?}",
            named.user[0]
        );
        // Raw: the address itself; named: its function's start, in the same module.
        assert!(named.user[0].1.addr <= early.user[0].1.addr);
        assert_eq!(named.user[0].1.module, early.user[0].1.module);
        assert_eq!(native.unnamed_not_loaded, 1);
    }

    /// The loader thread reads the symbols of each module queued to it, once each.
    #[test]
    fn loader_reads_symbols() {
        let mut cache = ModuleCache {
            modules: HashMap::new(),
            loader: SymbolLoader::spawn(),
        };
        let _p = ProcessNative::new(std::process::id() as i32, &mut cache);
        assert!(!cache.modules.is_empty());
        assert!(
            cache.modules.values().all(|m| !m.symbols_ready()),
            "mapping reads no symbol table"
        );
        let loader = cache.loader.take().expect("loader thread");
        for m in cache.modules.values() {
            loader.submit(m);
            loader.submit(m);
        }
        // Hurried: at this thread's priority (lowering a nice value takes root).
        loader.hurry();
        let tid = loader.stats.tid.load(std::sync::atomic::Ordering::Relaxed);
        // SAFETY: geteuid/gettid/getpriority of this process's threads.
        unsafe {
            if tid > 0 && libc::geteuid() == 0 {
                let me = libc::syscall(libc::SYS_gettid) as libc::id_t;
                assert_eq!(
                    libc::getpriority(libc::PRIO_PROCESS, tid as libc::id_t),
                    libc::getpriority(libc::PRIO_PROCESS, me).min(10),
                    "the loader runs at the caller's priority once hurried"
                );
            }
        }
        // Closing waits for the queue to be worked off.
        let stats = loader.close();
        assert_eq!(
            stats.loads.load(std::sync::atomic::Ordering::Relaxed),
            cache.modules.len() as u64
        );
        assert!(cache.modules.values().all(|m| m.symbols_ready()));
    }
}

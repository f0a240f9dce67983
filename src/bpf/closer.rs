//! The last close of a uprobe link, made where a kill of enginescope cannot interrupt it.
//!
//! Removing a uprobe writes the original instruction back into every process that maps the
//! probed file, and the kernel gives that write up when the closing task has a fatal signal
//! pending: the int3 then stays in those processes, and the kernel logs "failed to
//! unregister, leaking uprobe" (the processes run on, each hit handled by the orphaned probe,
//! until they exit). A link's last `close` does that removal in the closing thread's task
//! work, which a SIGKILL arriving meanwhile runs with the signal pending: measured here,
//! SIGKILL 30–300 ms after SIGINT (while the recording closed its GC uprobes) left int3 at
//! three collectors of the target and of a process it never recorded, every time. The kernel's
//! own exit path is safe (a dying thread has taken its SIGKILL off its pending set before it
//! closes its files): the danger is only a close in flight.
//!
//! So uprobe links are handed over (`SCM_RIGHTS` on a `SOCK_SEQPACKET` pair) to a helper
//! process, forked once, which makes the last close and acknowledges it. It sits in a session
//! of its own and ignores the signals a terminal or `kill` sends, so a kill of enginescope or
//! its process group does not reach it. When enginescope's end of the socket closes (however
//! enginescope ended), it closes what it holds and exits, and an exit closes files safely.
//! A SIGKILL sent to the helper itself while it closes (a whole cgroup killed at once) can
//! still leave a probe: that window is the helper's, not every thread's.
//!
//! The helper makes each close in a child of its own, all at once: a close waits for kernel
//! grace periods (measured here under a loaded vLLM: 8 links took 12.8 s one after another),
//! and enginescope does not wait for them at exit (see `BpfSampler::wait_detached`).

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::time::{Duration, Instant};

/// The helper process and our end of its socket.
pub(crate) struct UprobeCloser {
    sock: OwnedFd,
    child: libc::pid_t,
    next_token: u64,
    /// Handed over, not yet acknowledged as closed.
    outstanding: usize,
}

impl UprobeCloser {
    /// Fork the helper. Call it before the links it will close exist: a fork copies every
    /// descriptor, and the helper closes its copies at once (a close that is never the last).
    pub fn spawn() -> io::Result<UprobeCloser> {
        let mut fds = [0 as RawFd; 2];
        // SAFETY: socketpair fills the two-element array we own.
        if unsafe {
            libc::socketpair(
                libc::AF_UNIX,
                libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC,
                0,
                fds.as_mut_ptr(),
            )
        } != 0
        {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: two new descriptors that nothing else owns.
        let (ours, theirs) =
            unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
        // SAFETY: the child runs `serve` alone, which makes system calls only (no allocation,
        // no lock: another thread may have held the allocator's when we forked) and never
        // returns.
        let child = unsafe { libc::fork() };
        if child < 0 {
            return Err(io::Error::last_os_error());
        }
        if child == 0 {
            // SAFETY: see above.
            unsafe { serve(theirs.as_raw_fd()) }
        }
        drop(theirs);
        Ok(UprobeCloser {
            sock: ours,
            child,
            next_token: 0,
            outstanding: 0,
        })
    }

    /// Give the helper a copy of `fd` to close. The caller closes its own copies after this
    /// returns (the copy in flight holds the file until the helper has it), so the helper's
    /// close is the last one.
    pub(crate) fn hand_over(&mut self, fd: BorrowedFd<'_>) -> io::Result<()> {
        let token = self.next_token;
        self.next_token += 1;
        let mut data = token.to_ne_bytes();
        let mut iov = libc::iovec {
            iov_base: data.as_mut_ptr().cast(),
            iov_len: data.len(),
        };
        // u64s: a control buffer aligned for `cmsghdr`.
        let mut control = [0u64; 4];
        // SAFETY: CMSG_SPACE is arithmetic.
        let space = unsafe { libc::CMSG_SPACE(std::mem::size_of::<RawFd>() as u32) } as usize;
        debug_assert!(space <= std::mem::size_of_val(&control));
        // SAFETY: msghdr is plain data; zero is a valid value for every field.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = control.as_mut_ptr().cast();
        msg.msg_controllen = space as _;
        // SAFETY: the control buffer holds one cmsghdr with one descriptor (space checked
        // above); CMSG_FIRSTHDR/CMSG_DATA point inside it.
        unsafe {
            let c = libc::CMSG_FIRSTHDR(&msg);
            (*c).cmsg_level = libc::SOL_SOCKET;
            (*c).cmsg_type = libc::SCM_RIGHTS;
            (*c).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<RawFd>() as u32) as _;
            std::ptr::write_unaligned(libc::CMSG_DATA(c).cast::<RawFd>(), fd.as_raw_fd());
        }
        // SAFETY: a message we built over buffers that outlive the call.
        let n = unsafe { libc::sendmsg(self.sock.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        self.outstanding += 1;
        Ok(())
    }

    /// Read the helper's acknowledgements, waiting up to `wait` for all of them; returns how
    /// many are still outstanding (0 when the helper has closed everything handed over, and
    /// also when it has gone: its exit closed what it held).
    pub fn collect(&mut self, wait: Duration) -> usize {
        let deadline = Instant::now() + wait;
        while self.outstanding > 0 {
            let left = deadline.saturating_duration_since(Instant::now());
            let mut p = libc::pollfd {
                fd: self.sock.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one pollfd we own.
            let r = unsafe { libc::poll(&mut p, 1, left.as_millis().min(60_000) as libc::c_int) };
            if r < 0 {
                if io::Error::last_os_error().kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                break;
            }
            if r == 0 {
                break; // timed out
            }
            let mut ack = [0u8; 8];
            // SAFETY: reads into a buffer we own.
            let n = unsafe {
                libc::recv(
                    self.sock.as_raw_fd(),
                    ack.as_mut_ptr().cast(),
                    ack.len(),
                    libc::MSG_DONTWAIT,
                )
            };
            if n == 0 {
                // The helper is gone; its exit closed what it held.
                self.outstanding = 0;
                break;
            }
            if n < 0 {
                let e = io::Error::last_os_error().kind();
                if e == io::ErrorKind::Interrupted || e == io::ErrorKind::WouldBlock {
                    continue;
                }
                break;
            }
            self.outstanding = self.outstanding.saturating_sub(1);
        }
        self.outstanding
    }

    /// The helper's process id.
    #[cfg(test)]
    pub fn pid(&self) -> i32 {
        self.child
    }
}

impl Drop for UprobeCloser {
    fn drop(&mut self) {
        // Closing our end tells the helper to finish and exit: reap it if it has (bounded,
        // never a hang: one that has not is reparented and reaped by init when it exits).
        // The closes it has started go on in its children, which hold the links.
        let _ = self.collect(Duration::ZERO);
        // SAFETY: shutdown on our own socket; the descriptor is closed when `sock` drops.
        unsafe { libc::shutdown(self.sock.as_raw_fd(), libc::SHUT_RDWR) };
        let deadline = Instant::now() + Duration::from_secs(1);
        loop {
            let mut status = 0;
            // SAFETY: waits for our own child without blocking.
            let r = unsafe { libc::waitpid(self.child, &mut status, libc::WNOHANG) };
            if r != 0 || Instant::now() >= deadline {
                break;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }
}

/// The helper: close every descriptor received on `sock`, acknowledge each, exit at EOF.
///
/// # Safety
/// Only in a freshly forked child, with `sock` its end of the pair. Makes system calls only.
unsafe fn serve(sock: RawFd) -> ! {
    // SAFETY: the caller's contract (a freshly forked child, `sock` its end of the pair);
    // system calls on our own plain data.
    unsafe {
        // Out of the terminal's process group and session; deaf to the signals a user or a
        // service manager sends (SIGKILL aside, which nothing can ignore).
        libc::setsid();
        let mut ign: libc::sigaction = std::mem::zeroed();
        ign.sa_sigaction = libc::SIG_IGN;
        for sig in [
            libc::SIGINT,
            libc::SIGTERM,
            libc::SIGHUP,
            libc::SIGQUIT,
            libc::SIGPIPE,
            libc::SIGUSR1,
            libc::SIGUSR2,
            libc::SIGTSTP,
            libc::SIGTTIN,
            libc::SIGTTOU,
        ] {
            libc::sigaction(sig, &ign, std::ptr::null_mut());
        }
        // The children that make the closes are reaped by the kernel.
        libc::sigaction(libc::SIGCHLD, &ign, std::ptr::null_mut());
        // Every other descriptor the fork copied (recordings, terminals, BPF objects): closes
        // that are never the last, since the parent keeps its own.
        if sock > 0 {
            close_from_to(0, sock as u32 - 1);
        }
        close_from_to(sock as u32 + 1, u32::MAX);
        let name = b"es-uprobe-close\0";
        libc::prctl(libc::PR_SET_NAME, name.as_ptr() as libc::c_ulong, 0, 0, 0);
        loop {
            let mut token = [0u8; 8];
            let mut iov = libc::iovec {
                iov_base: token.as_mut_ptr().cast(),
                iov_len: token.len(),
            };
            let mut control = [0u64; 16];
            let mut msg: libc::msghdr = std::mem::zeroed();
            msg.msg_iov = &mut iov;
            msg.msg_iovlen = 1;
            msg.msg_control = control.as_mut_ptr().cast();
            msg.msg_controllen = std::mem::size_of_val(&control) as _;
            let n = libc::recvmsg(sock, &mut msg, libc::MSG_CMSG_CLOEXEC);
            if n < 0 && *libc::__errno_location() == libc::EINTR {
                continue;
            }
            if n <= 0 {
                break;
            }
            let mut fds = [-1 as RawFd; MAX_FDS];
            let mut n_fds = 0;
            let mut c = libc::CMSG_FIRSTHDR(&msg);
            while !c.is_null() {
                if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                    let data = libc::CMSG_DATA(c);
                    let len = ((*c).cmsg_len as usize).saturating_sub(libc::CMSG_LEN(0) as usize);
                    for i in 0..len / std::mem::size_of::<RawFd>() {
                        let fd = std::ptr::read_unaligned(data.cast::<RawFd>().add(i));
                        if n_fds < MAX_FDS {
                            fds[n_fds] = fd;
                            n_fds += 1;
                        } else {
                            libc::close(fd);
                        }
                    }
                }
                c = libc::CMSG_NXTHDR(&msg, c);
            }
            close_in_child(sock, &fds[..n_fds], &token);
        }
        libc::_exit(0)
    }
}

/// Descriptors one message may carry.
const MAX_FDS: usize = 16;

/// Make the last close of `fds` in a child of the helper, which then acknowledges `token`:
/// removing a uprobe waits for a kernel grace period (~0.1 s a link on an idle machine, over
/// 1 s under load here), and grace periods waited for at the same time are shared, so the
/// links handed over together are closed together instead of one after another. The child
/// closes only once the helper has closed its own copies (a pipe says so), so the child's
/// close is the last. Where no child can be made, the helper closes them itself.
///
/// # Safety
/// Only in the helper process (single-threaded, system calls only).
unsafe fn close_in_child(sock: RawFd, fds: &[RawFd], token: &[u8; 8]) {
    // SAFETY: the caller's contract (this function's `# Safety`); system calls on our own
    // plain data.
    unsafe {
        let close_all = || {
            for &fd in fds {
                libc::close(fd);
            }
        };
        let mut p = [0 as RawFd; 2];
        if libc::pipe(p.as_mut_ptr()) != 0 {
            close_all();
            libc::send(sock, token.as_ptr().cast(), token.len(), libc::MSG_NOSIGNAL);
            return;
        }
        let child = libc::fork();
        if child == 0 {
            libc::close(p[1]);
            let mut b = 0u8;
            // Returns when the helper has written, or (EOF) when it is gone: its copies are
            // closed either way.
            while libc::read(p[0], (&mut b as *mut u8).cast(), 1) < 0
                && *libc::__errno_location() == libc::EINTR
            {}
            close_all();
            libc::send(sock, token.as_ptr().cast(), token.len(), libc::MSG_NOSIGNAL);
            libc::_exit(0);
        }
        libc::close(p[0]);
        if child < 0 {
            libc::close(p[1]);
            close_all();
            libc::send(sock, token.as_ptr().cast(), token.len(), libc::MSG_NOSIGNAL);
            return;
        }
        close_all();
        let b = 1u8;
        libc::write(p[1], (&b as *const u8).cast(), 1);
        libc::close(p[1]);
    }
}

/// Close descriptors `lo..=hi`: `close_range` (Linux 5.9+), else one by one up to 4096.
unsafe fn close_from_to(lo: u32, hi: u32) {
    // SAFETY: the caller's contract (this function's `# Safety`); system calls on our own
    // plain data.
    unsafe {
        if libc::syscall(libc::SYS_close_range, lo, hi, 0) == 0 {
            return;
        }
        for fd in lo..=hi.min(4095) {
            libc::close(fd as libc::c_int);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;

    /// A descriptor handed over is closed by the helper, not here: a pipe's read end handed
    /// over (our copy closed) leaves the write end with no reader.
    #[test]
    fn the_helper_makes_the_last_close() {
        let mut c = UprobeCloser::spawn().unwrap();
        let mut fds = [0; 2];
        // SAFETY: pipe2 fills the array.
        assert_eq!(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) }, 0);
        // SAFETY: new descriptors we own.
        let (r, w) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
        c.hand_over(r.as_fd()).unwrap();
        drop(r);
        assert_eq!(c.collect(Duration::from_secs(10)), 0);
        // No reader left anywhere: a write fails with EPIPE (Rust ignores SIGPIPE).
        // SAFETY: a one-byte write to our own pipe.
        let rc = unsafe { libc::write(w.as_raw_fd(), b"x".as_ptr().cast(), 1) };
        let errno = io::Error::last_os_error().raw_os_error();
        assert_eq!((rc, errno), (-1, Some(libc::EPIPE)));
        let pid = c.pid();
        drop(c);
        // The helper exits once our end is closed (reaped by the drop, or gone).
        // SAFETY: signal 0 only checks for existence.
        let alive = unsafe { libc::kill(pid, 0) } == 0;
        assert!(
            !alive,
            "helper {pid} still running after the closer was dropped"
        );
    }
}

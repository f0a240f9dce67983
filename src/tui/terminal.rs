//! The terminal and signals: raw mode and the alternate screen on the way in, restored on every
//! way out (quit, SIGINT/SIGTERM/SIGHUP sent by `kill`, a panic, an error), and stop signals
//! turned into a flag the UI thread reads.

use std::io::Stdout;
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};

use anyhow::Context;
use crossterm::{cursor, execute, terminal};
use ratatui::backend::CrosstermBackend;
use ratatui::Terminal;

static SIGNAL: AtomicI32 = AtomicI32::new(0);
static ACTIVE: AtomicBool = AtomicBool::new(false);

/// Take SIGINT, SIGTERM and SIGHUP away from every thread and wait for them on one thread of
/// our own, which records the signal (see [`signalled`]) and stops `stop` (the recorder's).
///
/// Why not a handler: the UI thread must learn of the signal to restore the terminal, and a
/// handler can do little. Blocked signals stay pending until `sigwait` takes them, whatever
/// handler is installed. Must be called before any thread is started: threads inherit the
/// mask of the thread that starts them.
pub(crate) fn catch_stop_signals(stop: crate::sys::StopToken) -> anyhow::Result<()> {
    // SAFETY: sigset_t is plain data that sigemptyset initializes; the calls get valid
    // pointers.
    let set = unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        for s in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
            libc::sigaddset(&mut set, s);
        }
        let rc = libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        anyhow::ensure!(rc == 0, "pthread_sigmask failed: {rc}");
        set
    };
    std::thread::Builder::new()
        .name("es-signals".into())
        .spawn(move || loop {
            let mut sig: libc::c_int = 0;
            // SAFETY: `set` is an initialized sigset_t owned by this closure.
            if unsafe { libc::sigwait(&set, &mut sig) } == 0 {
                SIGNAL.store(sig, Ordering::SeqCst);
                stop.stop();
            }
        })
        .context("starting the signal thread")?;
    Ok(())
}

/// The stop signal received, if any.
pub(crate) fn signalled() -> Option<i32> {
    match SIGNAL.load(Ordering::SeqCst) {
        0 => None,
        s => Some(s),
    }
}

/// What came on the terminal while [`wait_input`] waited.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Input {
    /// Bytes to read: crossterm's `event::poll(0)` parses them.
    Ready,
    Idle,
    /// The terminal hung up (its window closed, the tmux server or the ssh session gone).
    HungUp,
}

/// Wait up to `timeout` for input on the terminal, or its hang-up; None when stdin is not a
/// terminal (crossterm then reads /dev/tty itself: wait with `event::poll`).
///
/// Why not `event::poll` alone: a hung-up tty reads as always ready with nothing in it, and
/// crossterm's reader loops on that end-of-file inside `event::poll` forever, at full CPU,
/// deaf to stop signals (seen: a `top` left behind by a killed tmux server spinning for half
/// an hour). No SIGHUP need come: a process outside the tty's foreground group gets none.
/// `poll(2)` tells a hang-up apart (POLLHUP), so crossterm is asked only when there is
/// something to read. (A hang-up in the microseconds between this wait and crossterm's read
/// is still crossterm's to handle.)
pub(crate) fn wait_input(timeout: std::time::Duration) -> Option<Input> {
    // SAFETY: isatty and poll on fd 0 with a valid pollfd.
    unsafe {
        if libc::isatty(libc::STDIN_FILENO) != 1 {
            return None;
        }
        let mut fd = libc::pollfd {
            fd: libc::STDIN_FILENO,
            events: libc::POLLIN,
            revents: 0,
        };
        let ms = timeout.as_millis().min(i32::MAX as u128) as libc::c_int;
        Some(match libc::poll(&mut fd, 1, ms) {
            n if n > 0 && fd.revents & (libc::POLLHUP | libc::POLLERR | libc::POLLNVAL) != 0 => {
                Input::HungUp
            }
            n if n > 0 => Input::Ready,
            // 0: timed out; <0: interrupted (a signal, e.g. SIGWINCH): look again later.
            _ => Input::Idle,
        })
    }
}

/// Leave the alternate screen, show the cursor, leave raw mode. Safe to call more than once
/// and from a panic hook.
pub(crate) fn restore() {
    if ACTIVE.swap(false, Ordering::SeqCst) {
        let _ = terminal::disable_raw_mode();
        let _ = execute!(
            std::io::stdout(),
            terminal::LeaveAlternateScreen,
            cursor::Show
        );
    }
}

/// Restores the terminal when dropped (quit, `?` error return).
pub struct Guard;

impl Drop for Guard {
    fn drop(&mut self) {
        restore();
    }
}

/// Raw mode and the alternate screen, with a panic hook that restores the terminal before the
/// panic message is printed (so it is readable, and the shell is usable after).
pub(crate) fn enter() -> anyhow::Result<(Terminal<CrosstermBackend<Stdout>>, Guard)> {
    let prev = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        restore();
        prev(info);
    }));
    ACTIVE.store(true, Ordering::SeqCst);
    let guard = Guard;
    terminal::enable_raw_mode().context("entering raw mode")?;
    execute!(
        std::io::stdout(),
        terminal::EnterAlternateScreen,
        cursor::Hide
    )
    .context("entering the alternate screen")?;
    let t = Terminal::new(CrosstermBackend::new(std::io::stdout()))
        .context("setting up the terminal")?;
    Ok((t, guard))
}

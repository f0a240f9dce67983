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
pub fn catch_stop_signals(stop: crate::sys::StopToken) -> anyhow::Result<()> {
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
pub fn signalled() -> Option<i32> {
    match SIGNAL.load(Ordering::SeqCst) {
        0 => None,
        s => Some(s),
    }
}

/// Leave the alternate screen, show the cursor, leave raw mode. Safe to call more than once
/// and from a panic hook.
pub fn restore() {
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
pub fn enter() -> anyhow::Result<(Terminal<CrosstermBackend<Stdout>>, Guard)> {
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

//! The live dashboard's runtime (issue 15; docs/DESIGN.md "Dashboard"): the terminal taken
//! over and always given back, and the thread that draws the view (export/dashboard) and reads
//! keys.
//!
//! The main loop stays the owner of the run's state: it publishes what only it has (verdicts,
//! ring-buffer drops, the attach state) once a tick through an [`ArcSwap`]; the thread reads
//! that and the latest snapshot ([`Snapshots::load`]), never waiting on either. A quit key ends
//! the thread and wakes the main loop, which stops the way it does on SIGINT/SIGTERM: the
//! terminal is restored first ([`Dashboard::stop`]), then the summary is printed on the normal
//! screen.
//!
//! Restoring (raw mode off, the alternate screen left, the cursor shown) happens once,
//! whichever comes first: [`Screen`]'s drop (a quit, a signal, an error — the [`Run`] holding
//! it is dropped), or the panic hook installed on entering (chained before the previous hook,
//! so the panic message lands on the normal screen).
//!
//! While the dashboard is up, stderr — when it is the same terminal — is held in a pipe:
//! a line written there would be drawn over the view and stay (the view only redraws cells
//! that change). The held lines are printed, in order, as soon as the terminal is restored;
//! the view's attach line shows how many are held and the latest.
//!
//! [`Run`]: super::Run

use std::{
    collections::{HashMap, VecDeque},
    io::{BufRead, IsTerminal, Stdout, Write},
    os::fd::{AsRawFd, FromRawFd, OwnedFd},
    sync::{
        Arc, Mutex, Once,
        atomic::{AtomicBool, AtomicI32, Ordering},
    },
    thread::JoinHandle,
    time::{Duration, Instant},
};

use anyhow::{Context, Result};
use arc_swap::ArcSwap;
use ratatui::{
    Terminal,
    backend::CrosstermBackend,
    crossterm::{
        cursor::{Hide, Show},
        event::{self, Event, KeyCode, KeyEventKind, KeyModifiers},
        execute,
        terminal::{Clear, ClearType, EnterAlternateScreen, LeaveAlternateScreen, disable_raw_mode, enable_raw_mode},
    },
};

use crate::{
    analyze::window::ProcessVerdict,
    attach::Drops,
    export::dashboard::app::{Action, App, Input},
    snapshot::Snapshots,
};

/// How often the view is redrawn from the latest snapshot (the reader publishes every 250 ms:
/// snapshot::INTERVAL).
pub const REFRESH: Duration = Duration::from_millis(250);
/// The longest the thread waits for a key before looking whether it should stop: bounds how
/// long [`Dashboard::stop`] waits.
const STOP_POLL: Duration = Duration::from_millis(50);
/// Held stderr lines kept (the latest); the rest are counted.
const HELD_MAX: usize = 1000;

/// What the main loop publishes for the view once a tick.
#[derive(Default)]
pub struct Published {
    pub verdicts: HashMap<u32, ProcessVerdict>,
    pub drops: Drops,
    pub attach: String,
}

/// The running dashboard: its thread, and the terminal it holds.
pub struct Dashboard {
    shared: Arc<ArcSwap<Published>>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<Result<()>>>,
    /// Dropped after the thread has ended: restores the terminal.
    screen: Option<Screen>,
}

impl Dashboard {
    /// Takes over the terminal (stdout) and starts drawing. `ended` is notified when the
    /// thread ends by itself: a quit key, a failed draw, a panic.
    pub fn start(
        snapshots: Snapshots,
        started: Instant,
        color: bool,
        first: Published,
        ended: Arc<tokio::sync::Notify>,
    ) -> Result<Dashboard> {
        let screen = Screen::enter()?;
        let terminal =
            Terminal::new(CrosstermBackend::new(std::io::stdout())).context("the dashboard cannot use the terminal")?;
        let shared = Arc::new(ArcSwap::from_pointee(first));
        let stop = Arc::new(AtomicBool::new(false));
        let thread = std::thread::Builder::new()
            .name("dashboard".into())
            .spawn({
                let (shared, stop) = (shared.clone(), stop.clone());
                move || {
                    // Tells the main loop on every way out of the thread, an unwinding panic too.
                    let _tell = Tell(ended);
                    draw_loop(terminal, App::new(color), &snapshots, &shared, &stop, started)
                }
            })
            .context("cannot start the dashboard thread")?;
        Ok(Dashboard {
            shared,
            stop,
            thread: Some(thread),
            screen: Some(screen),
        })
    }

    /// The main loop's latest verdicts, drops and attach state, for the next frame.
    pub fn publish(&self, p: Published) {
        self.shared.store(Arc::new(p));
    }

    /// Stops the thread and restores the terminal (then the held stderr lines are printed);
    /// why the thread failed, if it did.
    pub fn stop(mut self) -> Option<String> {
        self.stop.store(true, Ordering::Relaxed);
        let failed = match self.thread.take().map(JoinHandle::join) {
            Some(Ok(Err(e))) => Some(format!("the dashboard failed: {e:#}")),
            Some(Err(_)) => Some("the dashboard panicked".to_string()),
            _ => None,
        };
        drop(self.screen.take());
        failed
    }
}

impl Drop for Dashboard {
    /// An error path (the run dropped without [`Dashboard::stop`]): the thread is told to stop
    /// and the terminal restored at once; the thread ends within [`STOP_POLL`] without drawing.
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

struct Tell(Arc<tokio::sync::Notify>);

impl Drop for Tell {
    fn drop(&mut self) {
        self.0.notify_one();
    }
}

fn draw_loop(
    mut terminal: Terminal<CrosstermBackend<Stdout>>,
    mut app: App,
    snapshots: &Snapshots,
    shared: &ArcSwap<Published>,
    stop: &AtomicBool,
    started: Instant,
) -> Result<()> {
    let mut next = Instant::now();
    loop {
        if stop.load(Ordering::Relaxed) {
            return Ok(());
        }
        let mut draw = false;
        if Instant::now() >= next {
            let (snap, p) = (snapshots.load(), shared.load());
            let attach = attach_line(&p.attach);
            app.update(&Input {
                snap: &snap,
                verdicts: &p.verdicts,
                drops: &p.drops,
                attach: &attach,
                elapsed_s: started.elapsed().as_secs_f64(),
            });
            next = Instant::now() + REFRESH;
            draw = true;
        }
        let wait = next.saturating_duration_since(Instant::now()).min(STOP_POLL);
        if event::poll(wait).context("reading the terminal")? {
            match event::read().context("reading the terminal")? {
                // Raw mode turns Ctrl-C into a key, not SIGINT: it quits whatever the view says.
                Event::Key(k)
                    if k.kind == KeyEventKind::Press
                        && k.modifiers.contains(KeyModifiers::CONTROL)
                        && matches!(k.code, KeyCode::Char('c' | 'C')) =>
                {
                    return Ok(());
                }
                Event::Key(k) => match app.key(k) {
                    Action::Quit => return Ok(()),
                    Action::Redraw => draw = true,
                    Action::None => {}
                },
                // Terminal::draw resizes its buffers to the new size (and clears once) itself.
                Event::Resize(..) => draw = true,
                _ => {}
            }
        }
        if draw && !stop.load(Ordering::Relaxed) {
            terminal.draw(|f| app.draw(f)).context("drawing the dashboard")?;
        }
    }
}

/// The attach state, with the held stderr messages (how many, and the latest).
fn attach_line(attach: &str) -> String {
    let held = held().lock().unwrap_or_else(|e| e.into_inner());
    let n = held.lines.len() as u64 + held.more;
    match held.lines.back() {
        Some(last) => format!("{attach}; stderr held until exit: {n} lines, latest: {last}"),
        None => attach.to_string(),
    }
}

/// Whether the terminal is ours now (set on entering, cleared by the first restore).
static ACTIVE: AtomicBool = AtomicBool::new(false);
/// The real stderr while it is held in a pipe (-1: not held).
static SAVED_STDERR: AtomicI32 = AtomicI32::new(-1);
static HOOK: Once = Once::new();

#[derive(Default)]
struct Held {
    lines: VecDeque<String>,
    /// Lines beyond [`HELD_MAX`], not kept.
    more: u64,
}

fn held() -> &'static Mutex<Held> {
    static HELD: Mutex<Held> = Mutex::new(Held {
        lines: VecDeque::new(),
        more: 0,
    });
    &HELD
}

/// The terminal in the dashboard's modes; restored on drop (or by the panic hook, first).
struct Screen {
    /// Reads the held stderr until the pipe closes.
    stderr_reader: Option<JoinHandle<()>>,
}

impl Screen {
    fn enter() -> Result<Screen> {
        HOOK.call_once(|| {
            let previous = std::panic::take_hook();
            std::panic::set_hook(Box::new(move |info| {
                restore(None);
                previous(info);
            }));
        });
        ACTIVE.store(true, Ordering::SeqCst);
        // From here on a failure restores what was entered (the drop).
        let mut screen = Screen { stderr_reader: None };
        enable_raw_mode().context("cannot put the terminal in raw mode for the dashboard")?;
        // The one full clear (Screen::enter), not Terminal::clear, which asks the terminal where
        // its cursor is and fails on one that does not answer: every later frame writes only
        // the cells that changed (a resize clears once more, in Terminal::draw).
        execute!(std::io::stdout(), EnterAlternateScreen, Hide, Clear(ClearType::All))
            .context("cannot switch the terminal to the dashboard's screen")?;
        if std::io::stderr().is_terminal() {
            screen.stderr_reader = Some(hold_stderr()?);
        }
        Ok(screen)
    }
}

impl Drop for Screen {
    fn drop(&mut self) {
        restore(self.stderr_reader.take());
    }
}

/// Points fd 2 at a pipe whose lines a thread keeps in [`held`].
fn hold_stderr() -> Result<JoinHandle<()>> {
    let mut fds = [0; 2];
    // SAFETY: pipe2 writes two descriptors into the 2-element array it is given.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(std::io::Error::last_os_error()).context("cannot hold stderr while the dashboard is up");
    }
    // SAFETY: both descriptors were just created by pipe2 and are owned by nothing else.
    let (read, write) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    std::io::stderr().flush().ok();
    // SAFETY: dup of fd 2, which is open (stderr is a terminal); the copy is ours until
    // restore() puts it back and closes it.
    let saved = unsafe { libc::fcntl(2, libc::F_DUPFD_CLOEXEC, 3) };
    if saved < 0 {
        return Err(std::io::Error::last_os_error()).context("cannot hold stderr while the dashboard is up");
    }
    // SAFETY: dup2 onto fd 2 of a descriptor we own; `write` is closed when it drops below,
    // leaving fd 2 the pipe's only write end.
    if unsafe { libc::dup2(write.as_raw_fd(), 2) } < 0 {
        let e = std::io::Error::last_os_error();
        // SAFETY: `saved` is our descriptor, not used anywhere else.
        unsafe { libc::close(saved) };
        return Err(e).context("cannot hold stderr while the dashboard is up");
    }
    SAVED_STDERR.store(saved, Ordering::SeqCst);
    drop(write);
    std::thread::Builder::new()
        .name("dashboard-stderr".into())
        .spawn(move || {
            let pipe = std::io::BufReader::new(std::fs::File::from(read));
            for line in pipe.split(b'\n').map_while(std::result::Result::ok) {
                let mut h = held().lock().unwrap_or_else(|e| e.into_inner());
                if h.lines.len() >= HELD_MAX {
                    h.lines.pop_front();
                    h.more += 1;
                }
                h.lines.push_back(String::from_utf8_lossy(&line).into_owned());
            }
        })
        .context("cannot start the stderr thread")
}

/// Gives the terminal back, once: raw mode off, the normal screen, the cursor; then stderr,
/// and the lines held meanwhile (all of them, after `reader` has read the pipe to its end).
fn restore(reader: Option<JoinHandle<()>>) {
    if !ACTIVE.swap(false, Ordering::SeqCst) {
        return;
    }
    let _ = disable_raw_mode();
    let _ = execute!(std::io::stdout(), LeaveAlternateScreen, Show);
    let saved = SAVED_STDERR.swap(-1, Ordering::SeqCst);
    if saved >= 0 {
        // SAFETY: `saved` is the real stderr's copy made by hold_stderr, ours alone; putting it
        // back on fd 2 closes the pipe's write end, so the reader sees its end.
        unsafe {
            libc::dup2(saved, 2);
            libc::close(saved);
        }
    }
    if let Some(r) = reader {
        let _ = r.join();
    }
    // try_lock: a panic on the stderr thread may hold the lock while this runs (the hook).
    let mut h = match held().try_lock() {
        Ok(h) => h,
        Err(std::sync::TryLockError::Poisoned(e)) => e.into_inner(),
        Err(std::sync::TryLockError::WouldBlock) => return,
    };
    let mut err = std::io::stderr().lock();
    if h.more > 0 {
        let _ = writeln!(err, "gpu-observer: ({} earlier messages not kept)", h.more);
    }
    for l in h.lines.drain(..) {
        let _ = writeln!(err, "{l}");
    }
    h.more = 0;
}

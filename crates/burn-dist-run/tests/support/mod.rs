//! Shared scaffolding for tests that run the real `burn-dist-run` binary.
//!
//! Every wait here is bounded by a deadline and driven by events (output lines, process exit,
//! pipe end-of-file), never by sleeping. Include it with `mod support;` from any test file of
//! this crate; not every test binary uses every helper.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read};
use std::mem::MaybeUninit;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::thread;
use std::time::{Duration, Instant};

/// The launcher binary built for this test run.
pub const LAUNCHER: &str = env!("CARGO_BIN_EXE_burn-dist-run");

/// A deadline `secs` seconds from now.
pub fn within(secs: u64) -> Instant {
    Instant::now() + Duration::from_secs(secs)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stream {
    Stdout,
    Stderr,
}

/// One line the launcher wrote, without its newline.
#[derive(Debug, Clone)]
pub struct Line {
    pub stream: Stream,
    pub text: String,
}

enum Message {
    Line(Line),
    Closed(Stream),
    Exited(ExitStatus),
}

/// A running launcher whose output is collected line by line.
pub struct Launch {
    /// Reaped only by `wait_exit` or `Drop`, so its pid cannot be reused while we may signal it.
    child: Child,
    messages: Receiver<Message>,
    seen: Vec<Line>,
    open_streams: u8,
    status: Option<ExitStatus>,
    reaped: bool,
}

impl Launch {
    /// `burn-dist-run ARGS...` with `env` added. BURN_DIST_TOKEN and the thread-count variables
    /// (RAYON_NUM_THREADS, OMP_NUM_THREADS) are removed from the inherited environment first, so
    /// that what is exported in the developer's shell cannot change a test; pass them in `env`
    /// to set them.
    pub fn command(args: &[&str], env: &[(&str, &str)]) -> Command {
        let mut command = Command::new(LAUNCHER);
        command.args(args).env_remove("BURN_DIST_TOKEN");
        for var in ["RAYON_NUM_THREADS", "OMP_NUM_THREADS"] {
            command.env_remove(var);
        }
        for (name, value) in env {
            command.env(name, value);
        }
        command
    }

    /// Starts `burn-dist-run ARGS...` (see `command`).
    pub fn spawn(args: &[&str], env: &[(&str, &str)]) -> Launch {
        Launch::spawn_command(Launch::command(args, env))
    }

    /// Starts a prepared command (e.g. one that a `DescendantProbe` was passed into) with piped
    /// output.
    pub fn spawn_command(mut command: Command) -> Launch {
        command
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = command.spawn().expect("start burn-dist-run");
        let (tx, messages) = mpsc::channel();
        read_lines(child.stdout.take().unwrap(), Stream::Stdout, tx.clone());
        read_lines(child.stderr.take().unwrap(), Stream::Stderr, tx.clone());
        watch_exit(child.id(), tx);
        Launch {
            child,
            messages,
            seen: Vec::new(),
            open_streams: 2,
            status: None,
            reaped: false,
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends `signal` to the launcher itself (not its process group).
    pub fn signal(&self, signal: i32) {
        assert!(
            !self.reaped,
            "the launcher was already reaped; its pid may be reused"
        );
        // SAFETY: plain syscall; the pid is ours and unreaped (checked above).
        let rc = unsafe { libc::kill(self.child.id() as libc::pid_t, signal) };
        assert_eq!(rc, 0, "kill({}, {signal})", self.child.id());
    }

    /// The first line (of either stream, earlier lines included) for which `matches` is true.
    /// Err with everything seen so far if the deadline passes or the launcher's output ends first.
    pub fn wait_for_line(
        &mut self,
        mut matches: impl FnMut(&str) -> bool,
        deadline: Instant,
    ) -> Result<String, String> {
        let mut checked = 0;
        loop {
            if let Some(line) = self.seen[checked..].iter().find(|l| matches(&l.text)) {
                return Ok(line.text.clone());
            }
            checked = self.seen.len();
            if self.open_streams == 0 {
                return Err(format!(
                    "output ended without the line\n{}",
                    self.transcript()
                ));
            }
            if !self.next_message(deadline) {
                return Err(format!(
                    "no such line before the deadline\n{}",
                    self.transcript()
                ));
            }
        }
    }

    /// Waits until the launcher has exited and all of its output has been read, then reaps it.
    /// If the deadline passes first, kills the launcher and panics with all output so far.
    pub fn wait_exit(&mut self, deadline: Instant) -> ExitStatus {
        while self.status.is_none() || self.open_streams > 0 {
            if !self.next_message(deadline) {
                self.kill_and_reap();
                panic!(
                    "burn-dist-run did not exit (and close its output) before the deadline; \
                     killed it\n{}",
                    self.transcript()
                );
            }
        }
        self.reap();
        self.status.unwrap()
    }

    /// Every line seen so far, in arrival order.
    pub fn output(&self) -> &[Line] {
        &self.seen
    }

    pub fn stdout(&self) -> Vec<&str> {
        self.lines_of(Stream::Stdout)
    }

    pub fn stderr(&self) -> Vec<&str> {
        self.lines_of(Stream::Stderr)
    }

    /// All output so far, stream-tagged, for assertion messages.
    pub fn transcript(&self) -> String {
        let mut text = String::new();
        for line in &self.seen {
            let tag = match line.stream {
                Stream::Stdout => "out",
                Stream::Stderr => "err",
            };
            text.push_str(&format!("  {tag}| {}\n", line.text));
        }
        if let Some(status) = self.status {
            text.push_str(&format!("  (launcher {status})\n"));
        }
        text
    }

    fn lines_of(&self, stream: Stream) -> Vec<&str> {
        let lines = self.seen.iter().filter(|l| l.stream == stream);
        lines.map(|l| l.text.as_str()).collect()
    }

    /// Takes in one message; false if the deadline passed first.
    fn next_message(&mut self, deadline: Instant) -> bool {
        let left = deadline.saturating_duration_since(Instant::now());
        match self.messages.recv_timeout(left) {
            Ok(Message::Line(line)) => self.seen.push(line),
            Ok(Message::Closed(_)) => self.open_streams -= 1,
            Ok(Message::Exited(status)) => self.status = Some(status),
            Err(RecvTimeoutError::Timeout) => return false,
            Err(RecvTimeoutError::Disconnected) => unreachable!("all senders finished early"),
        }
        true
    }

    fn reap(&mut self) {
        if !self.reaped {
            let _ = self.child.wait();
            self.reaped = true;
        }
    }

    fn kill_and_reap(&mut self) {
        if !self.reaped {
            let _ = self.child.kill();
            self.reap();
        }
    }
}

impl Drop for Launch {
    /// A failed assertion must not leave a launcher (and, through it, its ranks) running.
    fn drop(&mut self) {
        self.kill_and_reap();
    }
}

fn read_lines(source: impl Read + Send + 'static, stream: Stream, tx: Sender<Message>) {
    thread::spawn(move || {
        let mut reader = BufReader::new(source);
        let mut raw = Vec::new();
        while matches!(reader.read_until(b'\n', &mut raw), Ok(n) if n > 0) {
            let text = String::from_utf8_lossy(raw.strip_suffix(b"\n").unwrap_or(&raw));
            let line = Line {
                stream,
                text: text.into_owned(),
            };
            if tx.send(Message::Line(line)).is_err() {
                return;
            }
            raw.clear();
        }
        let _ = tx.send(Message::Closed(stream));
    });
}

/// Reports the launcher's exit without reaping it (WNOWAIT), so `Launch::signal` and `Drop` can
/// never hit a process that reused its pid.
fn watch_exit(pid: u32, tx: Sender<Message>) {
    thread::spawn(move || {
        let mut info = MaybeUninit::<libc::siginfo_t>::zeroed();
        loop {
            // SAFETY: `info` is a valid buffer for the kernel to fill.
            let rc = unsafe {
                libc::waitid(
                    libc::P_PID,
                    pid as libc::id_t,
                    info.as_mut_ptr(),
                    libc::WEXITED | libc::WNOWAIT,
                )
            };
            if rc == 0 {
                break;
            }
            let err = std::io::Error::last_os_error();
            assert_eq!(err.kind(), std::io::ErrorKind::Interrupted, "waitid: {err}");
        }
        // SAFETY: waitid succeeded and filled `info`; si_status is valid for child events.
        let info = unsafe { info.assume_init() };
        let (code, status) = (info.si_code, unsafe { info.si_status() });
        let raw = match code {
            libc::CLD_EXITED => (status & 0xff) << 8,
            libc::CLD_DUMPED => (status & 0x7f) | 0x80,
            _ => status & 0x7f,
        };
        let _ = tx.send(Message::Exited(ExitStatus::from_raw(raw)));
    });
}

/// Proves that every process the launcher started is gone, without sleeping or scanning /proc.
///
/// It is a pipe whose write end is inherited by the launcher and from there by every rank and
/// everything they start. Once the test drops its own copy, reading the read end returns end of
/// file exactly when every holder has exited. The write end is close-on-exec in this process and
/// is made inheritable only inside the launcher's fork, so launchers started by other tests
/// running in parallel do not hold it.
pub struct DescendantProbe {
    read: OwnedFd,
    write: Option<OwnedFd>,
}

impl Default for DescendantProbe {
    fn default() -> Self {
        DescendantProbe::new()
    }
}

impl DescendantProbe {
    pub fn new() -> DescendantProbe {
        let mut fds = [0 as RawFd; 2];
        // SAFETY: `fds` has room for the two descriptors pipe2 writes.
        let rc = unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) };
        assert_eq!(rc, 0, "pipe2: {}", std::io::Error::last_os_error());
        // SAFETY: pipe2 just created both descriptors and nothing else owns them.
        let (read, write) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
        DescendantProbe {
            read,
            write: Some(write),
        }
    }

    /// Makes `command` (the launcher) inherit the write end.
    pub fn pass_to(&self, command: &mut Command) {
        let fd = self
            .write
            .as_ref()
            .expect("probe already waited on")
            .as_raw_fd();
        // SAFETY: runs between fork and exec; fcntl is async-signal-safe and allocates nothing.
        unsafe {
            command.pre_exec(move || {
                if libc::fcntl(fd, libc::F_SETFD, 0) == 0 {
                    Ok(())
                } else {
                    Err(std::io::Error::last_os_error())
                }
            });
        }
    }

    /// Drops the test's own write end, then waits for end of file on the read end: Ok once no
    /// process holds the write end any more, Err if one still does at the deadline.
    pub fn wait_all_gone(&mut self, deadline: Instant) -> Result<(), String> {
        self.write = None;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let mut poll = libc::pollfd {
                fd: self.read.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            let millis = left.as_millis().min(i32::MAX as u128) as i32;
            // SAFETY: one valid pollfd.
            let ready = unsafe { libc::poll(&mut poll, 1, millis) };
            if ready < 0 {
                let err = std::io::Error::last_os_error();
                assert_eq!(err.kind(), std::io::ErrorKind::Interrupted, "poll: {err}");
                continue;
            }
            if ready == 0 {
                return Err("a process started by the launcher is still alive".to_owned());
            }
            let mut byte = [0u8; 64];
            // SAFETY: reads into a local buffer of the given length.
            let n = unsafe { libc::read(poll.fd, byte.as_mut_ptr().cast(), byte.len()) };
            if n == 0 {
                return Ok(());
            }
            // Nobody writes to the probe, but data or EINTR would just mean: keep waiting.
        }
    }
}

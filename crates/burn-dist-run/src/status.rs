//! How a rank's end is reported: in words for the user, and as the launcher's exit code.

use std::os::unix::process::ExitStatusExt;
use std::process::ExitStatus;

/// "exited with code 3", "killed by signal 9 (SIGKILL)", "killed by signal 6 (SIGABRT), core dumped".
pub fn describe(status: ExitStatus) -> String {
    if let Some(code) = status.code() {
        return format!("exited with code {code}");
    }
    let signal = status.signal().unwrap_or(0);
    let core = if status.core_dumped() {
        ", core dumped"
    } else {
        ""
    };
    format!("killed by {}{core}", describe_signal(signal))
}

/// [`describe`] for a rank that failed on its own (the launcher sent it nothing), with the
/// likely cause of a SIGKILL nobody here sent: the kernel's out-of-memory killer.
pub fn describe_failure(status: ExitStatus) -> String {
    let described = describe(status);
    if status.signal() == Some(libc::SIGKILL) {
        return format!(
            "{described}, which the launcher did not send: most often the kernel's \
             out-of-memory killer (`dmesg` names it); the ranks need less memory (ZeRO stages \
             2 and 3 shard the model states) or the machine more"
        );
    }
    described
}

/// "signal 15 (SIGTERM)"; the number alone for signals without a well-known name.
pub fn describe_signal(signal: i32) -> String {
    match signal_name(signal) {
        Some(name) => format!("signal {signal} ({name})"),
        None => format!("signal {signal}"),
    }
}

/// The shell convention: the exit code itself, or 128 + the signal number. Never 0 for a failure.
pub fn exit_code(status: ExitStatus) -> i32 {
    match (status.code(), status.signal()) {
        (Some(code), _) => code,
        (None, Some(signal)) => 128 + signal,
        // Neither exited nor signalled (stopped/continued) is not a final status; still a failure.
        (None, None) => 1,
    }
}

pub fn signal_name(signal: i32) -> Option<&'static str> {
    let name = match signal {
        libc::SIGHUP => "SIGHUP",
        libc::SIGINT => "SIGINT",
        libc::SIGQUIT => "SIGQUIT",
        libc::SIGILL => "SIGILL",
        libc::SIGTRAP => "SIGTRAP",
        libc::SIGABRT => "SIGABRT",
        libc::SIGBUS => "SIGBUS",
        libc::SIGFPE => "SIGFPE",
        libc::SIGKILL => "SIGKILL",
        libc::SIGUSR1 => "SIGUSR1",
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGUSR2 => "SIGUSR2",
        libc::SIGPIPE => "SIGPIPE",
        libc::SIGALRM => "SIGALRM",
        libc::SIGTERM => "SIGTERM",
        libc::SIGXCPU => "SIGXCPU",
        libc::SIGXFSZ => "SIGXFSZ",
        libc::SIGSYS => "SIGSYS",
        _ => return None,
    };
    Some(name)
}

#[cfg(test)]
mod tests {
    use super::*;

    // Raw wait(2) statuses: the exit code sits in the second byte, a signal in the low 7 bits.
    fn exited(code: i32) -> ExitStatus {
        ExitStatus::from_raw(code << 8)
    }
    fn killed(signal: i32) -> ExitStatus {
        ExitStatus::from_raw(signal)
    }

    #[test]
    fn statuses_read_like_the_shell() {
        assert_eq!(describe(exited(3)), "exited with code 3");
        assert_eq!(describe(killed(9)), "killed by signal 9 (SIGKILL)");
        assert!(describe_failure(killed(9)).contains("out-of-memory killer"));
        assert_eq!(describe_failure(exited(3)), "exited with code 3");
        assert_eq!(
            describe(ExitStatus::from_raw(6 | 0x80)),
            "killed by signal 6 (SIGABRT), core dumped"
        );
        assert_eq!(exit_code(exited(3)), 3);
        assert_eq!(exit_code(killed(15)), 143);
    }
}

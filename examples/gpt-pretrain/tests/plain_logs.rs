//! Off a terminal the logs are plain text: gpt-pretrain's ranks and `burn-dist-check`'s,
//! under the launcher, with stdout and stderr redirected to files, write no colour codes, in
//! their lines or in the `[rank R]` prefixes the launcher adds.

use burn_dist_models::processes::{
    assert_plain_logs, launch_command, scratch_dir, workspace_binary,
};

mod common;

#[test]
fn logs_redirected_to_files_carry_no_colour_codes() {
    let dir = scratch_dir("plain-logs");
    let mut gpt = launch_command(2, env!("CARGO_BIN_EXE_gpt-pretrain").as_ref());
    gpt.args(common::RUN).arg("--run-dir").arg(dir.join("run"));
    let logs = assert_plain_logs(gpt, &dir, "gpt-pretrain");
    assert!(
        logs.lines()
            .any(|l| l.starts_with("[rank 1] ") && l.contains("INFO")),
        "rank 1's logs, prefixed by the launcher:\n{logs}"
    );

    let mut check = launch_command(2, &workspace_binary("burn-dist-check"));
    check.args(["--mib", "0.1", "--iters", "2"]);
    assert_plain_logs(check, &dir, "burn-dist-check");
    let _ = std::fs::remove_dir_all(&dir);
}

//! What the tests need beyond the Rust toolchain, checked before any test runs, and installed
//! where this machine lets us, so that `cargo xtask test` on a fresh machine either passes or
//! fails at once with the command to run (not minutes later, deep inside a test).
//!
//! Today that is one thing: a Vulkan driver for cubecl's wgpu runtime, on which the kernel
//! tests, the device-path tests and the `fused_adam` bench run. On machines without a GPU it is
//! Mesa's software driver, lavapipe.

use std::path::Path;
use std::process::Command;

/// Debian/Ubuntu packages of Mesa's lavapipe and the Vulkan loader.
const LAVAPIPE_PACKAGES: [&str; 2] = ["mesa-vulkan-drivers", "libvulkan1"];

/// Where Vulkan loaders look for driver manifests (the Vulkan loader's documented search path).
const ICD_DIRS: [&str; 4] = [
    "/usr/share/vulkan/icd.d",
    "/usr/local/share/vulkan/icd.d",
    "/etc/vulkan/icd.d",
    "/usr/local/etc/vulkan/icd.d",
];

/// Library directories where the Vulkan loader `libvulkan.so.1` is installed.
const LIB_DIRS: [&str; 5] = [
    "/usr/lib/x86_64-linux-gnu",
    "/usr/lib/aarch64-linux-gnu",
    "/usr/lib64",
    "/usr/lib",
    "/usr/local/lib",
];

/// Makes sure a Vulkan driver is there, installing Mesa's lavapipe with apt-get when it is not
/// and this process may (root, or password-less sudo). Otherwise an error with the command.
pub fn ensure_vulkan_driver() -> Result<(), String> {
    if !cfg!(target_os = "linux") || vulkan_driver_present() {
        // Elsewhere (macOS: Metal) wgpu finds the platform's own API; nothing to install.
        return Ok(());
    }
    let packages = LAVAPIPE_PACKAGES.join(" ");
    let manual = format!(
        "the kernel and device-path tests need a Vulkan driver, and none was found (no \
         libvulkan.so.1 or no driver manifest in {}). On Debian/Ubuntu run \
         `sudo apt-get update && sudo apt-get install -y {packages}`; elsewhere install your \
         distribution's Mesa Vulkan drivers and Vulkan loader (Fedora: mesa-vulkan-drivers \
         vulkan-loader; Arch: vulkan-swrast vulkan-icd-loader). Then run this again.",
        ICD_DIRS.join(", ")
    );
    if !on_path("apt-get") {
        return Err(manual);
    }
    let sudo = match (is_root(), on_path("sudo")) {
        (true, _) => None,
        (false, true) => Some("sudo"),
        (false, false) => return Err(manual),
    };
    eprintln!(
        "xtask: no Vulkan driver found; installing Mesa's lavapipe ({packages}) with apt-get"
    );
    let apt = |args: &[&str]| {
        let mut command = match sudo {
            // -n: never prompt; a sudo that wants a password fails here and we print `manual`.
            Some(sudo) => {
                let mut c = Command::new(sudo);
                c.args(["-n", "env", "DEBIAN_FRONTEND=noninteractive", "apt-get"]);
                c
            }
            None => {
                let mut c = Command::new("apt-get");
                c.env("DEBIAN_FRONTEND", "noninteractive");
                c
            }
        };
        command.args(args).status().is_ok_and(|s| s.success())
    };
    let installed = apt(&["update", "-qq"])
        && apt(&["install", "-y", "-qq"]
            .into_iter()
            .chain(LAVAPIPE_PACKAGES)
            .collect::<Vec<_>>());
    if installed && vulkan_driver_present() {
        Ok(())
    } else {
        Err(format!("installing {packages} failed: {manual}"))
    }
}

/// A Vulkan loader and at least one driver manifest (lavapipe's, or a GPU vendor's), or a
/// manifest named by the loader's override variables.
fn vulkan_driver_present() -> bool {
    let loader = LIB_DIRS
        .iter()
        .any(|dir| Path::new(dir).join("libvulkan.so.1").exists());
    let overridden = ["VK_DRIVER_FILES", "VK_ICD_FILENAMES"]
        .iter()
        .any(|v| std::env::var_os(v).is_some_and(|s| !s.is_empty()));
    let manifest = ICD_DIRS.iter().any(|dir| {
        std::fs::read_dir(dir).is_ok_and(|entries| {
            entries
                .flatten()
                .any(|e| e.path().extension().is_some_and(|x| x == "json"))
        })
    });
    loader && (manifest || overridden)
}

fn on_path(program: &str) -> bool {
    std::env::var_os("PATH")
        .is_some_and(|path| std::env::split_paths(&path).any(|dir| dir.join(program).is_file()))
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
}

#!/usr/bin/env bash
# `cargo xtask rehearse`: the README's two commands as a newcomer runs them, on a machine
# nobody prepared. A fresh Debian root (debootstrap: only what a new machine of ours has, gcc,
# git and Python, and no Mesa, no Vulkan), the Rust toolchain copied in, a fresh clone of the
# committed HEAD, an empty cargo home and an empty target dir; then, inside a chroot:
#     cargo xtask pretrain && cargo xtask test
# It catches what a warm machine hides: a package that only an earlier command downloaded, a
# system library installed by hand. Needs root (debootstrap, chroot, mounts) and the Debian
# mirror. Writes $REHEARSE_DIR/rehearse.log; the root is removed afterwards unless --keep.
set -euo pipefail

keep=0
for arg in "$@"; do
    case "$arg" in
        --keep) keep=1 ;;
        *) echo "rehearse: unknown argument '$arg' (only --keep)" >&2; exit 2 ;;
    esac
done

repo=$(git -C "$(dirname "$0")/.." rev-parse --show-toplevel)
dir=${REHEARSE_DIR:-$HOME/.cache/burn-dist-rehearse}
suite=${REHEARSE_SUITE:-bookworm}
mirror=${REHEARSE_MIRROR:-http://deb.debian.org/debian}
# What the machines of this project come with besides the Rust toolchain (env docs).
base_packages=ca-certificates,gcc,libc6-dev,git,python3,procps
readme_commands="cargo xtask pretrain && cargo xtask test"

if [ "$(id -u)" -ne 0 ]; then
    echo "rehearse: needs root (debootstrap, chroot and mounts); run it as root" >&2
    exit 2
fi
command -v debootstrap >/dev/null || {
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap
}
mkdir -p "$dir"
log="$dir/rehearse.log"
root="$dir/root"

# The base system is downloaded once and kept as a tarball; every rehearsal starts from it.
base="$dir/base-$suite.tar"
if [ ! -f "$base" ]; then
    echo "rehearse: debootstrap $suite ($base_packages) into $base (once)"
    staging="$dir/staging"
    rm -rf "$staging"
    debootstrap --variant=minbase --include="$base_packages" "$suite" "$staging" "$mirror" \
        >"$dir/debootstrap.log" 2>&1 || {
        echo "rehearse: debootstrap failed; see $dir/debootstrap.log" >&2
        exit 1
    }
    tar -C "$staging" -cf "$base.part" . && mv "$base.part" "$base"
    rm -rf "$staging"
fi

# The root gets the host's /proc, /sys and /dev mounted inside it: nothing under it may be
# removed while any of them is still mounted, or rm would reach into the host's /dev.
unmount_all() {
    local m
    for m in $(awk -v r="$root/" 'index($2, r) == 1 {print $2}' /proc/mounts | sort -r); do
        umount -R "$m" 2>/dev/null || umount -R -l "$m" 2>/dev/null || true
    done
}
remove_root() {
    unmount_all
    if awk -v r="$root/" 'index($2, r) == 1 {found = 1} END {exit !found}' /proc/mounts; then
        echo "rehearse: mounts remain under $root; not removing it (unmount them by hand)" >&2
        return 1
    fi
    # --one-file-system: never cross into a mount, whatever happened above.
    rm -rf --one-file-system "$root"
}
cleanup() {
    if [ "$keep" -eq 0 ]; then remove_root; else unmount_all; fi
}
trap cleanup EXIT

remove_root
mkdir -p "$root"
tar -C "$root" -xf "$base"
cp /etc/resolv.conf "$root/etc/resolv.conf"
# debootstrap writes no /etc/hosts; every installed machine has one that names localhost.
printf '127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n' >"$root/etc/hosts"
# The machine's trust store: where the network inspects TLS with its own authority, every
# machine of that workplace, fresh ones included, trusts it; a bare Debian root does not.
cp /etc/ssl/certs/ca-certificates.crt "$root/etc/ssl/certs/ca-certificates.crt"

# The toolchain cargo uses here (cargo, rustc, rustfmt, clippy), without rustup.
sysroot=$(rustc --print sysroot)
mkdir -p "$root/opt"
cp -a "$sysroot" "$root/opt/rust"

# A fresh clone: only what is committed travels.
git clone --quiet --no-local "$repo" "$root/work/burn-dist"
head=$(git -C "$root/work/burn-dist" rev-parse --short HEAD)

for m in proc sys dev; do
    mkdir -p "$root/$m"
done
mount -t proc proc "$root/proc"
mount --rbind /sys "$root/sys" && mount --make-rslave "$root/sys"
mount --rbind /dev "$root/dev" && mount --make-rslave "$root/dev"

echo "rehearse: $head in a fresh $suite root ($root), cargo home and target dir empty"
echo "rehearse: running '$readme_commands' (log: $log)"
start=$(date +%s)
set +e
chroot "$root" /usr/bin/env -i HOME=/root TERM=dumb LANG=C.UTF-8 \
    PATH=/opt/rust/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    bash -c "cd /work/burn-dist && set -e
        t0=\$(date +%s); cargo xtask pretrain
        t1=\$(date +%s); cargo xtask test
        t2=\$(date +%s)
        echo \"rehearse: pretrain \$((t1 - t0)) s, test \$((t2 - t1)) s\"" >"$log" 2>&1
status=$?
set -e
elapsed=$(($(date +%s) - start))
grep -E '^rehearse:|^test result:|validation' "$log" | tail -n 40 || true
if [ "$status" -eq 0 ]; then
    echo "rehearse: PASSED at $head in ${elapsed} s"
else
    tail -n 40 "$log"
    echo "rehearse: FAILED at $head (exit $status) after ${elapsed} s; full log: $log" >&2
fi
exit "$status"

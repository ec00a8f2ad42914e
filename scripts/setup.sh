#!/usr/bin/env bash
# Prepare a fresh Debian 12 machine for unbroken: system packages, a Rust toolchain, a release build.
# Idempotent: installs only what is missing. Run as root (CI=true, no stdin) or as a user with sudo.
# Environment: UNBROKEN_SKIP_APT=1 skips the package step.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
log() { printf '[setup] %s\n' "$*"; }

SUDO=()
if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1; then
        if [ -t 0 ]; then SUDO=(sudo); else SUDO=(sudo -n); fi
    else
        log "error: not root and no sudo: cannot install packages" >&2
        exit 1
    fi
fi

# iputils-ping is not in the lab's own needs list but its tests ping across namespaces.
# python3-redis: the redis-py client of the replica-mode demo and tests (run with /usr/bin/python3).
PKGS=(iproute2 iptables nftables socat tcpdump iputils-arping iputils-ping ethtool redis-server nginx
      curl wget iperf3 wrk procps ca-certificates build-essential pkg-config python3 python3-redis)

# The BPF fast path's build (crates/drivers/build.rs runs clang -target bpf): the compiler,
# libbpf's bpf_helpers.h and the kernel's UAPI headers. Without recommends (LLVM's whole
# toolchain is not needed).
BPF_PKGS=(clang libbpf-dev linux-libc-dev)

installed() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q 'install ok installed'; }

if [ "${UNBROKEN_SKIP_APT:-0}" = "1" ]; then
    log "UNBROKEN_SKIP_APT=1: not touching system packages"
else
    missing=()
    for p in "${PKGS[@]}"; do
        installed "$p" || missing+=("$p")
    done
    missing_bpf=()
    for p in "${BPF_PKGS[@]}"; do
        installed "$p" || missing_bpf+=("$p")
    done
    if [ "${#missing[@]}" -eq 0 ] && [ "${#missing_bpf[@]}" -eq 0 ]; then
        log "system packages: all $(( ${#PKGS[@]} + ${#BPF_PKGS[@]} )) present"
    else
        log "system packages missing: ${missing[*]} ${missing_bpf[*]}"
        log "apt-get update"
        "${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update
        if [ "${#missing[@]}" -gt 0 ]; then
            log "apt-get install -y ${missing[*]}"
            "${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y "${missing[@]}" </dev/null
        fi
        if [ "${#missing_bpf[@]}" -gt 0 ]; then
            log "apt-get install -y --no-install-recommends ${missing_bpf[*]}"
            "${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${missing_bpf[@]}" </dev/null
        fi
    fi
fi

# Rust: the workspace's rust-version is the minimum; rustup (non-interactive) when cargo is absent
# or too old (Debian's own cargo is 1.65).
want="$(sed -n 's/^rust-version *= *"\([0-9.]*\)".*/\1/p' "$ROOT/Cargo.toml" | head -n1)"
want="${want:-1.75}"
if ! command -v cargo >/dev/null 2>&1 && [ -f "$HOME/.cargo/env" ]; then
    # shellcheck disable=SC1091
    . "$HOME/.cargo/env"
fi
version_ok() {
    local have
    have="$(cargo --version 2>/dev/null | awk '{print $2}')" || return 1
    [ -n "$have" ] && [ "$(printf '%s\n%s\n' "$want" "$have" | sort -V | head -n1)" = "$want" ]
}
if command -v cargo >/dev/null 2>&1 && version_ok; then
    log "rust: $(cargo --version) (>= $want)"
elif command -v rustup >/dev/null 2>&1; then
    log "rust: cargo missing or older than $want: rustup toolchain install stable"
    rustup toolchain install stable --profile minimal
    rustup default stable
else
    log "rust: cargo missing or older than $want: installing rustup (stable, minimal profile) into $HOME/.cargo"
    curl --proto '=https' --tlsv1.2 -sSf https://sh.rustup.rs \
        | sh -s -- -y --no-modify-path --profile minimal --default-toolchain stable
    # shellcheck disable=SC1091
    . "$HOME/.cargo/env"
fi
log "rust: $(cargo --version), $(rustc --version)"

log "cargo build --release --workspace (in $ROOT)"
cd "$ROOT"
cargo build --release --workspace
log "done"
